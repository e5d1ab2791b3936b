"""The planner prices gossip on the runtime's own graph (`grammar.graph.gossip_graph`, issue
17): a round's bytes are the payload times the sum of the degrees and its time the slowest
edge of that graph, not of a ring and not of every pair."""

from __future__ import annotations

import itertools

import pytest

from scheduler import CostModel, Snapshot
from tests.scheduler.builders import cluster, job, link
from training.spec import LinkSpec
from training.sync.hetero import gossip_graph
from training.wan import LinkTable

PARAMS = 100_000_000  # 4e8 bytes uncompressed
FIVE = ("a", "b", "c", "d", "e")
RING = {frozenset(p) for p in (("a", "b"), ("b", "c"), ("c", "d"), ("d", "e"), ("e", "a"))}


def _gbps(a: str, b: str, chord: bool) -> float:
    fast = RING | ({frozenset(("a", "c"))} if chord else set())
    return 10.0 if frozenset((a, b)) in fast else 0.1


def _snapshot(chord: bool) -> Snapshot:
    links = tuple(
        link(a, b, gbps=_gbps(a, b, chord), rtt_ms=20.0) for a, b in itertools.combinations(FIVE, 2)
    )
    return Snapshot(tuple(cluster(c, 1) for c in FIVE), links)


@pytest.mark.parametrize("chord", [False, True])
def test_gossip_cost_uses_the_runtimes_graph_and_its_degrees(chord: bool) -> None:
    model = CostModel(_snapshot(chord), job(5, params=PARAMS))
    graph = model.gossip_graph(FIVE)
    # the runtime builds the same graph from the same links (in Mbit/s: only ratios matter)
    table = LinkTable.build(
        [LinkSpec(a, b, _gbps(a, b, chord) * 1e3, 20.0) for a, b in itertools.combinations(FIVE, 2)]
    )
    assert graph == gossip_graph(list(FIVE), table)
    degrees = {c: len(ns) for c, ns in graph.items()}
    if chord:  # the fast chord a-c is kept: not a ring, unequal degrees
        assert degrees == {"a": 3, "b": 2, "c": 3, "d": 2, "e": 2}
    else:
        assert degrees == dict.fromkeys(FIVE, 2)
    terms = model.gossip_wan(FIVE, "none")
    payload = PARAMS * 4
    # one message per directed graph edge: the sum of the degrees (12 or 10), not 5 x 4
    assert terms.bytes == pytest.approx(payload * sum(degrees.values()))
    # every graph edge is a 10 Gb/s link: 10 ms + 4e8 B / 1.25e9 B/s; the 0.1 Gb/s pairs
    # are off the graph and do not set the round
    assert terms.latency_s + terms.bandwidth_s == pytest.approx(0.01 + 0.32)
    assert terms.bottleneck is not None and frozenset(terms.bottleneck) in RING | {
        frozenset(("a", "c"))
    }


def test_even_links_give_a_degree_below_the_cluster_count() -> None:
    eight = tuple(f"c{i}" for i in range(8))
    links = tuple(link(a, b, gbps=10.0) for a, b in itertools.combinations(eight, 2))
    model = CostModel(Snapshot(tuple(cluster(c, 1) for c in eight), links), job(8, params=PARAMS))
    # the exponential graph: degree 5 (ring, hop 2, hop 4), not the 7 of every pair
    assert all(len(ns) == 5 for ns in model.gossip_graph(eight).values())
    assert model.gossip_wan(eight, "none").bytes == pytest.approx(PARAMS * 4 * 8 * 5)
