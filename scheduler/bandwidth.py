"""The WAN as a shared resource: what a plan needs of each datacenter's uplink and downlink,
and what a path can carry once others' reservations are taken out.

A datacenter reaches all its peers through its uplink and downlink, so a path's bandwidth is
the least of what it crosses: the link itself, the source's free uplink and the destination's
free downlink. A placed job reserves its average rate there (the bytes its plan sends over its
run), so jobs sharing an uplink are never promised more than it carries between them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from grammar.graph import tree_degrees
from scheduler.types import Assignment, Estimate

KBPS_PER_GBPS = 1_000_000


def wan_need_kbps(estimate: Estimate, placement: tuple[Assignment, ...]) -> dict[str, int]:
    """Each cluster's WAN rate under the plan, in kbit/s, sent and received alike: its share
    of the plan's WAN bytes over the time its steps run (the set-up sends nothing to speak
    of), rounded up; equal shares on a ring or a graph of equal exchanges, a tree's by each
    node's edges (the root of a hub sends to every spoke). Nothing for a plan on one cluster
    or one that sends no bytes."""
    clusters = sorted({a.cluster for a in placement})
    weights = tree_degrees(dict(estimate.tree)) if estimate.tree else None
    return wan_rate_kbps(
        estimate.wan_bytes, estimate.total_time_s - estimate.setup_s, clusters, weights
    )


def wan_rate_kbps(
    wan_bytes: int,
    steps_s: float,
    clusters: Sequence[str],
    weights: Mapping[str, int] | None = None,
) -> dict[str, int]:
    """`wan_need_kbps` from the numbers: `wan_bytes` over `steps_s` seconds, shared by
    `clusters` (distinct names) equally or in proportion to `weights` (a tree's degrees,
    `grammar.graph.tree_degrees`), rounded up, never 0."""
    if len(clusters) < 2 or wan_bytes <= 0 or steps_s <= 0:
        return {}
    if weights is None or any(weights.get(c, 0) <= 0 for c in clusters):
        weights = dict.fromkeys(clusters, 1)
    total = sum(weights[c] for c in clusters)
    return {
        c: max(1, math.ceil(wan_bytes * 8 * weights[c] / total / steps_s / 1000)) for c in clusters
    }


FLOW_HEADROOM = 0.9
"""The share of what a probe carried through a port that jobs are planned on: one flow's
goodput on an idle wire is more than paced exchanges keep up through it, alone or several at
once (measured in `bench/results/wan-share-25-headroom*.md`)."""


def port_gbps(declared_gbps: float | None, carried_gbps: float | None) -> float | None:
    """The capacity a port is planned on: what was declared, but no more than
    `FLOW_HEADROOM` of the most its agents' probes carried over it (a flow's goodput through
    the port, which framing and the shaper's bursts keep below the line rate). A port
    nobody declared stays unlimited: a probe measures the paths it crossed, which the links
    already hold."""
    if declared_gbps is None or carried_gbps is None:
        return declared_gbps
    return min(declared_gbps, carried_gbps * FLOW_HEADROOM)


BURST_TOLERANCE = 0.05
"""How much longer a running job's steps may take because later jobs' streams come out of
its bursts: within it a later job is admitted beside it (`burst_room`), beyond it the port is
full for that job, as when a reservation would exceed it."""


def burst_room(
    wan_share: float,
    burst_gbps: float,
    capacity_gbps: float,
    others_gbps: float,
    tolerance: float = BURST_TOLERANCE,
) -> float:
    """The most a new job may send through a port of `capacity_gbps` where a running job
    bursts at `burst_gbps` (its planned share) for `wan_share` of its step and others
    already reserve `others_gbps`: what keeps that job's `burst_slowdown` within
    `tolerance` (0 where even nothing more would not)."""
    if wan_share <= 0:
        return max(capacity_gbps - others_gbps, 0.0)
    return max(capacity_gbps - others_gbps - burst_gbps / (1.0 + tolerance / wan_share), 0.0)


def burst_slowdown(
    wan_share: float, burst_gbps: float, capacity_gbps: float, others_gbps: float
) -> float:
    """How much longer a placed job's steps may take once others send `others_gbps` on a
    port of `capacity_gbps` that its exchanges cross at `burst_gbps` (the share it was
    planned at): the part of its step on the WAN (`wan_share`) stretched by burst over what
    is left of the port, where that is less than the burst; 0 where its bursts still fit,
    inf where nothing is left. Reservations are averages: a job planned on the whole port
    reserves less than it, and a later job's steady stream comes out of its bursts."""
    left = capacity_gbps - others_gbps
    if left >= burst_gbps:
        return 0.0
    if left <= 0:
        return math.inf
    return max(0.0, wan_share) * (burst_gbps / left - 1.0)


def free_gbps(capacity_gbps: float | None, reserved_kbps: int) -> float | None:
    """What is left of a port (None: no capacity declared, so no limit but the links')."""
    if capacity_gbps is None:
        return None
    return max(capacity_gbps - reserved_kbps / KBPS_PER_GBPS, 0.0)


def path_gbps(link_gbps: float, up_free: float | None, down_free: float | None) -> float:
    """A path's bandwidth: the least of the link, the source's free uplink and the
    destination's free downlink (0: full, the path carries nothing more)."""
    return min((link_gbps, *(p for p in (up_free, down_free) if p is not None)))
