"""The heterogeneous and decentralised sync modes (issue 17) on the real runtime (real Ray,
gloo, one process per worker, four clusters of one worker): they converge near every-step at
equal samples, fast clusters run ahead of a 4x slower one, gossip sends `degree` messages a
round over the ring's links only, and under local data every rank reads only its cluster's
samples.

The convergence band (stated; mnist1d MLP, 32 steps, `speed_bound=1` so every cluster takes
exactly every-step's samples): each mode's final training loss is at most 1.25x
every-step's plus 0.05, and below the untrained loss ln(10) = 2.30 by at least 0.2. The
parameter server runs with S = 4 there: with 4 clusters pushing once a step each, an update is
typically 3 versions old, so S >= 3 keeps equal clusters at full weight.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

import pytest

import training
from training import LinkSpec, TrainSpec
from training.runner import WorkerPool
from training.wan import ring_edges

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.slow]

MLP = "builtin:mnist1d-mlp"
CLUSTERS = {"a": 1, "b": 1, "c": 1, "d": 1}


@pytest.fixture(scope="module")
def pool() -> Iterator[WorkerPool]:
    """One worker group for every run here: they differ in values, not in placement."""
    workers = WorkerPool()
    yield workers
    workers.close()


def _run(pool: WorkerPool, sync: str, steps: int, **kw: object) -> training.TrainReport:
    kw.setdefault("compression", "int8")
    kw.setdefault("clusters", dict(CLUSTERS))
    spec = TrainSpec(
        task=MLP,
        sync=sync,
        steps=steps,
        eval_every=steps,
        **kw,  # type: ignore[arg-type]
    )
    return training.run(spec, pool=pool)


def test_modes_converge_near_every_step_at_equal_samples(pool: WorkerPool) -> None:
    steps = 32
    base = _run(pool, "every-step", steps)
    reports = {
        s: _run(pool, s, steps, speed_bound=1) for s in ("partial:4", "async-ps:4", "gossip:2")
    }
    for sync, report in reports.items():
        assert report.steps == steps and report.sync == sync
        assert report.steps_by_cluster == dict.fromkeys(CLUSTERS, steps)  # equal samples
        assert report.final_loss <= 1.25 * base.final_loss + 0.05, (sync, report, base)
        assert report.final_loss <= math.log(10) - 0.2, sync
        assert report.wan_bytes_total > 0
    # gossip on 4 clusters: degree 2, two messages a round per cluster, ring links only
    gossip = reports["gossip:2"]
    stats = gossip.sync_stats
    assert stats["degree"] == 2 and stats["messages_per_round"] == 2
    assert stats["rounds"] == steps // 2 - 1  # none at the last step: the consensus instead
    ring = set(ring_edges(list(CLUSTERS)))
    used = {edge for edge, n in gossip.wan_bytes.items() if n > 0}
    assert used <= ring | {(b, a) for a, b in ring}
    assert not used & {("a", "c"), ("c", "a"), ("b", "d"), ("d", "b")}


def test_gossip_on_a_graph_that_is_not_a_ring_sends_each_clusters_degree(
    pool: WorkerPool,
) -> None:
    # the ring a-b-c-d and the chord a-c fast, b-d slow: the planner's graph
    # (`gossip_graph`) keeps the chord, so a and c have degree 3 and b and d degree 2
    fast, slow = 1000.0, 10.0
    links = [
        LinkSpec(a, b, slow if {a, b} == {"b", "d"} else fast, 1.0)
        for a, b in itertools.combinations(CLUSTERS, 2)
    ]
    steps = 32  # the band of the test above
    report = _run(pool, "gossip:2", steps, links=links, compression="none")
    stats = report.sync_stats
    degrees = {c: stats[f"degree.{c}"] for c in CLUSTERS}
    assert degrees == {"a": 3, "b": 2, "c": 3, "d": 2}
    assert stats["edges"] == 5 and stats["rounds"] == steps // 2 - 1
    for c in CLUSTERS:  # each cluster sends its own degree a round, not the ring's 2
        assert stats[f"messages_per_round.{c}"] == degrees[c], (c, stats)
    used = {frozenset(edge) for edge, n in report.wan_bytes.items() if n > 0}
    assert frozenset(("a", "c")) in used and frozenset(("b", "d")) not in used
    assert report.final_loss <= math.log(10) - 0.2  # Metropolis mixing still trains


def test_async_ps_across_two_regions_is_hierarchical_and_crosses_less(pool: WorkerPool) -> None:
    # regions eu = {a, b} and us = {c, d}: fast links inside a region, slower between. Flat,
    # c and d push to and pull from the one server (at a) every step; hierarchical (HALoS),
    # they push to us's server at c, which exchanges with the global one at a about once a
    # step of the slowest. Same band as the convergence test above.
    regions = {"a": "eu", "b": "eu", "c": "us", "d": "us"}
    links = [
        LinkSpec(a, b, 1000.0 if regions[a] == regions[b] else 100.0, 1.0)
        for a, b in itertools.combinations(CLUSTERS, 2)
    ]
    steps = 64
    kw: dict[str, object] = {"links": links, "compression": "none", "speed_bound": 1}
    base = _run(pool, "every-step", steps)
    flat = _run(pool, "async-ps:4", steps, **kw)
    tiered = _run(pool, "async-ps:4", steps, regions=regions, **kw)
    stats = tiered.sync_stats
    assert stats["regions"] == 2 and "regions" not in flat.sync_stats
    assert stats["global_host"] == 0 and stats["host"] == 0  # a hosts eu's and the global
    assert stats["region_exchanges"] >= 2  # both regions exchanged at least at the end
    for report in (flat, tiered):
        assert report.steps_by_cluster == dict.fromkeys(CLUSTERS, steps)
        assert report.final_loss <= 1.25 * base.final_loss + 0.05, (report, base)
        assert report.final_loss <= math.log(10) - 0.2

    def crossing(report: training.TrainReport) -> int:
        return sum(n for (a, b), n in report.wan_bytes.items() if regions[a] != regions[b])

    # flat: c and d each push and pull across every step (~4 x 32 messages); tiered: one
    # push and one pull of us's server per exchange (about 2 x 32)
    assert 0 < crossing(tiered) < 0.75 * crossing(flat), (tiered.wan_bytes, flat.wan_bytes)
    # the region exchanges run between the two servers' hosts (us's at c, the global at a);
    # d's pushes go to c, so almost nothing of d's crosses (the final model only)
    assert tiered.wan_bytes[("d", "a")] < flat.wan_bytes[("d", "a")] / 4


def test_async_ps_regions_of_one_cluster_exchange_from_the_first_step(pool: WorkerPool) -> None:
    # each cluster its own region: its server is its leader's own object (no call to another
    # process a tick), and the global server answers before the first push, so the regions
    # exchange with it all through the run, not only at the end (4, one a region)
    regions = {c: f"r{i}" for i, c in enumerate(CLUSTERS)}
    steps = 32
    report = _run(pool, "async-ps:4", steps, regions=regions, compression="none", speed_bound=1)
    stats = report.sync_stats
    assert stats["regions"] == 4
    assert stats["region_exchanges"] >= 4 + steps // 2, stats
    assert report.final_loss <= math.log(10) - 0.2
    # where the plan says every 8 ticks (`relay_ticks`), a region sends no more often, though
    # its answers come back at once: after ticks 8, 16, 24 and 32 at most, and at the end
    ticks = 8
    planned = _run(
        pool, "async-ps:4", steps, regions=regions, compression="none", speed_bound=1,
        relay_ticks=dict.fromkeys(regions.values(), ticks),
    )  # fmt: skip
    assert 4 <= planned.sync_stats["region_exchanges"] <= 4 * (steps // ticks + 1), planned
    assert planned.final_loss < math.log(10)  # it trains (async-ps's last loss is noisy)


def test_gossip_among_three_clusters_is_local_sgd_of_its_period(pool: WorkerPool) -> None:
    # three clusters all neighbour each other: a round mixed by batch share is local SGD's
    # plain average (local data: outer lr 1, no momentum); with the plain Metropolis mean the
    # unequal shares (43, 43 and 42 of 128 samples) made it another run
    three = {"a": 1, "b": 1, "c": 1}
    reports = [
        _run(pool, sync, 32, clusters=three, data="local", compression="none")
        for sync in ("gossip:16", "local-sgd:16")
    ]
    gossip, local = reports
    assert gossip.batch_shares["a"] != gossip.batch_shares["c"]
    assert gossip.final_eval_loss == pytest.approx(local.final_eval_loss, rel=1e-5)


@pytest.mark.parametrize("sync", ["partial:4", "async-ps:2"])
def test_fast_clusters_take_at_least_twice_the_steps_of_a_4x_slower_one(
    pool: WorkerPool, sync: str
) -> None:
    # speeds are medians of CPU time x slowdown (`SyncContext.device_s`), immune to the
    # other processes on this machine; partial's first round runs in lockstep (none known yet)
    steps = 16
    report = _run(pool, sync, steps, slowdown={"d": 4.0})
    taken = report.steps_by_cluster
    assert set(taken) == set(CLUSTERS)
    assert all(taken[c] >= 2 * taken["d"] for c in "abc"), taken
    assert max(taken.values()) <= 4 * steps  # speed_bound 4


def test_local_data_keeps_every_sample_in_its_cluster(pool: WorkerPool) -> None:
    report = _run(pool, "partial:2", 4, data="local")
    assert report.data == "local"
    # mnist1d's 10 labels, split by label over a, b, c, d (training.residency)
    owned = {"a": {0, 4, 8}, "b": {1, 5, 9}, "c": {2, 6}, "d": {3, 7}}
    for cluster, labels in owned.items():
        read = set(report.labels_by_cluster[cluster])
        assert read and read <= labels, (cluster, read)
    shared = _run(pool, "every-step", 2)
    assert shared.data == "shared" and shared.labels_by_cluster == {}


@pytest.mark.timeout(900)  # ~1,100 every-step steps plus 400 slowed partial steps
def test_partial_with_a_4x_slower_cluster_converges_near_every_step_at_equal_samples(
    pool: WorkerPool,
) -> None:
    # The fast clusters take up to 4 local steps a tick, so a round's pseudo-gradient spans
    # ~4H of their steps; fed unnormalised to the outer Nesterov step (lr 0.7, momentum 0.9,
    # tuned for H-step pseudo-gradients) it overshoots round after round and the run diverges
    # (before the fix: final loss 2.67, accuracy 19 %, loss rising from step ~200). Each
    # cluster's pseudo-gradient is now normalised by its steps per tick before the
    # sample-weighted average (FedNova). Band (stated): 3 clusters, mnist1d MLP, 400 steps of
    # the slowest; final loss at most 2x every-step's at the same samples plus 0.1 (the
    # fixed mode measured 0.48 and 0.91 against every-step's 0.52: its last outer step
    # leaves a noisy final loss).
    clusters = {"a": 1, "b": 1, "c": 1}

    def run(sync: str, steps: int, **kw: object) -> training.TrainReport:
        spec = TrainSpec(
            task=MLP,
            clusters=clusters,
            sync=sync,
            compression="none",
            steps=steps,
            eval_every=steps,
            **kw,  # type: ignore[arg-type]
        )
        return training.run(spec, pool=pool)

    report = run("partial:16", 400, slowdown={"c": 4.0})
    taken = report.steps_by_cluster
    assert all(taken[c] >= 2 * taken["c"] for c in "ab"), taken
    base = run("every-step", round(sum(taken.values()) / len(clusters)))  # equal samples
    assert math.isfinite(report.final_loss)
    assert report.final_loss <= 2.0 * base.final_loss + 0.1, (report, base)


@pytest.mark.timeout(600)
def test_async_ps_under_local_data_stays_near_every_step(pool: WorkerPool) -> None:
    # Non-IID (each cluster its own labels): free-running pushes let one stalled cluster
    # (rank 0's evaluation) fall 19 pushes behind and the others push 40 updates in a row,
    # so the server model follows their labels (before the barrier: 18-22 % against
    # every-step's 55 %). The leaders now meet every B ticks under local data (bounded
    # staleness, `training.sync.async_ps`). Band (stated): 3 clusters, mnist1d MLP, 200
    # steps, speed_bound 1 (equal samples); final accuracy at least half every-step's
    # (measured 42-49 % against 55 % alone, once 32 % against 55 % in a loaded full suite;
    # without the barrier 18-22 %, below the band), every push within S = 4 versions.
    clusters = {"a": 1, "b": 1, "c": 1}

    def run(sync: str, **kw: object) -> training.TrainReport:
        spec = TrainSpec(
            task=MLP,
            clusters=clusters,
            sync=sync,
            compression="none",
            steps=200,
            eval_every=200,
            data="local",
            speed_bound=1,
            **kw,  # type: ignore[arg-type]
        )
        return training.run(spec, pool=pool)

    base = run("every-step")
    report = run("async-ps:4")
    stats = report.sync_stats
    assert report.steps_by_cluster == dict.fromkeys(clusters, 200)
    assert stats["barriers"] == 199  # B = 4 // 2 - 1 = 1: every tick but the last
    assert stats["max_staleness"] <= 4 and stats["stale_updates"] == 0, stats
    assert report.final_accuracy >= 0.5 * base.final_accuracy, (report, base)


def test_a_long_local_sgd_run_on_the_default_outer_step_does_not_diverge() -> None:
    """DiLoCo's outer momentum 0.9 took this run to chance (accuracy 0.12, loss 2.09 and
    rising at step 600; bench/results/outer-momentum.md): the default must not. Every-step
    ends at 0.64 here."""
    spec = TrainSpec(
        task="builtin:mnist1d-mlp",
        clusters={"a": 2, "b": 2, "c": 2},
        steps=600,
        sync="local-sgd:10",
        compression="none",
        eval_every=200,
    )
    report = training.run(spec)
    assert report.final_accuracy > 0.55, report.history
    assert not report.warning, report.warning  # the run's own divergence check is quiet
