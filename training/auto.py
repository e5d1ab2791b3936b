"""`--sync auto --compression auto` in the runtime: the planner's policy, fed by measurements.

Pure decision code, no I/O. `decide` picks sync mode, period and compressor so that the WAN
exchange hides under compute at the smallest quality cost: every-step fp32 when its exchange
already costs little beside compute; else local SGD (DiLoCo) sending its pseudo-gradients at
a near-lossless level (int8, int4), period 32 before 64, at each period blocking when its
exchange costs at most a small share of the period's compute, else streaming when the link
keeps up and the waits for fragments that outlast the steps they are given cost at most that
share too (`OVERHEAD`, one rule for every mode); only then the lossy levels (int2, chunked
top-k). The order is measured quality (`NEAR_LOSSLESS`, `PERIODS`), not bytes: a longer
period costs more quality than streaming does, while blocking and streaming at one period
trade accuracy against loss (measured: bench/results/auto-order-gpt.md). A blocking exchange
that is not cheap is paid in full by every worker every H steps, while streaming overlaps it
with compute at the cost of a few steps of delay, so exact local SGD is kept only where the
blocking costs little. `AutoPolicy` re-decides when the measured bandwidth or compute changes
by more than a factor for a few rounds in a row (hysteresis), so noise does not flap the
mode. Every rank calls it with the same all-reduced numbers, so every cluster decides the
same.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from grammar import Compression, Sync, SyncKind
from grammar.quality import NEAR_LOSSLESS, PERIODS
from training.adaptive import estimate_bytes
from training.wan import Link

LADDER: tuple[str, ...] = ("none", "int8", "int4", "int2", "topk:0.02:m0:c4096:int2")
"""Compressors, least to most lossy (`grammar.quality.compression_cost`). Top-k without its
own momentum (m0): the pseudo-gradient already is an update; its error feedback keeps what was
not sent."""

# NEAR_LOSSLESS (the pseudo-gradient levels local SGD and streaming send at, never fp32) and
# PERIODS (32 before 64) are `grammar.quality`'s, the policy the planner decides with too;
# LADDER is ordered by its `compression_cost` (tests/training/test_auto.py holds it to that).


@dataclass(frozen=True)
class Decision:
    """What runs from now on, and why (reported in the run's `auto_decisions`)."""

    sync: Sync
    compression: str
    why: str
    exchange_s: float
    """Predicted seconds of one exchange at this compression on the slowest link."""
    compute_s: float
    bandwidth_bps: float | None
    fragment_s: float = 0.0
    """Under streaming: predicted seconds of one fragment's exchange (1/F of the bytes, but
    the ring's whole latency)."""

    @property
    def hides(self) -> bool:
        """The exchange fits in the compute of one period; under streaming, each fragment's
        exchange in its `delay` steps as well (else the workers wait for it)."""
        if self.sync.kind is SyncKind.STREAMING:
            return streaming_hides(self.exchange_s, self.fragment_s, self.sync, self.compute_s)
        return self.exchange_s <= self.sync.period * self.compute_s


def streaming_form(period: int) -> Sync:
    """Streaming DiLoCo of `period` as the grammar defaults it: min(4, H) fragments, each
    applied H/F - 1 steps after it left (just before the next one leaves, so one exchange is
    in flight at a time, as bench/peers.py runs torchft's and cpn's streaming rows)."""
    fragments = min(4, period)
    return Sync(
        SyncKind.STREAMING, period=period, fragments=fragments, delay=period // fragments - 1
    )


OVERHEAD = 0.1
"""Share of compute the WAN may still cost in the mode picked: every-step's synchronous
exchange, blocking local SGD's exchange over its period, streaming's waits for late
fragments over its period."""


def streaming_hides(
    exchange_s: float, fragment_s: float, sync: Sync, compute_s: float, overhead: float = OVERHEAD
) -> bool:
    """Whether streaming `sync` hides the exchange of the model (`exchange_s` at once,
    `fragment_s` a fragment): the link keeps up (all F fragments in the period's compute),
    and the workers' waits for fragments that outlast their `delay` steps of compute (F a
    period) cost at most `overhead` of the period's compute, as blocking local SGD may."""
    late = max(0.0, fragment_s - sync.delay * compute_s) * sync.fragments
    return late <= overhead * sync.period * compute_s and exchange_s <= sync.period * compute_s


def ring_crossings(clusters: int) -> float:
    """Copies of one message the busiest link carries in a ring all-reduce of `clusters`."""
    return 2.0 * (clusters - 1) / clusters if clusters > 1 else 0.0


def exchange_time(
    level: str,
    params: int,
    clusters: int,
    link: Link,
    crossings: Callable[[str], float] | None = None,
) -> float:
    """Seconds one exchange of `params` values at `level` takes over `link`: the bytes on the
    busiest link at its bandwidth, plus 2(n-1) one-way latencies of a ring."""
    if clusters < 2:
        return 0.0
    copies = crossings(level) if crossings is not None else ring_crossings(clusters)
    nbytes = estimate_bytes(level, [(params,)]) * copies
    return 2 * (clusters - 1) * link.rtt_s / 2.0 + nbytes * 8.0 / link.bandwidth_bps


def link_from_exchange(edge_bytes: float, seconds: float, rtt_s: float = 0.0) -> Link | None:
    """The bandwidth an exchange implied: bytes on its busiest link over its wall time (an
    underestimate: latency and waiting count as transfer). None when nothing was measured."""
    if edge_bytes <= 0 or seconds <= 0 or not math.isfinite(seconds):
        return None
    return Link(edge_bytes * 8.0 / seconds, rtt_s)


def periodic_groups(levels: Sequence[str], fixed: bool) -> list[list[str]]:
    """The levels local SGD and streaming try, in groups of equal quality cost: within a
    group, period by period, blocking then streaming, each at its levels least lossy first.
    The near-lossless group comes first (fp32 never: it bought nothing over int8), then the
    lossy levels; a compression the user fixed is one group of its own."""
    if fixed:
        return [list(levels)]
    near = [lv for lv in levels if lv in NEAR_LOSSLESS]
    lossy = [lv for lv in levels if lv not in NEAR_LOSSLESS and lv != "none"]
    return [g for g in (near, lossy) if g]


def decide(
    compute_s: float,
    link: Link | None,
    params: int,
    clusters: int,
    *,
    overhead: float = OVERHEAD,
    max_period: int = 64,
    ladder: Sequence[str] = LADDER,
    fixed_sync: Sync | None = None,
    fixed_compression: str | None = None,
    crossings: Callable[[str], float] | None = None,
) -> Decision:
    """Sync and compression so that the exchange hides under compute at the least quality
    cost. `link` is the slowest link (from the link table, or `link_from_exchange`); None or
    one cluster: nothing crosses a WAN, so every-step fp32. Every-step is kept while its
    synchronous exchange costs at most `overhead` of a step's compute; then, group by group
    of `periodic_groups` and period by period of `PERIODS`, local-sgd:H at the first level whose
    blocking exchange costs at most `overhead` of H steps' compute (exact DiLoCo, no delay),
    else streaming:H at the first level whose fragments hide. `fixed_sync` /
    `fixed_compression` pin what the user gave concretely (a fixed local SGD stays blocking,
    as long as its exchange fits its period); the rest is picked. `compute_s` is the part of
    a step an exchange can hide under (forward/backward, intra-cluster all-reduce, optimizer
    step)."""
    compute_s = max(compute_s, 1e-6)
    levels = [fixed_compression] if fixed_compression is not None else list(ladder)
    fixed_kind = fixed_sync.kind if fixed_sync is not None else None

    def fragment_time(level: str, sync: Sync) -> float:
        if link is None or sync.kind is not SyncKind.STREAMING:
            return 0.0
        return exchange_time(level, -(-params // sync.fragments), clusters, link, crossings)

    def made(sync: Sync, level: str, why: str) -> Decision:
        t = exchange_time(level, params, clusters, link, crossings) if link else 0.0
        bps = link.bandwidth_bps if link else None
        return Decision(sync, level, why, t, compute_s, bps, fragment_time(level, sync))

    if link is None or clusters < 2:
        sync = fixed_sync or Sync(SyncKind.EVERY_STEP)
        return made(sync, levels[0], "no WAN measured between clusters: nothing to hide")
    if fixed_kind in (None, SyncKind.EVERY_STEP):
        # a compressor every step costs more quality than fp32 every H steps: unless the
        # user fixed every-step, every-step runs only at the least lossy level
        for level in levels if fixed_kind is SyncKind.EVERY_STEP else levels[:1]:
            t = exchange_time(level, params, clusters, link, crossings)
            if t <= overhead * compute_s:
                return made(
                    Sync(SyncKind.EVERY_STEP),
                    level,
                    f"every-step {level}: exchange {t:.3g}s <= {overhead:g} x compute "
                    f"{compute_s:.3g}s",
                )
            if fixed_kind is SyncKind.EVERY_STEP and level == levels[-1]:
                return made(fixed_sync or Sync(SyncKind.EVERY_STEP), level, "sync fixed: lightest")
    if fixed_sync is not None and fixed_kind is not SyncKind.LOCAL_SGD:
        return made(fixed_sync, levels[0], f"sync fixed to {fixed_sync}: compression as given")
    if fixed_sync is not None:  # local SGD fixed: blocking, the period as given
        h = fixed_sync.period
        for level in levels:
            t = exchange_time(level, params, clusters, link, crossings)
            if t <= h * compute_s:
                return made(
                    fixed_sync,
                    level,
                    f"local-sgd:{h} {level} (sync fixed): exchange {t:.3g}s <= {h} x "
                    f"compute {compute_s:.3g}s",
                )
        periods = [h]
    else:
        periods = [h for h in PERIODS if h <= max_period] or [max_period]
        for group in periodic_groups(levels, fixed_compression is not None):
            times = {lv: exchange_time(lv, params, clusters, link, crossings) for lv in group}
            for h in periods:  # the period first: it costs more quality than streaming does
                for level in group:  # exact local SGD where its blocking costs little
                    t = times[level]
                    if t <= overhead * h * compute_s:
                        return made(
                            Sync(SyncKind.LOCAL_SGD, period=h),
                            level,
                            f"local-sgd:{h} {level}: blocking exchange {t:.3g}s <= {overhead:g} "
                            f"x {h} x compute {compute_s:.3g}s",
                        )
                stream = streaming_form(h)
                for level in group:  # else streaming where its fragments hide
                    t = times[level]
                    tf = fragment_time(level, stream)
                    if streaming_hides(t, tf, stream, compute_s, overhead):
                        f, d = stream.fragments, stream.delay
                        late = max(0.0, tf - d * compute_s) * f
                        return made(
                            stream,
                            level,
                            f"{stream} {level}: fragment exchange {tf:.3g}s (1/{f} of {t:.3g}s) "
                            f"against {d} x compute {compute_s:.3g}s, waits {late:.3g}s a "
                            f"period <= {overhead:g} x {h} x compute; blocking would cost "
                            f"{t:.3g}s",
                        )
    h = periods[-1]
    sync = fixed_sync or Sync(SyncKind.LOCAL_SGD, period=h)
    t = exchange_time(levels[-1], params, clusters, link, crossings)
    return made(
        sync,
        levels[-1],
        f"nothing hides at {link.bandwidth_bps / 1e6:.3g} Mbit/s: the lightest exchange "
        f"({t:.3g}s against {h} x compute {compute_s:.3g}s), blocking, H={h}",
    )


def lossiness(level: str) -> int:
    """Rank of `level` in `LADDER` (higher: lossier); a level outside it ranks last."""
    return LADDER.index(level) if level in LADDER else len(LADDER)


@dataclass
class AutoPolicy:
    """`decide` with hysteresis: re-decide only when bandwidth or compute moved more than
    `factor` away from what the current decision was made on, `patience` rounds in a row."""

    params: int
    clusters: int
    fixed_sync: Sync | None = None
    fixed_compression: str | None = None
    factor: float = 2.0
    patience: int = 2
    max_period: int = 64
    crossings: Callable[[str], float] | None = None
    """Copies of a message of each level the busiest link carries (None: a ring's)."""
    current: Decision | None = None
    strikes: int = 0
    history: list[tuple[int, Decision]] = field(default_factory=list)

    def _decide(self, compute_s: float, link: Link | None) -> Decision:
        return decide(
            compute_s,
            link,
            self.params,
            self.clusters,
            max_period=self.max_period,
            fixed_sync=self.fixed_sync,
            fixed_compression=self.fixed_compression,
            crossings=self.crossings,
        )

    def _moved(self, compute_s: float, link: Link | None) -> bool:
        cur = self.current
        assert cur is not None
        bps = link.bandwidth_bps if link else None
        if (bps is None) != (cur.bandwidth_bps is None):
            return True
        ratios = [compute_s / max(cur.compute_s, 1e-9)]
        if bps is not None and cur.bandwidth_bps:
            ratios.append(bps / cur.bandwidth_bps)
        return any(r > self.factor or r < 1.0 / self.factor for r in ratios)

    def observe(self, step: int, compute_s: float, link: Link | None) -> Decision | None:
        """The new decision when one is due (the first, or after `patience` rounds out of
        band), else None: keep running what runs."""
        if self.current is None:
            self.current = self._decide(compute_s, link)
            self.history.append((step, self.current))
            return self.current
        if not self._moved(compute_s, link):
            self.strikes = 0
            return None
        self.strikes += 1
        if self.strikes < self.patience:
            return None
        self.strikes = 0
        new = self._decide(compute_s, link)
        if new.sync == self.current.sync and new.compression == self.current.compression:
            self.current = new  # re-anchored on the new measurements, same mode
            return None
        self.current = new
        self.history.append((step, new))
        return new


def parse_fixed(sync: Sync, compression: Compression) -> tuple[Sync | None, str | None]:
    """What of `sync` / `compression` the user fixed (None: auto, the policy's to pick); the
    compression in its canonical form, as the policy's ladder names levels."""
    return (None if sync.is_auto else sync), (None if compression.is_auto else str(compression))


def wan_bound_ratio(params: int, compute_s: float, mbps: float) -> float:
    """The regime of synchronous fp32 data parallelism: seconds to put one step's fp32
    gradient on a link of `mbps` over seconds of compute per step (>1: WAN-bound)."""
    return 4.0 * params * 8.0 / (mbps * 1e6) / max(compute_s, 1e-9)


def runs_auto(sync: Sync, compression: Compression) -> Sync | None:
    """`Sync(auto)` when the run's policy picks something (sync or compression is auto, not
    under adaptive, which picks its own levels), else None: the given sync runs as is."""
    if sync.is_auto or (compression.is_auto and sync.kind is not SyncKind.ADAPTIVE):
        return Sync(SyncKind.AUTO)
    return None
