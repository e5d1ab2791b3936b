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


def gossip_graph(
    clusters: Sequence[str], links: LinkTable | None, keep: float = 0.5
) -> dict[str, list[str]]:
    """The gossip graph from measured links: the bandwidth-ordered ring, plus the chords of an
    exponential graph over that ring order (each cluster to the ones 2, 4, 8, ... places on)
    whose link has at least `keep` times the bandwidth of the ring's slowest edge. A round
    lasts as long as its slowest edge, which the ring already has, so such a chord speeds up
    mixing (the exponential graph's spectral gap) at no cost in round time; where links are
    slow or unshaped the degree stays the ring's 2. Symmetric; neighbours in ring order."""
    ring = bandwidth_ring(clusters, links)
    n = len(ring)
    graph: dict[str, list[str]] = {c: ring_neighbours(ring, c) for c in ring}
    if n < 4 or links is None:
        return graph

    def bps(a: str, b: str) -> float:
        link = links.get(a, b)
        return link.bandwidth_bps if link is not None else 0.0

    floor = min(bps(ring[i], ring[(i + 1) % n]) for i in range(n))
    hop = 2
    while hop < n - 1:
        for i, a in enumerate(ring):
            b = ring[(i + hop) % n]
            if b not in graph[a] and b != a and floor > 0 and bps(a, b) >= keep * floor:
                graph[a].append(b)
                graph[b].append(a)
        hop *= 2
    order = {c: i for i, c in enumerate(ring)}
    return {c: sorted(ns, key=order.__getitem__) for c, ns in graph.items()}


def metropolis_weights(graph: dict[str, list[str]]) -> dict[str, dict[str, float]]:
    """Mixing weights for a graph of unequal degrees: w_ij = 1 / (1 + max(d_i, d_j)) per
    edge and the rest on the node itself (Metropolis-Hastings), so the mixing matrix is
    symmetric and doubly stochastic and gossip converges to the plain mean."""
    out: dict[str, dict[str, float]] = {}
    for c, ns in graph.items():
        w = {n: 1.0 / (1 + max(len(ns), len(graph[n]))) for n in ns}
        w[c] = 1.0 - sum(w.values())
        out[c] = w
    return out
