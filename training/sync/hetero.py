"""Pure decisions shared by the modes for unequal clusters and sparse graphs: how many local
steps a cluster fits into one step of the slowest, and the gossip graph from the links."""

from __future__ import annotations

from collections.abc import Sequence

from training.wan import LinkTable


def steps_per_tick(mine_s: float, slowest_s: float, bound: int) -> int:
    """Local steps a cluster whose step takes `mine_s` fits into one step of the slowest
    (`slowest_s`), rounded down (small timing noise never makes equal clusters run ahead), at
    least 1 and at most `bound`. Unknown times (<= 0) give 1."""
    if mine_s <= 0.0 or slowest_s <= 0.0:
        return 1
    return max(1, min(bound, int(slowest_s / mine_s + 1e-9)))


def bandwidth_ring(clusters: Sequence[str], links: LinkTable | None) -> list[str]:
    """The clusters in ring order, each followed by the remaining cluster with the fastest
    link to it (greedy, from the first): slow links end up off the ring where they can.
    Without a link table, the given order."""
    order = [clusters[0]] if clusters else []
    rest = list(clusters[1:])
    while rest:
        here = order[-1]

        def mbps(c: str, here: str = here) -> float:
            link = links.get(here, c) if links is not None else None
            return link.bandwidth_bps if link is not None else 0.0

        best = max(rest, key=mbps)  # ties: the first in the given order
        order.append(best)
        rest.remove(best)
    return order


def ring_neighbours(ring: Sequence[str], me: str) -> list[str]:
    """`me`'s neighbours on the ring: two, one with two clusters, none alone."""
    n = len(ring)
    if n < 2:
        return []
    i = ring.index(me)
    return list(dict.fromkeys([ring[(i - 1) % n], ring[(i + 1) % n]]))


def ps_host(clusters: Sequence[str], links: LinkTable | None) -> str:
    """Where the parameter server lives: the cluster with the most bandwidth to all others
    (every push and pull crosses one of its links); the first cluster on ties or unshaped."""

    def total(c: str) -> float:
        if links is None:
            return 0.0
        found = [links.get(c, o) for o in clusters if o != c]
        return sum(x.bandwidth_bps for x in found if x is not None)

    return max(clusters, key=total)


def staleness_weight(staleness: int, bound: int) -> float:
    """The weight of an update `staleness` versions old: 1 up to `bound`, then
    (bound + 1) / (staleness + 1). Down-weighted, not dropped: a slow cluster's updates are
    always the stalest, and dropping them would lose its data (all of it, under local data)."""
    if staleness <= bound:
        return 1.0
    return (bound + 1.0) / (staleness + 1.0)
