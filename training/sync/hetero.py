"""Pure decisions shared by the modes for unequal clusters and sparse graphs: how many local
steps a cluster fits into one step of the slowest, where the parameter server lives, and the
gossip graph from the links (built in `grammar.graph`, which the planner shares)."""

from __future__ import annotations

from collections.abc import Sequence

from grammar import graph
from grammar.graph import Bandwidth, metropolis_weights, region_groups, ring_neighbours
from training.wan import LinkTable

__all__ = [
    "bandwidth_ring",
    "gossip_graph",
    "link_bandwidth",
    "metropolis_weights",
    "ps_host",
    "region_groups",
    "region_hosts",
    "ring_neighbours",
    "staleness_weight",
    "steps_per_tick",
]


def steps_per_tick(mine_s: float, slowest_s: float, bound: int) -> int:
    """Local steps a cluster whose step takes `mine_s` fits into one step of the slowest
    (`slowest_s`), rounded down (small timing noise never makes equal clusters run ahead), at
    least 1 and at most `bound`. Unknown times (<= 0) give 1."""
    if mine_s <= 0.0 or slowest_s <= 0.0:
        return 1
    return max(1, min(bound, int(slowest_s / mine_s + 1e-9)))


def link_bandwidth(links: LinkTable | None) -> Bandwidth | None:
    """The link table as the graph's bandwidth callable (bits/s; 0 where no link)."""
    if links is None:
        return None

    def bps(a: str, b: str) -> float:
        link = links.get(a, b)
        return link.bandwidth_bps if link is not None else 0.0

    return bps


def bandwidth_ring(clusters: Sequence[str], links: LinkTable | None) -> list[str]:
    """`grammar.graph.bandwidth_ring` over the link table."""
    return graph.bandwidth_ring(clusters, link_bandwidth(links))


def ps_host(clusters: Sequence[str], links: LinkTable | None) -> str:
    """`grammar.graph.ps_host` over the link table: the host the planner priced."""
    return graph.ps_host(clusters, link_bandwidth(links))


def staleness_weight(staleness: int, bound: int) -> float:
    """The weight of an update `staleness` versions old: 1 up to `bound`, then
    (bound + 1) / (staleness + 1). Down-weighted, not dropped: a slow cluster's updates are
    always the stalest, and dropping them would lose its data (all of it, under local data)."""
    if staleness <= bound:
        return 1.0
    return (bound + 1.0) / (staleness + 1.0)


def gossip_graph(
    clusters: Sequence[str], links: LinkTable | None, keep: float = 0.5
) -> dict[str, list[str]]:
    """`grammar.graph.gossip_graph` over the link table: the graph the planner priced."""
    return graph.gossip_graph(clusters, link_bandwidth(links), keep)


def region_hosts(
    groups: dict[str, list[str]], links: LinkTable | None
) -> tuple[str, dict[str, str]]:
    """`grammar.graph.region_hosts` over the link table: the hosts the planner priced."""
    return graph.region_hosts(groups, link_bandwidth(links))
