"""The gossip graph over a job's clusters, from the bandwidth of their links.

Shared by the planner (`scheduler.cost`, which prices a gossip round on it) and the runtime
(`training.sync.gossip`, which exchanges over it), so the graph the plan assumed is the graph
the run uses. Pure standard library: a link's bandwidth is asked of a callable, in any unit
(only ratios matter); 0 means no link or unknown.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Bandwidth = Callable[[str, str], float]
"""The bandwidth of the link between two clusters (any unit; 0: none or unknown)."""


def bandwidth_ring(clusters: Sequence[str], bandwidth: Bandwidth | None) -> list[str]:
    """The clusters in ring order, each followed by the remaining cluster with the fastest
    link to it (greedy, from the first): slow links end up off the ring where they can.
    Without bandwidths, the given order."""
    order = [clusters[0]] if clusters else []
    rest = list(clusters[1:])
    while rest:
        here = order[-1]
        best = (
            max(rest, key=lambda c: bandwidth(here, c)) if bandwidth is not None else rest[0]
        )  # ties: the first in the given order
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


def gossip_graph(
    clusters: Sequence[str], bandwidth: Bandwidth | None, keep: float = 0.5
) -> dict[str, list[str]]:
    """The gossip graph: the bandwidth-ordered ring, plus the chords of an exponential graph
    over that ring order (each cluster to the ones 2, 4, 8, ... places on) whose link has at
    least `keep` times the bandwidth of the ring's slowest edge. A round lasts as long as its
    slowest edge, which the ring already has, so such a chord speeds up mixing (the
    exponential graph's spectral gap) at no cost in round time; where links are slow or
    unknown the degree stays the ring's 2. Symmetric; neighbours in ring order."""
    ring = bandwidth_ring(clusters, bandwidth)
    n = len(ring)
    graph: dict[str, list[str]] = {c: ring_neighbours(ring, c) for c in ring}
    if n < 4 or bandwidth is None:
        return graph
    floor = min(bandwidth(ring[i], ring[(i + 1) % n]) for i in range(n))
    hop = 2
    while hop < n - 1:
        for i, a in enumerate(ring):
            b = ring[(i + hop) % n]
            if b not in graph[a] and b != a and floor > 0 and bandwidth(a, b) >= keep * floor:
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
