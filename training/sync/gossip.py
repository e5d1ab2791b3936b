"""Gossip (`gossip:P`): no global exchange until the end.

Every P steps each cluster leader averages with its neighbours in the graph the planner
prices (`gossip_graph`, built from the job's link table: the bandwidth-ordered ring plus the
exponential graph's chords whose links are as fast as the ring's slowest edge; the plain ring
without a link table), so a round sends `degree` messages per cluster (each cluster its own
degree: 2 on a ring of 3 or more, 1 with two clusters, more where fast chords were kept),
whatever the number of clusters. What a leader sends is the change of its parameters since
its previous message, compressed with error feedback like any exchange; every leader keeps
a replica of each neighbour's parameters (and of its own as the neighbours see it) built
from those messages, and mixes `x += sum_j w_ij (x_j - x_me)` over the replicas with
Metropolis weights w_ij = 1 / (1 + max(d_i, d_j)) (CHOCO-style), each row weighted by the
clusters' batch shares (`metropolis_weights`), so that a round among clusters that all
neighbour each other is the share-weighted mean local SGD takes. After the last step one
uncompressed all-reduce averages every cluster's parameters, weighted by batch share, so one
model comes out.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from grammar import Compression, CompressionKind, Sync
from training.collective import flatten, split
from training.compression import Compressor, make_compressor
from training.exchange import decode, encode, param_pieces
from training.results import ExchangeCounters, WanBytes
from training.sync.base import Scope, SyncContext, SyncStrategy, count_leaders_sends
from training.sync.hetero import gossip_graph, metropolis_weights


class GossipSync(SyncStrategy):
    """`gossip:P`: see the module docstring.

    It shrinks and grows in place: a re-formed run builds the graph of its clusters again,
    and every replica starts from the same point (the task's initial model, as at a fresh
    start), so the first message after it carries a cluster's whole change and the replicas
    of every neighbour agree again."""

    regroups = True
    global_rounds = False
    exchanges_gradients = False

    def __init__(self, sync: Sync, ctx: SyncContext) -> None:
        super().__init__(sync, ctx)
        self.period = sync.period
        self.graph = gossip_graph(self.comm.clusters, self.comm.links)
        self.weights = metropolis_weights(self.graph, ctx.cluster_shares)[self.comm.cluster]
        self.neighbours = self.graph[self.comm.cluster]
        start = flatten([p.detach() for p in ctx.params]).to("cpu", torch.float32)
        self.sent_point = start.clone()  # the parameters my last message brought them to
        self.replicas = {c: start.clone() for c in [self.comm.cluster, *self.neighbours]}
        self.compressor: Compressor = make_compressor(self.compression)
        self.decompressors: dict[str, Compressor] = {}
        self.rounds = 0
        self.messages = 0
        self.sent: dict[tuple[str, str], int] = {}
        self.messages_by_cluster: dict[str, int] = {}  # every leader's, after `finish`

    @property
    def scope(self) -> Scope:
        return Scope.CLUSTER

    def after_backward(self, grad: torch.Tensor, step: int, compute_s: float) -> torch.Tensor:
        self.comm.reduce(grad)
        return grad

    def after_step(self, step: int) -> None:
        if (step + 1) % self.period == 0 and step + 1 < self.spec.steps and self.neighbours:
            self._gossip(step)

    def _params(self) -> torch.Tensor:
        return flatten([p.detach() for p in self.ctx.params])

    def _set(self, flat: torch.Tensor) -> None:
        shapes = [p.shape for p in self.ctx.params]
        with torch.no_grad():
            for p, v in zip(self.ctx.params, split(flat, shapes), strict=True):
                p.copy_(v)

    def _gossip(self, step: int) -> None:
        cur = self._params()
        if self.comm.is_leader:
            cur = self._mix(step, cur.to("cpu", torch.float32)).to(cur.device, cur.dtype)
        self.comm.broadcast(cur)
        self._set(cur)

    def _mix(self, step: int, x: torch.Tensor) -> torch.Tensor:
        """Leader: one round with the neighbours; the mixed parameters."""
        exchanger = self.comm.exchanger
        assert exchanger is not None
        paced = exchanger.pace()
        start = time.perf_counter()
        me = self.comm.cluster
        pieces = param_pieces(self.comm.names, self.comm.shapes, 0, x.numel())
        delta = x - self.sent_point
        tensors = [delta[p.lo : p.hi].view(p.shape) for p in pieces]
        payload = encode(self.compression, self.compressor, [p.key for p in pieces], tensors, {})
        self.compressor.step()
        got = self._swap(payload)
        self.decompressors.setdefault(str(self.compression), make_compressor(self.compression))
        for c, data in [(me, payload), *got.items()]:
            message = decode(c, data, self.decompressors)
            self.replicas[c] += torch.cat([t.reshape(-1).float() for t in message.tensors])
        degree = len(self.neighbours)
        mixed = x + sum(
            (self.weights[c] * (self.replicas[c] - self.replicas[me]) for c in self.neighbours),
            torch.zeros_like(x),
        )
        self.sent_point = x.clone()  # the next message carries the mixing step too
        sent = {(me, c): len(payload) for c in self.neighbours}
        need = 0.0
        links = self.comm.links_now(step)
        if links is not None:
            found = [links.get(me, c) for c in self.neighbours]
            need = max((x.transfer_s(len(payload)) for x in found if x is not None), default=0.0)
        elapsed = time.perf_counter() - start
        if need > elapsed:
            time.sleep(need - elapsed)
        exchanger.sent_by_me(start, sent)
        self.rounds += 1
        self.messages += degree
        for edge, n in sent.items():
            self.sent[edge] = self.sent.get(edge, 0) + n
        exchanger.counters = exchanger.counters + ExchangeCounters(
            wan_bytes=WanBytes(sent),
            raw_bytes=degree * x.numel() * 4,
            sent_bytes=sum(sent.values()),
            rounds=1,
            wall_s=time.perf_counter() - start,
            link_s=need,
            paced_s=paced,
        )
        return mixed

    def _swap(self, payload: bytes) -> dict[str, bytes]:
        """Send `payload` to every neighbour, receive each neighbour's (point to point)."""
        exchanger = self.comm.exchanger
        assert exchanger is not None
        group = exchanger.group
        index = {c: i for i, c in enumerate(self.comm.clusters)}
        size = torch.tensor([len(payload)], dtype=torch.int64)
        sizes = {c: torch.zeros(1, dtype=torch.int64) for c in self.neighbours}
        works = [dist.isend(size, group=group, group_dst=index[c]) for c in self.neighbours]
        works += [dist.irecv(sizes[c], group=group, group_src=index[c]) for c in self.neighbours]
        for w in works:
            if w is not None:
                w.wait()
        out = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        bufs = {c: torch.empty(int(sizes[c]), dtype=torch.uint8) for c in self.neighbours}
        works = [dist.isend(out, group=group, group_dst=index[c]) for c in self.neighbours]
        works += [dist.irecv(bufs[c], group=group, group_src=index[c]) for c in self.neighbours]
        for w in works:
            if w is not None:
                w.wait()
        return {c: bytes(b.numpy().tobytes()) for c, b in bufs.items()}

    def finish(self) -> None:
        """Consensus: every cluster's parameters averaged (weighted by batch share)."""
        if len(self.comm.clusters) < 2:
            return
        cur = self._params()
        if self.comm.is_leader:
            exchanger = self.comm.exchanger
            assert exchanger is not None
            count_leaders_sends(self.comm, self.sent)
            self.sent.clear()
            counts: list[Any] = [None] * len(self.comm.clusters)
            dist.all_gather_object(counts, self.messages, group=exchanger.group)
            self.messages_by_cluster = {
                c: int(n) for c, n in zip(self.comm.clusters, counts, strict=True)
            }
            share = self.ctx.cluster_share
            # uncompressed: the parameters themselves (not a residual-fed change) cross once
            cur = self.comm.wan_sum(cur * share, self.spec.steps, Compression(CompressionKind.NONE))
        self.comm.broadcast(cur)
        self._set(cur)

    def at_sync_point(self, step: int) -> bool:
        return step == self.spec.steps

    def stats(self) -> dict[str, float]:
        """This cluster's degree and messages per round, and on leaders after the run every
        cluster's (`degree.<c>` from the graph, `messages_per_round.<c>` as sent)."""
        out = {
            "degree": float(len(self.neighbours)),
            "rounds": float(self.rounds),
            "messages_per_round": self.messages / self.rounds if self.rounds else 0.0,
            "edges": float(sum(len(ns) for ns in self.graph.values()) // 2),
        }
        for c, ns in self.graph.items():
            out[f"degree.{c}"] = float(len(ns))
        for c, n in self.messages_by_cluster.items():
            out[f"messages_per_round.{c}"] = n / self.rounds if self.rounds else 0.0
        return out
