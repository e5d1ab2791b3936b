"""What each compression and sync value costs in model quality, and the one rule that trades
quality for time: the least lossy option within `SLACK` of the fastest.

The planner (`scheduler`) and the runtime's `auto` (`training.auto`) both decide with this
module and the menu of `grammar.auto`, so the two layers never keep two policies. A quality
cost is the fraction of extra optimiser steps an option needs to reach the quality lossless
every-step training reaches (0.10: it would need 1.1x the steps); the runtime runs the steps
it is given, so at equal steps a costlier option ends lower. The figures are priors from the
runs in `bench/results` (`modes.md`, `wan-100mbit.md`, `peers-100mbit.md`,
`auto-order-gpt.md`) and the literature; `scheduler.calibrate.fit_steps_factor` replaces a
sync mode's with what observed runs show.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from grammar.compression import Compression, CompressionKind, parse_compression
from grammar.sync import Sync, SyncKind, parse_sync

SLACK = 0.10
"""How much slower (or dearer, under a cost objective) than the best option a less lossy one
may be and still be chosen: lossy compression and long periods must buy more than this."""

SPEED_BOUND = 4
"""How many steps a fast cluster may take per step of the slowest under `partial`/`async-ps`
(the runtime's `steps_per_tick`); the planner's cost model credits exactly that."""

INT4_PSEUDO = 0.005
"""The near-lossless pseudo-gradient levels: under the modes of local updates int8 costs no
measured quality (bench/results/auto-order-gpt.md: it bought nothing over fp32 every H
steps), int4 this (less than a doubling of the period: both come before a longer period)."""

LOCAL_UPDATES: frozenset[SyncKind] = frozenset(
    {SyncKind.LOCAL_SGD, SyncKind.STREAMING, SyncKind.PARTIAL, SyncKind.GOSSIP}
)
"""The modes whose exchanges carry pseudo-gradients (a period's change), not gradients."""

LOCAL_SGD_PER_DOUBLING = 0.02
PARTIAL_PENALTY = 0.02
ASYNC_PS_PENALTY = 0.05
ASYNC_PS_PER_STALENESS = 0.02
GOSSIP_PENALTY = 0.05
STALE_PER_STEP = 0.02

MAX_COST = 0.5
"""An option that would need more than 1.5x the steps to match lossless training is taken only
where nothing less lossy is possible: no speed pays for it."""

T = TypeVar("T")


def compression_cost(value: str | Compression, sync: str | Sync | None = None) -> float:
    """Extra steps (as a fraction) the compressor costs every-step training: int8 and the
    half formats none measured (wan-100mbit.md: int8 87.8 % vs fp32 86.7 %), PowerSGD less
    the higher its rank (rank 1 fell to 65.9 %), top-k and sign the most (top-k never
    reached the target in peers-100mbit.md; the demo's top-k 1 % collapsed). Under a `sync`
    of local updates the near-lossless levels cost less (`INT4_PSEUDO`)."""
    c = parse_compression(value)
    kind = c.kind
    if sync is not None and parse_sync(sync).kind in LOCAL_UPDATES:
        if kind is CompressionKind.INT8:
            return 0.0
        if kind is CompressionKind.INT4:
            return INT4_PSEUDO
    if kind in (CompressionKind.NONE, CompressionKind.AUTO):
        return 0.0
    if kind in (CompressionKind.FP16, CompressionKind.BF16):
        return 0.002  # rounding to half precision: fp32 first where it is within the slack
    if kind is CompressionKind.INT8:
        return 0.01
    if kind is CompressionKind.INT4:
        return 0.03
    if kind is CompressionKind.INT2:
        return 0.08
    if kind is CompressionKind.SIGN:
        return 0.30
    if kind is CompressionKind.TOPK:
        quantized = 0.02 if c.values in ("int4", "int2") else 0.0
        return 0.10 + 0.10 * math.log10(1.0 / c.density) + quantized
    return 0.4 / max(1, c.rank)  # PowerSGD


LOCAL_DATA_COST: dict[SyncKind, float] = {
    SyncKind.LOCAL_SGD: 0.05,
    SyncKind.PARTIAL: 0.04,
    SyncKind.STREAMING: 0.20,
    SyncKind.GOSSIP: 0.08,
    SyncKind.ASYNC_PS: 0.06,
}
"""What each mode costs more on local (label-skewed) data than on shared data, from the points
each ended below every-step on shared data in bench/results/local-data.md (local SGD 2.2 at
H=16 and 3.4 at H=8, partial 2.2, with the plain-average outer step cpn runs there; async-ps
3.2; gossip 4.0; streaming with four fragments 10.1; every-step above it, within noise:
0), at about 0.02 of extra steps a point of accuracy as modes.md's period doublings give.
Streaming's is for named fragments: with the whole model as one (`LOCAL_DATA_ONE_FRAGMENT`,
its default on local data, `grammar.sync.parse_sync`) it ended 3.3 points below."""

LOCAL_DATA_ONE_FRAGMENT = 0.07
"""Streaming with one fragment on local data: the fragments synced at staggered steps, each
against the others' own drift, are what cost it (bench/results/local-data.md: f4 10.1
points below, f2 13.5, f4 with no delay 7.9, f1 3.3; fragments cut across the layers
rather than along them ended no better, 8.4 at f4:d0, measured once and not kept)."""


def local_data_cost(s: Sync) -> float:
    """What `s` costs more on local data (`LOCAL_DATA_COST`, by fragments for streaming)."""
    if s.kind is SyncKind.STREAMING and s.fragments == 1:
        return LOCAL_DATA_ONE_FRAGMENT
    return LOCAL_DATA_COST.get(s.kind, 0.0)


def sync_cost(value: str | Sync, local_data: bool = False) -> float:
    """Extra steps the sync mode costs (local SGD 0.02 a doubling of its period: H=16 ended
    4.3 points below every-step in modes.md; the modes that let clusters drift more), and on
    `local_data` what its clusters' drift apart costs more (`LOCAL_DATA_COST`; a value is
    read as local data reads it: streaming's fragments default to one there)."""
    s = parse_sync(value, local_data=local_data)
    return _sync_cost(s) + (local_data_cost(s) if local_data else 0.0)


def _sync_cost(s: Sync) -> float:
    kind = s.kind
    if kind is SyncKind.STALE:
        return STALE_PER_STEP * s.staleness
    if kind is SyncKind.LOCAL_SGD:
        return LOCAL_SGD_PER_DOUBLING * math.log2(s.period)
    if kind is SyncKind.STREAMING:
        return LOCAL_SGD_PER_DOUBLING * math.log2(s.period) + 0.01 * s.delay / s.period
    if kind is SyncKind.PARTIAL:
        return PARTIAL_PENALTY + LOCAL_SGD_PER_DOUBLING * math.log2(s.period)
    if kind is SyncKind.GOSSIP:
        return GOSSIP_PENALTY + LOCAL_SGD_PER_DOUBLING * math.log2(s.period)
    if kind is SyncKind.ASYNC_PS:
        return ASYNC_PS_PENALTY + ASYNC_PS_PER_STALENESS * min(s.staleness, 8)
    return 0.0


def quality_cost(
    compression: str | Compression, sync: str | Sync, local_data: bool = False
) -> float:
    """The two costs compounded: (1 + c)(1 + s) - 1."""
    return (1.0 + compression_cost(compression, sync)) * (1.0 + sync_cost(sync, local_data)) - 1.0


def least_lossy(
    options: Sequence[T],
    measure: Callable[[T], float],
    quality: Callable[[T], float],
    slack: float = SLACK,
    rank: Callable[[T], Any] | None = None,
) -> T:
    """The option of least quality cost among those within `slack` of the best `measure`
    (time or cost); ties go to the lower `rank` (default: the measure), then to the earlier
    option. Options over `MAX_COST` count only where every option is."""
    if not options:
        raise ValueError("least_lossy needs at least one option")
    order = rank or measure
    scored = [(round(quality(o), 9), measure(o), i) for i, o in enumerate(options)]
    sound = [t for t in scored if t[0] <= MAX_COST] or scored
    limit = min(t[1] for t in sound) * (1.0 + slack) + 1e-12
    inside = [t for t in sound if t[1] <= limit]
    least = min(t[0] for t in inside)
    ties = [i for q, _, i in inside if q == least]
    return options[min(ties, key=lambda i: (order(options[i]), i))]
