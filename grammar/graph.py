"""The graphs a job's clusters exchange over, from the bandwidth of their links: the ring,
the tree, the gossip graph, where the parameter servers live.

Shared by the planner (`scheduler.cost`, which prices an exchange on them) and the runtime
(`training.sync`, which exchanges over them), so the graph the plan assumed is the graph the
run uses. Pure standard library: a link's bandwidth is asked of a callable, in any unit
(only ratios matter); 0 means no link or unknown.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

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


def metropolis_weights(
    graph: dict[str, list[str]], shares: Mapping[str, float] | None = None
) -> dict[str, dict[str, float]]:
    """Mixing weights for a graph of unequal degrees: w_ij = 1 / (1 + max(d_i, d_j)) per
    edge and the rest on the node itself (Metropolis-Hastings), so the mixing matrix is
    symmetric and doubly stochastic and gossip converges to the plain mean.

    With the clusters' batch `shares`, each row is w_ij s_j over its sum: a cluster that
    trained on more of the batch counts for more, as in local SGD's average and gossip's
    final all-reduce. On a complete graph a round then is that share-weighted mean; elsewhere
    consensus weighs cluster j by s_j times its row's sum."""
    out: dict[str, dict[str, float]] = {}
    for c, ns in graph.items():
        w = {n: 1.0 / (1 + max(len(ns), len(graph[n]))) for n in ns}
        w[c] = 1.0 - sum(w.values())
        if shares is not None:
            raw = {n: v * shares.get(n, 0.0) for n, v in w.items()}
            total = sum(raw.values())
            if total > 0:
                w = {n: v / total for n, v in raw.items()}
        out[c] = w
    return out


def ps_host(clusters: Sequence[str], bandwidth: Bandwidth | None) -> str:
    """Where a parameter server lives: the cluster with the most bandwidth to all others
    (every push and pull crosses one of its links); the first cluster on ties or without
    bandwidths."""
    if bandwidth is None:
        return clusters[0]
    return max(clusters, key=lambda c: sum(bandwidth(c, o) for o in clusters if o != c))


TREE_FANOUT = 2
"""Children per node of the all-reduce tree: a binary tree, 2 ceil(log2 n) hops a reduction
against a ring's 2(n-1); with three clusters it is a star through the root."""


def reduction_tree(clusters: Sequence[str], bandwidth: Bandwidth | None) -> dict[str, str]:
    """The tree a tree all-reduce runs over, as each cluster's parent (the root has none):
    rooted at the cluster with the most bandwidth to the others (`ps_host`), each other
    cluster, those with the fastest link to a free slot first, hung under the node with a free
    slot (fewer than `TREE_FANOUT` children) it has the fastest link to, the shallower on ties
    (greedy, like `bandwidth_ring`; ties keep the given order)."""
    if len(clusters) < 2:
        return {}
    root = ps_host(clusters, bandwidth)
    depth = {root: 0}
    children: dict[str, int] = {root: 0}
    parents: dict[str, str] = {}
    rest = [c for c in clusters if c != root]

    def speed(a: str, b: str) -> float:
        return bandwidth(a, b) if bandwidth is not None else 0.0

    while rest:
        open_ = [c for c in depth if children[c] < TREE_FANOUT]
        child, parent = max(
            ((c, p) for c in rest for p in open_),
            key=lambda cp: (speed(cp[1], cp[0]), -depth[cp[1]]),
        )  # max keeps the first of equals: the given order
        parents[child] = parent
        depth[child] = depth[parent] + 1
        children[parent] += 1
        children[child] = 0
        rest.remove(child)
    return parents


def hub_tree(clusters: Sequence[str], bandwidth: Bandwidth | None) -> dict[str, str]:
    """The hub's star as a tree: every cluster's parent is the one with the most bandwidth to
    the others (`ps_host`). Two hops an all-reduce, whatever the count, and no link between
    two spokes used: the fallback where the spokes' own links are slow."""
    if len(clusters) < 2:
        return {}
    root = ps_host(clusters, bandwidth)
    return {c: root for c in clusters if c != root}


def tree_degrees(parents: Mapping[str, str]) -> dict[str, int]:
    """Each node's edges in the tree: what it sends an all-reduce, in whole payloads (one up
    to its parent, one down to each child); the hub's is every spoke."""
    out: dict[str, int] = {}
    for child, parent in parents.items():
        out[child] = out.get(child, 0) + 1
        out[parent] = out.get(parent, 0) + 1
    return out


def tree_levels(parents: Mapping[str, str]) -> list[list[str]]:
    """The tree's non-root nodes by depth, shallowest first (each level's nodes in the order
    they were hung): a reduction sends level by level from the deepest, a broadcast from the
    shallowest."""
    depth: dict[str, int] = {}

    def of(c: str) -> int:
        if c not in parents:
            return 0
        if c not in depth:
            depth[c] = of(parents[c]) + 1
        return depth[c]

    levels: list[list[str]] = []
    for c in parents:
        d = of(c)
        while len(levels) < d:
            levels.append([])
        levels[d - 1].append(c)
    return levels


def region_groups(clusters: Sequence[str], regions: Mapping[str, str]) -> dict[str, list[str]]:
    """The clusters of each region, in the given order (regions in order of first member);
    one group of all clusters when `regions` is empty."""
    groups: dict[str, list[str]] = {}
    for c in clusters:
        groups.setdefault(regions.get(c, ""), []).append(c)
    return groups


def region_hosts(
    groups: Mapping[str, Sequence[str]], bandwidth: Bandwidth | None
) -> tuple[str, dict[str, str]]:
    """Where a hierarchical parameter server lives: each region's server at its member with
    the most bandwidth to the others of its region (`ps_host`: its clusters' pushes cross
    those links), and the global one at the regional host with the most bandwidth to the
    other regional hosts (the region exchanges cross those)."""
    hosts = {r: ps_host(members, bandwidth) for r, members in groups.items()}
    return ps_host(list(hosts.values()), bandwidth), hosts
