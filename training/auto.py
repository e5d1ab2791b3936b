"""`--sync auto --compression auto` in the runtime: `grammar.auto`'s policy, fed by measurements.

Pure decision code, no I/O. `decide` times each candidate of `grammar.auto`'s menu the runtime
can switch between (every-step, local SGD, streaming; `candidates(switchable=True)`) with
`grammar.auto.step_seconds` over the measured compute and link, and takes the least lossy of
those within `grammar.quality.SLACK` of the fastest (`grammar.quality.least_lossy`): the rule,
the menu, the quality costs and the step formula the planner decides with. Only the inputs
differ: the planner's are a snapshot's, these are what the run measures. `AutoPolicy`
re-decides when the measured bandwidth or compute moves by more than a factor for a few
rounds in a row (hysteresis), so noise does not flap the mode. Every rank calls it with the
same all-reduced numbers, so every cluster decides the same. Under `cpn train --sync auto` it
makes the first decision itself; a job the control plane runs starts from its plan's
concrete decision (`AutoPolicy.start`) and, where the user left sync or compression to
`auto` (`TrainSpec.adapt`), re-decides only when the link moves away from what the plan
was made on.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Set
from dataclasses import dataclass, field, replace

from grammar import Compression, Sync, SyncKind, parse_sync
from grammar.auto import candidates, resilience, step_seconds
from grammar.compression import message_bytes
from grammar.quality import SLACK, least_lossy, quality_cost
from training.wan import Link


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
    step_s: float = 0.0
    """Predicted seconds of a step in this mode (`grammar.auto.step_seconds`)."""

    @property
    def wan_share(self) -> float:
        """The share of a step predicted to wait for the WAN."""
        return 1.0 - self.compute_s / self.step_s if self.step_s > 0 else 0.0


def ring_crossings(clusters: int) -> float:
    """Copies of one message the busiest link carries in a ring all-reduce of `clusters`."""
    return 2.0 * (clusters - 1) / clusters if clusters > 1 else 0.0


def exchange_parts(
    level: str,
    params: int,
    clusters: int,
    link: Link,
    crossings: Callable[[str], float] | None = None,
) -> tuple[float, float]:
    """(latency, transfer) seconds of one exchange of `params` values at `level` over `link`:
    2(n-1) one-way latencies of a ring, and the bytes on the busiest link at its bandwidth."""
    if clusters < 2:
        return 0.0, 0.0
    copies = crossings(level) if crossings is not None else ring_crossings(clusters)
    nbytes = message_bytes(level, [(params,)]) * copies
    return 2 * (clusters - 1) * link.rtt_s / 2.0, nbytes * 8.0 / link.bandwidth_bps


def exchange_time(
    level: str,
    params: int,
    clusters: int,
    link: Link,
    crossings: Callable[[str], float] | None = None,
) -> float:
    """Seconds one exchange of `params` values at `level` takes over `link`."""
    latency, transfer = exchange_parts(level, params, clusters, link, crossings)
    return latency + transfer


def link_from_exchange(edge_bytes: float, seconds: float, rtt_s: float = 0.0) -> Link | None:
    """The bandwidth an exchange implied: bytes on its busiest link over its wall time (an
    underestimate: latency and waiting count as transfer). None when nothing was measured."""
    if edge_bytes <= 0 or seconds <= 0 or not math.isfinite(seconds):
        return None
    return Link(edge_bytes * 8.0 / seconds, rtt_s)


def decide(
    compute_s: float,
    link: Link | None,
    params: int,
    clusters: int,
    *,
    slack: float = SLACK,
    max_period: int = 64,
    fixed_sync: Sync | None = None,
    fixed_compression: str | None = None,
    crossings: Callable[[str], float] | None = None,
    local_data: bool = False,
    kinds: Set[SyncKind] | None = None,
) -> Decision:
    """Sync and compression by `grammar.auto`'s policy: of its switchable candidates (those
    `fixed_sync` / `fixed_compression` leave open, periods up to `max_period`, sync modes of
    `kinds` where given), timed by
    `step_seconds` at `compute_s` a step over `link` (the slowest; from the link table or
    `link_from_exchange`), the least lossy within `slack` of the fastest. None or one
    cluster: nothing crosses a WAN, so every-step at the first level. `compute_s` is the part
    of a step an exchange can hide under (forward/backward, intra-cluster all-reduce,
    optimizer step). On `local_data` the quality costs are local data's."""
    compute_s = max(compute_s, 1e-6)

    def quality(level: str, sync: Sync) -> float:
        return quality_cost(level, sync, local_data)

    pairs = candidates(
        fixed_compression or "auto",
        fixed_sync or Sync(SyncKind.AUTO),
        switchable=True,
        local_data=local_data,
    )
    if kinds is not None:
        pairs = [(lv, v) for lv, v in pairs if parse_sync(v).kind in kinds] or pairs
    options = [
        (level, parse_sync(v))
        for level, v in pairs
        if fixed_sync is not None or parse_sync(v).period <= max_period
    ] or [(level, parse_sync(v)) for level, v in pairs]
    bps = link.bandwidth_bps if link else None
    if link is None or clusters < 2:
        level, sync = options[0]
        if fixed_sync is None:
            sync = Sync(SyncKind.EVERY_STEP)
            level = next(lv for lv, s in options if s == sync)
        return Decision(
            sync,
            level,
            "no WAN measured between clusters: nothing to hide",
            0.0,
            compute_s,
            bps,
            compute_s,
        )
    parts = {lv: exchange_parts(lv, params, clusters, link, crossings) for lv, _ in options}
    step = {o: step_seconds(o[1], compute_s, *parts[o[0]]) for o in options}
    level, sync = least_lossy(  # of equals: resilient, then faster, then lighter
        options,
        step.__getitem__,
        lambda o: quality(o[0], o[1]),
        slack,
        lambda o: (resilience(o[1]), step[o], parts[o[0]][1]),
    )
    fastest = min(options, key=step.__getitem__)
    t = step[(level, sync)]
    why = (
        f"{sync} {level}: step {t:.3g}s (compute {compute_s:.3g}s, exchange "
        f"{sum(parts[level]):.3g}s at {link.bandwidth_bps / 1e6:.3g} Mbit/s), quality cost "
        f"{quality(level, sync):.1%}"
    )
    if (level, sync) != fastest:
        why += (
            f"; the least lossy within {slack:.0%} of the fastest, {fastest[1]} {fastest[0]} "
            f"({step[fastest]:.3g}s, quality cost {quality(*fastest):.1%})"
        )
    return Decision(sync, level, why, sum(parts[level]), compute_s, bps, t)


