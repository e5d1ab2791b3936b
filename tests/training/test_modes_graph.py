"""The gossip graph the planner builds from measured links (issue 17): the bandwidth-ordered
ring, plus exponential-graph chords where a link is as fast as the ring's slowest edge, and
Metropolis mixing weights for the unequal degrees that gives. Pure functions, no runtime."""

from __future__ import annotations

import pytest

from training.sync.hetero import bandwidth_ring, gossip_graph, metropolis_weights
from training.wan import Link, LinkTable

EIGHT = [f"c{i}" for i in range(8)]


def _table(fast: float, slow: float, slow_pairs: set[frozenset[str]]) -> LinkTable:
    links = {
        frozenset((a, b)): Link((slow if frozenset((a, b)) in slow_pairs else fast) * 1e6, 0.01)
        for i, a in enumerate(EIGHT)
        for b in EIGHT[i + 1 :]
    }
    return LinkTable(links)


def test_even_links_give_the_exponential_graph() -> None:
    graph = gossip_graph(EIGHT, _table(1000.0, 1000.0, set()))
    ring = bandwidth_ring(EIGHT, _table(1000.0, 1000.0, set()))
    assert ring == EIGHT  # ties keep the given order
    # ring (+-1) plus hops 2 and 4 (8 clusters: hop 4 reaches the same node both ways)
    assert graph["c0"] == ["c1", "c2", "c4", "c6", "c7"]
    assert all(len(ns) == 5 for ns in graph.values())
    assert all(a in graph[b] for a, ns in graph.items() for b in ns)  # symmetric


def test_slow_links_keep_the_degree_at_the_rings() -> None:
    # every link but the ring's 100x slower than the ring: no chord pays for itself
    ring_pairs = {frozenset((EIGHT[i], EIGHT[(i + 1) % 8])) for i in range(8)}
    others = {frozenset((a, b)) for i, a in enumerate(EIGHT) for b in EIGHT[i + 1 :]} - ring_pairs
    graph = gossip_graph(EIGHT, _table(1000.0, 10.0, others))
    assert all(len(ns) == 2 for ns in graph.values()), graph
    assert graph["c0"] == ["c1", "c7"]


def test_a_chord_as_fast_as_the_slowest_ring_edge_is_kept() -> None:
    ring_pairs = {frozenset((EIGHT[i], EIGHT[(i + 1) % 8])) for i in range(8)}
    others = {frozenset((a, b)) for i, a in enumerate(EIGHT) for b in EIGHT[i + 1 :]} - ring_pairs
    fast_chord = frozenset(("c0", "c4"))
    graph = gossip_graph(EIGHT, _table(1000.0, 10.0, others - {fast_chord}))
    assert graph["c0"] == ["c1", "c4", "c7"] and graph["c4"] == ["c0", "c3", "c5"]
    assert sum(len(ns) for ns in graph.values()) == 2 * 9  # 8 ring edges + 1 chord


@pytest.mark.parametrize("clusters", [["a"], ["a", "b"], ["a", "b", "c"]])
def test_small_or_unshaped_sets_get_the_ring(clusters: list[str]) -> None:
    graph = gossip_graph(clusters, None)
    assert all(len(ns) == min(2, len(clusters) - 1) for ns in graph.values()), graph
    assert set(gossip_graph(EIGHT, None)["c0"]) == {"c1", "c7"}


def test_metropolis_weights_are_doubly_stochastic() -> None:
    graph = {"a": ["b", "c", "d"], "b": ["a"], "c": ["a"], "d": ["a"]}  # a star
    w = metropolis_weights(graph)
    for c in graph:
        assert sum(w[c].values()) == pytest.approx(1.0)
        assert all(v >= 0 for v in w[c].values())
    for a, ns in graph.items():
        for b in ns:
            assert w[a][b] == pytest.approx(w[b][a])
    assert w["a"]["b"] == pytest.approx(0.25) and w["b"]["b"] == pytest.approx(0.75)


def test_shares_weight_each_row_and_a_complete_graph_mixes_to_the_weighted_mean() -> None:
    shares = {"a": 0.5, "b": 0.3, "c": 0.2}
    complete = metropolis_weights(gossip_graph(["a", "b", "c"], None), shares)
    for row in complete.values():
        assert row == pytest.approx(shares)
    star = {"a": ["b", "c", "d"], "b": ["a"], "c": ["a"], "d": ["a"]}
    w = metropolis_weights(star, {"a": 0.4, "b": 0.2, "c": 0.2, "d": 0.2})
    assert all(sum(row.values()) == pytest.approx(1.0) for row in w.values())
    assert w["b"]["a"] == pytest.approx(0.25 * 0.4 / (0.25 * 0.4 + 0.75 * 0.2))


def test_the_reduction_tree_is_binary_rooted_where_bandwidth_is_and_avoids_slow_links() -> None:
    from grammar.graph import TREE_FANOUT, reduction_tree, tree_levels

    even = reduction_tree(EIGHT, None)  # no bandwidths: root first, breadth first, in order
    assert even == {"c1": "c0", "c2": "c0", "c3": "c1", "c4": "c1", "c5": "c2", "c6": "c2",
                    "c7": "c3"}  # fmt: skip
    assert tree_levels(even) == [["c1", "c2"], ["c3", "c4", "c5", "c6"], ["c7"]]
    children = [list(even.values()).count(p) for p in set(even.values())]
    assert max(children) <= TREE_FANOUT
    # c0 is slow to everyone: it is no root and hangs as a leaf
    slow = {frozenset(("c0", x)) for x in EIGHT[1:]}
    table = _table(1000.0, 1.0, slow)
    tree = reduction_tree(EIGHT, lambda a, b: k.bandwidth_bps if (k := table.get(a, b)) else 0)
    assert "c0" in tree and "c0" not in tree.values()
    assert set(tree) | set(tree.values()) == set(EIGHT) and len(tree) == 7
    assert reduction_tree(["solo"], None) == {}
