"""Asynchronous parameter server (`async-ps:S`): clusters never wait for each other.

A Ray actor (`ParameterServer`, at the best-connected cluster leader, `ps_host`) holds the
parameters and one version counter, so staleness is exact. Each tick a cluster takes as many
local steps as fit in one step of the slowest, then its leader pushes its progress since its
last pull (compressed, with error feedback) and gets back how the server moved since. An
update more than S versions stale is down-weighted, never dropped: a slow cluster's updates
are always the stalest. Across regions a `RegionalServer` per region sits under a global
server (HALoS), so one push and one pull per region cross between regions. Under
`data: local` a bounded-staleness barrier keeps pushes in step, or the model drifts toward
the labels of whoever pushes most. At the end every cluster takes the final parameters.
Design notes and measurements: bench/results/async-ps-notes.md.
"""

from __future__ import annotations

import json
import statistics
import struct
import time
import uuid
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from grammar import Compression, CompressionKind, Sync, parse_compression
from training.collective import flatten, split
from training.compression import Compressor, make_compressor
from training.exchange import Piece, decode, encode, param_pieces
from training.faults import GroupBroken
from training.results import ExchangeCounters, WanBytes
from training.sync.base import Scope, SyncContext, SyncStrategy, count_leaders_sends
from training.sync.hetero import (
    region_groups,
    region_hosts,
    staleness_weight,
    steps_per_tick,
)
from training.wan import Link, Pacer


class ParameterServer:
    """The server's state: the parameters, their version, what it heard of each cluster.
    Run as a Ray actor (calls are serialised, so versions are exact)."""

    def __init__(
        self,
        params: torch.Tensor,
        shares: dict[str, float],
        staleness: int,
        pieces: list[Piece],
    ) -> None:
        self.params = params.clone()
        self.pieces = pieces
        # the parameters each cluster's pulls have brought it to, and one compressor per
        # cluster for its pulls (their error feedback is that cluster's own)
        self.pulled = {c: params.clone() for c in shares}
        self.pull_compressors: dict[str, Compressor] = {}
        self.version = 0
        self.shares = shares
        self.staleness = staleness
        self.step_s: dict[str, float] = {}
        self.decompressors: dict[str, Compressor] = {}
        self.stale_updates = 0
        self.max_staleness = 0

    def push(
        self, cluster: str, payload: bytes, base_version: int, step_s: float
    ) -> tuple[bytes, int, float]:
        """Apply one cluster's update made from version `base_version`; return the change of
        the parameters since that cluster's previous pull (compressed like its push, error
        feedback kept here per cluster), their version and the slowest step time heard."""
        level = Compression(CompressionKind.NONE)
        if step_s > 0:
            self.step_s[cluster] = step_s
        if payload:
            level, message = self._decode(cluster, payload)
            stale = self.version - base_version
            self.max_staleness = max(self.max_staleness, stale)
            if stale > self.staleness:
                self.stale_updates += 1
            weight = self.shares.get(cluster, 0.0) * staleness_weight(stale, self.staleness)
            flat = torch.cat([t.reshape(-1).float() for t in message])
            self.params -= weight * flat
            self.version += 1
        slowest = max(self.step_s.values(), default=0.0)
        if cluster not in self.pull_compressors:
            self.pull_compressors[cluster] = make_compressor(level)
        compressor = self.pull_compressors[cluster]
        change = self.params - self.pulled[cluster]
        tensors = [change[p.lo : p.hi].view(p.shape) for p in self.pieces]
        out = encode(level, compressor, [p.key for p in self.pieces], tensors, {})
        compressor.step()
        _, got = self._decode(cluster, out)
        self.pulled[cluster] += torch.cat([t.reshape(-1).float() for t in got])
        return out, self.version, slowest

    def final(self) -> torch.Tensor:
        """The parameters, exactly (the last pull of every cluster)."""
        return self.params.clone()

    def _decode(self, cluster: str, payload: bytes) -> tuple[Compression, list[torch.Tensor]]:
        """The level a message's header names (its sender's) and its tensors."""
        (hlen,) = struct.unpack_from("<I", payload)
        name = str(json.loads(payload[4 : 4 + hlen])["c"])
        if name not in self.decompressors:
            self.decompressors[name] = make_compressor(name)
        return parse_compression(name), decode(cluster, payload, self.decompressors).tensors

    def stats(self) -> tuple[int, int, int]:
        return self.version, self.stale_updates, self.max_staleness


