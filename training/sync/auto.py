"""Auto: the runtime picks sync mode, period and compressor (`training.auto`) and re-decides.

The first `WARMUP` steps run local SGD with one exchange at their end: every rank times what
of its steps a WAN exchange can hide under (forward/backward, the intra-cluster all-reduce
and the optimizer step; on the testbed forward/backward alone was 0.09-0.12 s of a 0.36 s
step, and auto picked periods too long), the leaders time that exchange, and one all-reduce
(max) over all ranks gives every rank the same slowest compute time and exchange time, so
every rank decides the same. The link table, where there is one, gives the bandwidth instead
of the measured exchange. Afterwards the same measurements are taken at every sync point of
what runs (each local SGD or streaming period; every `OBSERVE_EVERY` steps under every-step)
and `AutoPolicy` switches mode when they moved by more than its factor for a few rounds.

A planned run (`TrainSpec.adapt`: a job the control plane runs, whose user left sync or
compression to `auto`) has no warm-up: it starts on its plan's mode, anchors the policy on
the plan's link and its first measured compute, and switches only when the link moves; under
fault domains it keeps to the modes that survive a lost cluster in place, as its plan did.

Switches happen only where every cluster holds the same parameters, since the next mode
takes its anchor (or its every-step replicas) from them: right after a local SGD exchange or
an every-step step; streaming, whose fragments are at every step in a different state of
sync, is first drained (what is in flight applied, every other fragment averaged once more:
one blocking exchange of the model). Nothing is lost but the outer momentum. Under streaming the
exchanges run on its background thread; their wall time and bytes land in the same counters
when each finishes, so a window's measurement misses the fragment still in flight at its end
and counts it in the next: the bytes over the time stays the link's, and a slower link shows
as longer exchanges there (the workers' waits for late fragments are not needed for it).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from grammar import Compression, CompressionKind, Sync, SyncKind, parse_compression, parse_sync
from grammar.auto import SURVIVES_LOSS
from training.auto import AutoPolicy, Decision, link_from_exchange, parse_fixed
from training.collective import split
from training.compression import make_compressor
from training.results import AutoChoice
from training.sync.base import Scope, SyncContext, SyncStrategy, regroups
from training.sync.every_step import EveryStepSync
from training.sync.local_sgd import LocalSGDSync
from training.sync.streaming import StreamingSync
from training.wan import Link

_NONE = Compression(CompressionKind.NONE)

WARMUP = 4
"""Steps measured before the first decision (the first one, warming caches, is not counted)."""
OBSERVE_EVERY = 8
"""Under every-step: steps between two measurements."""


class AutoSync(SyncStrategy):
    """Runs the strategy the policy picked (`self.inner`), measuring as it goes."""

    exchanges_gradients = False  # the ladder's compressors carry no momentum correction

    def __init__(self, sync: Sync, ctx: SyncContext) -> None:
        self.inner: SyncStrategy | None = None
        super().__init__(sync, ctx)
        spec = ctx.spec
        self.planned = bool(spec.adapt)
        """Started on the plan's sync and compression (no warm-up), re-deciding what
        `spec.adapt` leaves open."""
        if self.planned:
            fixed_sync = None if "sync" in spec.adapt else spec.sync
            fixed_compression = None if "compression" in spec.adapt else str(spec.compression)
        else:
            fixed_sync, fixed_compression = parse_fixed(spec.sync, spec.compression)
        params = sum(p.numel() for p in ctx.params)
        live = self.planned and spec.fault_domains and regroups(spec.sync)
        self.policy = AutoPolicy(
            params,
            len(ctx.comm.clusters),
            fixed_sync=fixed_sync,
            fixed_compression=fixed_compression,
            crossings=_crossings(len(ctx.comm.clusters)),
            local_data=spec.data == "local",
            kinds=SURVIVES_LOSS if live else None,
            watch_compute=not self.planned,
        )
        self.warmup = max(1, min(WARMUP, spec.steps))
        if self.planned:
            table = ctx.comm.links_now(0)
            link = table.slowest(ctx.comm.clusters) if table is not None else None
            self.policy.start(spec.sync, str(spec.compression), link)
            self.inner = _strategy(spec.sync, ctx)
            self.inner.compression = spec.compression
        else:
            self.inner = LocalSGDSync(Sync(SyncKind.LOCAL_SGD, period=self.warmup), ctx)
            self.inner.compression = parse_compression(fixed_compression or "int8")
        self.computes: list[float] = []
        """Per step, the seconds a WAN exchange can hide under: forward/backward, the
        intra-cluster all-reduce and the optimizer step, without the step's WAN waits."""
        self.window = 0.0
        self.applied_from: float | None = None
        self.mark = self._leader_mark()
        self.seating = False
        """Members joined late sit out (`sitting_out`): nothing is decided until they sit in."""
        self.choices: list[AutoChoice] = []
        self.past_stats: dict[str, float] = {}
        """`stats` of the modes run before the current one, summed."""

    # -------------------------------------------------------------- delegation

    @property
    def compression(self) -> Compression:
        return self.inner.compression if self.inner is not None else _NONE

    @compression.setter
    def compression(self, value: Compression) -> None:
        if self.inner is not None:
            self.inner.compression = value

    @property
    def scope(self) -> Scope:
        assert self.inner is not None
        return self.inner.scope

    def after_backward(self, grad: torch.Tensor, step: int, compute_s: float) -> torch.Tensor:
        assert self.inner is not None
        intra0 = self.comm.intra_s
        out = self.inner.after_backward(grad, step, compute_s)
        self.window += compute_s + (self.comm.intra_s - intra0)
        self.applied_from = time.perf_counter()
        return out

    def after_step(self, step: int) -> None:
        assert self.inner is not None
        if self.applied_from is not None:  # the optimizer step since `after_backward`
            self.window += time.perf_counter() - self.applied_from
            self.applied_from = None
        self.computes.append(self.window)
        self.window = 0.0
        self.inner.after_step(step)
        if step + 1 < self.spec.steps and self._observe_now(step):
            self._observe(step)

    def finish(self) -> None:
        assert self.inner is not None
        self.inner.finish()

    def at_sync_point(self, step: int) -> bool:
        assert self.inner is not None
        return self.inner.at_sync_point(step)

    def seats_at(self, step: int) -> int | None:
        """The running mode's: local SGD (the warm-up's too) and streaming seat a newcomer
        at their round's end; under every-step the members wait for the state."""
        assert self.inner is not None
        return self.inner.seats_at(step)

    def defer(self) -> None:
        assert self.inner is not None
        self.inner.defer()

    def replay(self) -> None:
        assert self.inner is not None
        self.inner.replay()

    def sitting_out(self, seating: bool) -> None:
        self.seating = seating

    def stats(self) -> dict[str, float]:
        """The policy's current period and decisions, and what the modes it ran report
        (summed over the modes: streaming's waits for late fragments, say)."""
        assert self.inner is not None
        out = _summed(self.past_stats, self.inner.stats())
        cur = self.policy.current
        if cur is not None:
            out |= {
                "auto_period": float(cur.sync.period),
                "auto_decisions": float(len(self.choices)),
            }
        return out

    def decisions(self) -> tuple[AutoChoice, ...]:
        return tuple(self.choices)

    def cluster_state(self) -> dict[str, Any]:
        assert self.inner is not None
        return self.inner.cluster_state()

    def state_dict(self) -> dict[str, Any]:
        """The running mode's state; a planned run's names that mode (`auto_sync`)."""
        assert self.inner is not None
        out = self.inner.state_dict()
        if self.planned and self.policy.current is not None:
            out["auto_sync"] = str(self.policy.current.sync)
        return out

    def load_state_dict(
        self, state: Mapping[str, Any] | None, cluster_state: Mapping[str, Any] | None
    ) -> None:
        """A planned run starts again on its plan's mode: it takes the state written by that
        mode's kind (a period changed by the policy keeps its anchor and outer momentum),
        else starts that mode afresh from the parameters, and measures from there.

        A resumed run measures and decides afresh (its warm-up starts at the resume step)
        from the parameters; but where it stopped under streaming, each cluster resumes its
        own parameters, so the warm-up's anchor is streaming's (the same on every cluster)
        and its exchange carries each cluster's progress since, in-flight fragments' too."""
        if self.planned:
            assert self.inner is not None
            written = str((state or {}).get("auto_sync", ""))
            if state is not None and written and parse_sync(written).kind is self.spec.sync.kind:
                own = {k: v for k, v in state.items() if k != "auto_sync"}
                self.inner.load_state_dict(own, cluster_state)
            else:
                self.inner.load_state_dict(None, None)
            return
        assert isinstance(self.inner, LocalSGDSync)
        self.inner.load_state_dict(None, None)
        layout = list((state or {}).get("layout", []))
        total = sum(p.numel() for p in self.ctx.params)
        if state is None or len(layout) != 4 or layout[3] != total:
            return
        flat = torch.cat([a.reshape(-1) for a in state["anchor"]])
        parts = split(flat, [a.shape for a in self.inner.anchor])
        with torch.no_grad():
            for a, part in zip(self.inner.anchor, parts, strict=True):
                a.copy_(part.to(a.device))

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()

    # -------------------------------------------------------------- measuring and deciding

    def _observe_now(self, step: int) -> bool:
        if self.seating:  # a mode switched now would not be the one their kept rounds are of
            return False
        cur = self.policy.current
        if cur is None:  # the warm-up's first exchange (after a resume too, wherever it is)
            return (step + 1) % self.warmup == 0
        if cur.sync.kind in (SyncKind.LOCAL_SGD, SyncKind.STREAMING):
            return (step + 1) % cur.sync.period == 0
        return (step + 1) % OBSERVE_EVERY == 0

    def _leader_mark(self) -> tuple[int, float]:
        """(bytes on this leader's busiest link, seconds of its exchanges) so far."""
        c = self.comm.counters
        return (max(c.wan_bytes.values(), default=0), c.wall_s)

    def _measure(self) -> tuple[float, float, float]:
        """(slowest compute per step, the window's exchange seconds, most bytes on a link):
        the same numbers on every rank, from one all-reduce (max) over all ranks. The exchange
        time is the least any leader measured: the last leader to arrive waited for no one,
        so its time is the links' (and the codec's), not the others' compute skew."""
        times = self.computes[1:] or self.computes
        compute = sum(times) / max(len(times), 1)
        self.computes = []
        edge0, wall0 = self.mark
        self.mark = self._leader_mark()
        leader = self.comm.is_leader
        edge = float(self.mark[0] - edge0) if leader else 0.0
        neg_wall = -float(self.mark[1] - wall0) if leader else -math.inf
        t = self.comm.all_max(torch.tensor([compute, neg_wall, edge], dtype=torch.float64))
        return float(t[0]), -float(t[1]), float(t[2])

    def _link(self, step: int, exchange_s: float, edge_bytes: float) -> Link | None:
        table = self.comm.links_now(step + 1)
        if table is not None:
            return table.slowest(self.comm.clusters)
        return link_from_exchange(edge_bytes, exchange_s)

    def _observe(self, step: int) -> None:
        compute, exchange_s, edge_bytes = self._measure()
        link = self._link(step, exchange_s, edge_bytes)
        if link is None and self.planned:
            return  # nothing measured: no evidence that the plan's link moved
        new = self.policy.observe(step + 1, compute, link)
        if new is not None:
            self._switch(new, step + 1)

    def _switch(self, decision: Decision, step: int) -> None:
        """Run `decision` from `step` on; called right after an exchange (the sync point of
        what runs), when every cluster holds the same parameters, or under streaming, once
        drained."""
        inner = self.inner
        assert inner is not None
        sync = decision.sync
        # the warm-up's local SGD is not kept: its outer momentum holds a pseudo-gradient of
        # `WARMUP` steps, another scale than a period's, so the first mode starts afresh (a
        # planned run has no warm-up: its plan's local SGD is kept)
        kept = self.choices or self.planned
        if sync.kind is SyncKind.LOCAL_SGD and isinstance(inner, LocalSGDSync) and kept:
            inner.period = sync.period  # keeps the anchor and the outer momentum
        elif isinstance(inner, StreamingSync) and _same_streaming(inner, sync):
            # only the compression changes: exchanges in flight keep the level they left
            # with (it is passed to the exchange when it is submitted) and every leader
            # changes at the same step, so the next fragments all go at the new one
            pass
        else:
            if isinstance(inner, StreamingSync):
                inner.drain(step - 1)
            inner.close()
            self.past_stats = _summed(self.past_stats, inner.stats())
            new = _strategy(sync, self.ctx)  # streaming's anchor: the parameters, all equal
            if sync.kind is SyncKind.EVERY_STEP:
                # the clusters' momentum differs after local steps: lockstep from equal state
                self.ctx.reset_local()
            new.load_state_dict(None, None)
            self.inner = new
        assert self.inner is not None
        self.inner.compression = parse_compression(decision.compression)
        self.choices.append(AutoChoice(step, str(sync), decision.compression, decision.why))


