"""Asynchronous parameter server (`async-ps:S`): clusters never wait for each other.

The server is one Ray actor hosted at one cluster leader's node (the cluster with the most
bandwidth to the others, `ps_host`; not sharded: with a handful of clusters one host's links
carry the pushes, and a single version counter keeps staleness exact). Each step a cluster
takes as many local steps as fit into one step of the slowest cluster (the server tells every
pusher the slowest step time it has heard), then its leader pushes its progress since its
last pull (anchor - parameters, compressed with error feedback like any exchange) and gets
back, in the same call, how the server's parameters moved since its previous pull,
compressed the same way (the server keeps each cluster's pull residual); no cross-cluster
collective runs until the end. The server adds each update weighted by the cluster's batch
share, and an update more than S versions stale is down-weighted by (S + 1) / (staleness + 1),
not dropped (`staleness_weight`: a slow cluster's updates are always the stalest; dropping
them would throw its data away). After the last step the leaders meet once and all pull the
final parameters exactly (uncompressed, once), so one model comes out.
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

from grammar import Sync
from training.collective import flatten, split
from training.compression import Compressor, make_compressor
from training.exchange import Piece, decode, encode, param_pieces
from training.results import ExchangeCounters, WanBytes
from training.sync.base import Scope, SyncContext, SyncStrategy, count_leaders_sends
from training.sync.hetero import ps_host, staleness_weight, steps_per_tick


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
        level = "none"
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

    def _decode(self, cluster: str, payload: bytes) -> tuple[str, list[torch.Tensor]]:
        (hlen,) = struct.unpack_from("<I", payload)
        level = str(json.loads(payload[4 : 4 + hlen])["c"])
        if level not in self.decompressors:
            self.decompressors[level] = make_compressor(level)
        return level, decode(cluster, payload, self.decompressors).tensors

    def stats(self) -> tuple[int, int, int]:
        return self.version, self.stale_updates, self.max_staleness


class AsyncPSSync(SyncStrategy):
    """`async-ps:S`: see the module docstring."""

    exchanges_gradients = False
    WINDOW = 64
    """Local step times the speed estimate is the median of."""

    def __init__(self, sync: Sync, ctx: SyncContext) -> None:
        super().__init__(sync, ctx)
        self.anchor = flatten([p.detach() for p in ctx.params]).clone()
        self.host = ps_host(self.comm.clusters, self.comm.links)
        self.server: Any = None
        self.version = 0
        self.mine = 1  # local steps per step
        self.times: list[float] = []  # the last WINDOW local step times
        self.pushes = 0
        self.compressor = make_compressor(self.compression)
        self.decompressors: dict[str, Compressor] = {
            self.compression: make_compressor(self.compression)
        }
        self.sent: dict[tuple[str, str], int] = {}
        self.final: tuple[int, int, int] = (0, 0, 0)

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
        """Start the server from the (restored) parameters; leaders learn its name."""
        self.anchor = flatten([p.detach() for p in self.ctx.params]).clone()
        if not self.comm.is_leader or len(self.comm.clusters) < 2:
            return
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        exchanger = self.comm.exchanger
        assert exchanger is not None
        name = [""]
        if self.comm.cluster == self.host:
            name[0] = f"cpn-ps-{uuid.uuid4().hex[:12]}"
            here = ray.get_runtime_context().get_node_id()
            self.server = (
                ray.remote(ParameterServer)
                .options(
                    name=name[0],
                    num_cpus=0,
                    max_restarts=0,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
                )
                .remote(
                    self.anchor.cpu(),
                    dict(self.ctx.cluster_shares),
                    self.sync.staleness,
                    param_pieces(self.comm.names, self.comm.shapes, 0, self.anchor.numel()),
                )
            )
        src = self.comm.clusters.index(self.host)
        dist.broadcast_object_list(name, group=exchanger.group, group_src=src)
        if self.server is None:
            self.server = ray.get_actor(name[0])

    def _push(self, step: int, delta: torch.Tensor) -> torch.Tensor:
        """Leader: push `delta` (compressed), return the server's fresh parameters."""
        import ray

        exchanger = self.comm.exchanger
        assert exchanger is not None
        start = time.perf_counter()
        cpu = delta.detach().to("cpu", torch.float32).reshape(-1)
        pieces = param_pieces(self.comm.names, self.comm.shapes, 0, cpu.numel())
        tensors = [cpu[p.lo : p.hi].view(p.shape) for p in pieces]
        payload = encode(self.compression, self.compressor, [p.key for p in pieces], tensors, {})
        self.compressor.step()
        # the median device time of the last steps (`SyncContext.device_s`): one stalled
        # step must not make a cluster look slow
        mean_s = statistics.median(self.times) if self.times else 0.0
        pull, self.version, slowest = ray.get(
            self.server.push.remote(self.comm.cluster, payload, self.version, mean_s)
        )
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
        exchanger.counters = exchanger.counters + ExchangeCounters(
            wan_bytes=WanBytes(sent),
            raw_bytes=2 * cpu.numel() * 4 if sent else 0,
            sent_bytes=sum(sent.values()),
            rounds=1,
            wall_s=time.perf_counter() - start,
            link_s=need,
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
        both = torch.cat([cur, mine.to(cur.device, cur.dtype)])
        self.comm.broadcast(both)
        self.mine = int(both[-1].item())
        self._load(both[:-1])

    def _load(self, flat: torch.Tensor) -> None:
        self.anchor = flat.clone()
        with torch.no_grad():
            for p, v in zip(
                self.ctx.params, split(flat, [p.shape for p in self.ctx.params]), strict=True
            ):
                p.copy_(v)

    def finish(self) -> None:
        """The leaders meet once, after every push is in, and all take the final model."""
        if len(self.comm.clusters) < 2:
            return
        import ray

        cur = flatten([p.detach() for p in self.ctx.params])
        if self.comm.is_leader:
            exchanger = self.comm.exchanger
            assert exchanger is not None
            # every leader's pushes counted on every leader (each knows only its own so far)
            count_leaders_sends(self.comm, self.sent)
            self.sent.clear()
            fresh = ray.get(self.server.final.remote())
            self.final = ray.get(self.server.stats.remote())
            # the exact final model, once, uncompressed, to every cluster but the host's
            last = {(self.host, c): fresh.numel() * 4 for c in self.comm.clusters if c != self.host}
            exchanger.counters = exchanger.counters + ExchangeCounters(
                wan_bytes=WanBytes(last), sent_bytes=sum(last.values())
            )
            cur = fresh.to(cur.device, cur.dtype)
        self.comm.broadcast(cur)
        self._load(cur)

    def at_sync_point(self, step: int) -> bool:
        return step == self.spec.steps

    def stats(self) -> dict[str, float]:
        version, stale, worst = self.final
        return {
            "host": float(self.comm.clusters.index(self.host)),
            "pushes": float(self.pushes),
            "versions": float(version),
            "stale_updates": float(stale),
            "max_staleness": float(worst),
            "local_steps_per_step": float(self.mine),
        }

    def close(self) -> None:
        if self.server is not None and self.comm.cluster == self.host:
            import ray

            ray.kill(self.server, no_restart=True)
        self.server = None