class RegionalServer(ParameterServer):
    """One region's server under the global one (bench/results/async-ps-notes.md): a
    `ParameterServer` for the region's clusters that exchanges its progress with the global
    server asynchronously (one exchange in flight at a time). Run as a Ray actor; a region
    of one cluster keeps it in that cluster's leader, its only caller."""

    def __init__(
        self,
        params: torch.Tensor,
        shares: dict[str, float],
        staleness: int,
        pieces: list[Piece],
        *,
        region: str,
        host: str,
        global_host: str,
        global_server: Any,
        compression: Compression,
        link: Link | None,
        rate_bps: float | None = None,
        ticks: int = 1,
    ) -> None:
        super().__init__(params, shares, staleness, pieces)
        self.region, self.host, self.global_host = region, host, global_host
        self.pacer = Pacer(rate_bps) if rate_bps else None
        """The host's WAN reservation: its exchanges with the global server keep to it."""
        self.global_server = global_server
        self.compression = compression
        self.link = link  # regional host to global host (None: unshaped or the same)
        # one exchange every `ticks` steps of the slowest (the plan's `relay_ticks`: the bytes
        # are the plan's, not what the clock lets through)
        self.period = max(1, len(shares)) * max(1, ticks)
        self.anchor = params.clone()  # the global parameters as this region last pulled them
        self.global_version = 0
        self.global_slowest = 0.0
        self.up = make_compressor(compression)
        self.pending: Any = None  # the global push in flight
        self.sent_params = params.clone()  # this region's parameters when it was sent
        self.sent_version = 0  # this server's version then
        self.due = 0.0  # when the exchange in flight may land (emulated link time)
        self.reply: tuple[bytes, int, float] | None = None
        self.down: dict[str, Compressor] = {str(compression): make_compressor(compression)}
        self.up_bytes = 0
        self.exchanges = 0
        self.sent: dict[tuple[str, str], int] = {}

    def push(
        self, cluster: str, payload: bytes, base_version: int, step_s: float
    ) -> tuple[bytes, int, float]:
        self._land(block=False)
        pull, version, slowest = super().push(cluster, payload, base_version, step_s)
        paced = self.pacer is not None and self.pacer.wait_s(time.perf_counter()) > 0
        if self.pending is None and self.version - self.sent_version >= self.period and not paced:
            self._send()  # a paced one: a later push sends, the region's progress summed
        return pull, version, max(slowest, self.global_slowest)

    def _send(self) -> None:
        change = self.anchor - self.params
        tensors = [change[p.lo : p.hi].view(p.shape) for p in self.pieces]
        payload = encode(self.compression, self.up, [p.key for p in self.pieces], tensors, {})
        self.up.step()
        slowest = max(self.step_s.values(), default=0.0)
        self.sent_params = self.params.clone()
        self.sent_version = self.version
        if self.pacer is not None:
            self.pacer.sent(time.perf_counter(), len(payload) * 8.0)
        self.pending = self.global_server.push.remote(
            self.region, payload, self.global_version, slowest
        )
        self.up_bytes = len(payload)
        self.due = time.perf_counter() + (
            self.link.transfer_s(len(payload)) if self.link is not None else 0.0
        )
        self._count((self.host, self.global_host), len(payload))

    def _land(self, *, block: bool) -> None:
        """Merge the global server's reply if it is in (and the link had time to carry it):
        the new global parameters plus this region's progress since it sent."""
        import ray

        if self.pending is None:
            return
        if self.reply is None:
            if not block and not ray.wait([self.pending], timeout=0)[0]:
                return
            self.reply = ray.get(self.pending)
            if self.link is not None:
                self.due += self.link.transfer_s(len(self.reply[0]))
        wait = self.due - time.perf_counter()
        if wait > 0:
            if not block:
                return
            time.sleep(wait)
        pull, self.global_version, self.global_slowest = self.reply
        got = decode(self.global_host, pull, self.down).tensors
        fresh = self.anchor + torch.cat([t.reshape(-1).float() for t in got])
        self.params = fresh + (self.params - self.sent_params)
        self.anchor = fresh
        self._count((self.global_host, self.host), len(pull))
        self.pending, self.reply = None, None
        self.exchanges += 1

    def _count(self, edge: tuple[str, str], n: int) -> None:
        if edge[0] != edge[1]:
            self.sent[edge] = self.sent.get(edge, 0) + n

    def flush(self) -> tuple[dict[tuple[str, str], int], int]:
        """After the region's last push: land the exchange in flight, send the rest, land
        it. Returns the region exchanges' WAN bytes by link and how many there were."""
        self._land(block=True)
        if self.pacer is not None:
            time.sleep(self.pacer.wait_s(time.perf_counter()))
        self._send()
        self._land(block=True)
        return dict(self.sent), self.exchanges