def _strategy(sync: Sync, ctx: SyncContext) -> SyncStrategy:
    """The strategy of a mode the policy runs (local SGD, streaming, else every-step)."""
    if sync.kind is SyncKind.LOCAL_SGD:
        return LocalSGDSync(sync, ctx)
    if sync.kind is SyncKind.STREAMING:
        return StreamingSync(sync, ctx)
    return EveryStepSync(Sync(SyncKind.EVERY_STEP), ctx)


def _crossings(clusters: int) -> Callable[[str], float]:
    """Copies of one message at a level on the busiest link among `clusters`: 2(n-1)/n
    through the ring, n-1 in an all-gather (as `AdaptiveSync`). A plain function of the
    level, so the policy keeps no reference to the run's groups (a shrunk run's old groups
    must close when it leaves them)."""

    def copies(level: str) -> float:
        if make_compressor(parse_compression(level)).ring:
            return 2.0 * (clusters - 1) / clusters
        return float(clusters - 1)

    return copies


def _summed(a: Mapping[str, float], b: Mapping[str, float]) -> dict[str, float]:
    """Two modes' `stats`, key by key."""
    return {k: a.get(k, 0.0) + b.get(k, 0.0) for k in {**a, **b}}


def _same_streaming(inner: StreamingSync, sync: Sync) -> bool:
    """Whether `sync` is the streaming `inner` runs (period, fragments and delay)."""
    return sync.kind is SyncKind.STREAMING and (
        (inner.period, inner.fragments, inner.delay) == (sync.period, sync.fragments, sync.delay)
    )