@dataclass
class AutoPolicy:
    """`decide` with hysteresis: re-decide only when bandwidth (and, with `watch_compute`,
    compute) moved more than `factor` away from what the current decision was made on,
    `patience` rounds in a row."""

    params: int
    clusters: int
    fixed_sync: Sync | None = None
    fixed_compression: str | None = None
    factor: float = 2.0
    patience: int = 2
    max_period: int = 64
    crossings: Callable[[str], float] | None = None
    """Copies of a message of each level the busiest link carries (None: a ring's)."""
    local_data: bool = False
    kinds: Set[SyncKind] | None = None
    """The sync modes it may pick (None: every switchable one)."""
    watch_compute: bool = True
    """Whether a change of compute alone re-decides (a planned run watches its link only)."""
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
            local_data=self.local_data,
            kinds=self.kinds,
        )

    def start(self, sync: Sync, compression: str, link: Link | None) -> None:
        """Run the planner's decision first, made on `link` (None: the link is anchored at the
        first measurement, as the compute always is): not a decision of this policy, so not
        in its `history`."""
        self.current = Decision(
            sync,
            compression,
            "as planned",
            0.0,
            math.nan,
            link.bandwidth_bps if link is not None else None,
        )

    def _moved(self, compute_s: float, link: Link | None) -> bool:
        cur = self.current
        assert cur is not None
        bps = link.bandwidth_bps if link else None
        if (bps is None) != (cur.bandwidth_bps is None):
            return True
        ratios = [compute_s / max(cur.compute_s, 1e-9)] if self.watch_compute else []
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
        if math.isnan(self.current.compute_s):  # a planned start's first measurement
            bps = self.current.bandwidth_bps
            if bps is None and link is not None:
                bps = link.bandwidth_bps
            self.current = replace(self.current, compute_s=compute_s, bandwidth_bps=bps)
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
    compression in its canonical form, as the policy's menu names levels."""
    return (None if sync.is_auto else sync), (None if compression.is_auto else str(compression))


def wan_bound_ratio(params: int, compute_s: float, mbps: float) -> float:
    """The regime of synchronous fp32 data parallelism: seconds to put one step's fp32
    gradient on a link of `mbps` over seconds of compute per step (>1: WAN-bound)."""
    return 4.0 * params * 8.0 / (mbps * 1e6) / max(compute_s, 1e-9)


def runs_auto(sync: Sync, compression: Compression, *, adapt: bool = False) -> Sync | None:
    """`Sync(auto)` when the run's policy picks something (sync or compression is auto, not
    under adaptive, which picks its own levels; or it may re-decide a plan's, `adapt`), else
    None: the given sync runs as is."""
    if adapt or sync.is_auto or (compression.is_auto and sync.kind is not SyncKind.ADAPTIVE):
        return Sync(SyncKind.AUTO)
    return None