def ticks_between_barriers(staleness: int, clusters: int) -> int:
    """Ticks between the leaders' barriers under local data: the largest B whose worst
    staleness (B + 1)(n - 1) stays within S, at least 1 (bench/results/async-ps-notes.md)."""
    if clusters < 2:
        return 1
    return max(1, staleness // (clusters - 1) - 1)


def _call(server: Any, method: str, *args: Any) -> Any:
    """`server.method(*args)`: a Ray actor's, waited for, or this process's own object's."""
    import ray

    if isinstance(server, ray.actor.ActorHandle):
        return ray.get(getattr(server, method).remote(*args))
    return getattr(server, method)(*args)


def _actor(cls: type, name: str) -> Any:
    """`cls` as a named Ray actor on this node (the host's), never restarted."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    return ray.remote(cls).options(
        name=name,
        num_cpus=0,
        max_restarts=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
    )


class AsyncPSSync(SyncStrategy):
    """`async-ps:S`: see the module docstring.

    It shrinks and grows in place: a cluster's loss reaches the others only through the
    server (its host's loss: a push finds the server gone, `GroupBroken`); the re-formed run
    starts new servers from the new global host's parameters, and every cluster takes them
    (`load_state_dict`), losing at most the progress not pushed yet."""

    regroups = True
    global_rounds = False
    exchanges_gradients = False
    WINDOW = 64
    """Local step times the speed estimate is the median of."""

    def __init__(self, sync: Sync, ctx: SyncContext) -> None:
        super().__init__(sync, ctx)
        self.anchor = flatten([p.detach() for p in ctx.params]).clone()
        self.groups = region_groups(self.comm.clusters, self.spec.regions)
        self.region = self.spec.regions.get(self.comm.cluster, "")
        self.hierarchical = len(self.groups) >= 2
        self.global_host, hosts = region_hosts(self.groups, self.comm.links)
        # the server this cluster pushes to lives here (its region's, when hierarchical)
        self.host = hosts[self.region] if self.hierarchical else self.global_host
        self.server: Any = None
        self.global_server: Any = None
        self.region_exchanges = 0
        self.version = 0
        self.mine = 1  # local steps per step
        self.times: list[float] = []  # the last WINDOW local step times
        self.pushes = 0
        self.compressor = make_compressor(self.compression)
        self.decompressors: dict[str, Compressor] = {
            str(self.compression): make_compressor(self.compression)
        }
        self.sent: dict[tuple[str, str], int] = {}
        self.final: tuple[int, int, int] = (0, 0, 0)
        self.final_global: tuple[int, int, int] = (0, 0, 0)
        # under local data the leaders meet every `barrier_every` ticks (0: never)
        self.barrier_every = (
            ticks_between_barriers(self.sync.staleness, len(self.comm.clusters))
            if self.spec.data == "local"
            else 0
        )
        self.barriers = 0
        self.started = False
        """The servers run (`load_state_dict` started or joined them)."""

    @property
    def scope(self) -> Scope:
        return Scope.CLUSTER

    def local_steps(self, step: int) -> int:
        return self.mine

    def after_backward(self, grad: torch.Tensor, step: int, compute_s: float) -> torch.Tensor:
        self.times.append(self.ctx.device_s())
        del self.times[: -self.WINDOW]
        self.comm.reduce(grad)
        return grad

    # ------------------------------------------------------------------ the server

    def load_state_dict(
        self, state: Mapping[str, Any] | None, cluster_state: Mapping[str, Any] | None
    ) -> None:
        """Start the server from the (restored) parameters; leaders learn its name. With a
        `state` (a resume, or a run re-formed without a cluster) the clusters' parameters may
        differ: every cluster then takes the new server's (its host's), counted as set-up
        bytes. A state passed on once the servers run (a newcomer's, `Worker._agree`) is
        only this cluster's new anchor."""
        self.anchor = flatten([p.detach() for p in self.ctx.params]).clone()
        if len(self.comm.clusters) < 2 or self.started:
            return
        self.started = True
        if self.comm.is_leader:
            self._start_servers(take=state is not None)
        if state is not None:
            flat = self.anchor.to(self.comm.device)
            self.comm.broadcast(flat)
            self._load(flat)

    def _start_servers(self, *, take: bool) -> None:
        """Leaders: the global server (and each region's) from the global host's parameters;
        `take`: every leader first takes those as its own anchor."""
        import ray

        exchanger = self.comm.exchanger
        assert exchanger is not None
        shares = dict(self.ctx.cluster_shares)
        pieces = param_pieces(self.comm.names, self.comm.shapes, 0, self.anchor.numel())
        name = [f"cpn-ps-{uuid.uuid4().hex[:12]}"]  # the global server's; regions' add -region
        src = self.comm.clusters.index(self.global_host)
        dist.broadcast_object_list(name, group=exchanger.group, group_src=src)
        me = self.comm.cluster
        if me == self.global_host:
            weights = shares
            if self.hierarchical:  # the global server weights each region by its share
                weights = {
                    r: sum(shares.get(c, 0.0) for c in members)
                    for r, members in self.groups.items()
                }
            self.global_server = _actor(ParameterServer, name[0]).remote(
                self.anchor.cpu(), weights, self.sync.staleness, pieces
            )
            # up before any step: a region's exchanges do not wait for it, and would find
            # none answered while its process starts
            ray.get(self.global_server.stats.remote())
        # the global server is named before its name is used: a barrier between
        dist.barrier(group=exchanger.group)
        if self.global_server is None:
            self.global_server = ray.get_actor(name[0])
        if take:
            self.anchor = ray.get(self.global_server.final.remote())
            if me != self.global_host:
                exchanger.count_setup({(self.global_host, me): self.anchor.numel() * 4})
        self.server = self.global_server
        if self.hierarchical:
            self.server = None
            if me == self.host:
                members = self.groups[self.region]
                total = sum(shares.get(c, 0.0) for c in members) or 1.0
                links = self.comm.links
                link = links.get(me, self.global_host) if links is not None else None
                # a region of one cluster: its server is its leader's own object, so a push
                # is no call to another process (its only caller is here)
                make = (
                    RegionalServer
                    if len(members) == 1
                    else _actor(RegionalServer, f"{name[0]}-{self.region}").remote
                )
                self.server = make(
                    self.anchor.cpu(),
                    {c: shares.get(c, 0.0) / total for c in members},
                    self.sync.staleness,
                    pieces,
                    region=self.region,
                    host=me,
                    global_host=self.global_host,
                    global_server=self.global_server,
                    compression=self.compression,
                    link=link if me != self.global_host else None,
                    rate_bps=None if exchanger.pacer is None else exchanger.pacer.rate_bps,
                    ticks=self.spec.relay_ticks.get(self.region, 1),
                )
                _call(self.server, "stats")  # up before any push
            dist.barrier(group=exchanger.group)
            if self.server is None:
                self.server = ray.get_actor(f"{name[0]}-{self.region}")

    def _push(self, step: int, delta: torch.Tensor) -> torch.Tensor:
        """Leader: push `delta` (compressed), return the server's fresh parameters."""
        import ray

        exchanger = self.comm.exchanger
        assert exchanger is not None
        paced = exchanger.pace() if self.comm.cluster != self.host else 0.0
        start = time.perf_counter()
        cpu = delta.detach().to("cpu", torch.float32).reshape(-1)
        pieces = param_pieces(self.comm.names, self.comm.shapes, 0, cpu.numel())
        tensors = [cpu[p.lo : p.hi].view(p.shape) for p in pieces]
        payload = encode(self.compression, self.compressor, [p.key for p in pieces], tensors, {})
        self.compressor.step()
        # the median device time of the last steps (`SyncContext.device_s`): one stalled
        # step must not make a cluster look slow
        mean_s = statistics.median(self.times) if self.times else 0.0
        try:
            pull, self.version, slowest = _call(
                self.server, "push", self.comm.cluster, payload, self.version, mean_s
            )
        except ray.exceptions.RayActorError as exc:  # its host's worker (and cluster) is gone
            raise GroupBroken(f"the parameter server at {self.host} is gone: {exc}") from None
        got = decode(self.host, pull, self.decompressors).tensors
        view = self.anchor.to("cpu", torch.float32) + torch.cat(
            [t.reshape(-1).float() for t in got]
        )
        self.mine = steps_per_tick(mean_s, slowest, self.spec.speed_bound)
        me, host = self.comm.cluster, self.host
        sent: dict[tuple[str, str], int] = {}
        need = 0.0
        if me != host:  # the push and the pull cross the WAN; at the host they stay local
            pulled = len(pull)
            sent = {(me, host): len(payload), (host, me): pulled}
            links = self.comm.links_now(step)
            link = links.get(me, host) if links is not None else None
            if link is not None:
                need = link.transfer_s(len(payload)) + link.transfer_s(pulled)
        elapsed = time.perf_counter() - start
        if need > elapsed:
            time.sleep(need - elapsed)
        for edge, n in sent.items():
            self.sent[edge] = self.sent.get(edge, 0) + n
        exchanger.sent_by_me(start, sent)  # the push against this cluster's reservation
        exchanger.counters = exchanger.counters + ExchangeCounters(
            wan_bytes=WanBytes(sent),
            raw_bytes=2 * cpu.numel() * 4 if sent else 0,
            sent_bytes=sum(sent.values()),
            rounds=1,
            wall_s=time.perf_counter() - start,
            link_s=need,
            paced_s=paced,
        )
        self.pushes += 1
        return view.to(delta.device, delta.dtype)

    # ------------------------------------------------------------------ per step

    def after_step(self, step: int) -> None:
        if len(self.comm.clusters) < 2:
            return
        params = self.ctx.params
        cur = flatten([p.detach() for p in params])
        mine = torch.tensor([float(self.mine)])
        if self.comm.is_leader:
            cur = self._push(step, self.anchor - cur)
            mine[0] = float(self.mine)
            tick = step + 1  # `step` counts from 0; the last tick's meeting is `finish`
            if self.barrier_every and tick % self.barrier_every == 0 and tick < self.spec.steps:
                self._barrier(step)
        both = torch.cat([cur, mine.to(cur.device, cur.dtype)])
        self.comm.broadcast(both)
        self.mine = int(both[-1].item())
        self._load(both[:-1])

    def _barrier(self, step: int) -> None:
        """Leader: wait until every cluster has pushed this tick (local data; the module
        docstring says why), plus the round trip to the server's host it would take."""
        exchanger = self.comm.exchanger
        assert exchanger is not None
        start = time.perf_counter()
        dist.barrier(group=exchanger.group)
        links = self.comm.links_now(step)
        me, host = self.comm.cluster, self.global_host
        link = links.get(me, host) if links is not None and me != host else None
        need = link.rtt_s if link is not None else 0.0
        elapsed = time.perf_counter() - start
        if need > elapsed:
            time.sleep(need - elapsed)
        self.barriers += 1

    def _load(self, flat: torch.Tensor) -> None:
        self.anchor = flat.clone()
        with torch.no_grad():
            for p, v in zip(
                self.ctx.params, split(flat, [p.shape for p in self.ctx.params]), strict=True
            ):
                p.copy_(v)

    def finish(self) -> None:
        """The leaders meet once, after every push is in, and all take the final model (the
        global server's, after every region sent its last progress)."""
        if len(self.comm.clusters) < 2:
            return
        import ray

        cur = flatten([p.detach() for p in self.ctx.params])
        if self.comm.is_leader:
            exchanger = self.comm.exchanger
            assert exchanger is not None
            if self.hierarchical:
                self._flush_regions()
            # every leader's pushes counted on every leader (each knows only its own so far)
            count_leaders_sends(self.comm, self.sent)
            self.sent.clear()
            fresh = ray.get(self.global_server.final.remote())
            self.final = _call(self.server, "stats")
            self.final_global = ray.get(self.global_server.stats.remote())
            # the exact final model, once, uncompressed, to every cluster but the host's
            host = self.global_host
            last = {(host, c): fresh.numel() * 4 for c in self.comm.clusters if c != host}
            exchanger.counters = exchanger.counters + ExchangeCounters(
                wan_bytes=WanBytes(last), sent_bytes=sum(last.values())
            )
            cur = fresh.to(cur.device, cur.dtype)
        self.comm.broadcast(cur)
        self._load(cur)

    def _flush_regions(self) -> None:
        """Leaders: once every cluster's last push is in, each regional server sends its last
        progress; its exchanges' bytes count as its host's sends."""

        exchanger = self.comm.exchanger
        assert exchanger is not None
        dist.barrier(group=exchanger.group)
        exchanges = 0
        if self.comm.cluster == self.host:
            sent, exchanges = _call(self.server, "flush")
            for edge, n in sent.items():
                self.sent[edge] = self.sent.get(edge, 0) + n
            exchanger.counters = exchanger.counters + ExchangeCounters(
                wan_bytes=WanBytes(sent), sent_bytes=sum(sent.values())
            )
        # every region's count on every leader; also the barrier after every flush
        got: list[Any] = [None] * len(self.comm.clusters)
        dist.all_gather_object(got, exchanges, group=exchanger.group)
        self.region_exchanges = sum(int(n) for n in got)

    def at_sync_point(self, step: int) -> bool:
        return step == self.spec.steps

    def stats(self) -> dict[str, float]:
        """This cluster's server's counts (its region's, when hierarchical), and with
        regions the global server's and how many region exchanges crossed to it."""
        version, stale, worst = self.final
        out = {
            "host": float(self.comm.clusters.index(self.host)),
            "pushes": float(self.pushes),
            "versions": float(version),
            "stale_updates": float(stale),
            "max_staleness": float(worst),
            "local_steps_per_step": float(self.mine),
            "barriers": float(self.barriers),
        }
        if self.hierarchical:
            gversion, gstale, gworst = self.final_global
            out |= {
                "regions": float(len(self.groups)),
                "global_host": float(self.comm.clusters.index(self.global_host)),
                "region_exchanges": float(self.region_exchanges),
                "global_versions": float(gversion),
                "global_stale_updates": float(gstale),
                "global_max_staleness": float(gworst),
            }
        return out

    def close(self) -> None:
        import ray

        me = self.comm.cluster
        if isinstance(self.server, ray.actor.ActorHandle) and me == self.host:
            ray.kill(self.server, no_restart=True)
        if self.hierarchical and self.global_server is not None and me == self.global_host:
            ray.kill(self.global_server, no_restart=True)
        self.server = self.global_server = None
