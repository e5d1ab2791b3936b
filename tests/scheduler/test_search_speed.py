"""The planner's shortcuts decide nothing: `CostModel.score_set` gives `score`'s floats bit for
bit, `_Search._floors` are never above a set's fastest and cheapest choices, and the exact
search's pruning with them returns the same plans, explanations and infeasibility reasons
included, as scoring every set."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler import Assignment, JobRequest, Plan, QoS, Snapshot, evaluate, plan
from scheduler.cost import CostModel
from scheduler.optimizer import EXACT_MAX_CLUSTERS, _Search
from scheduler.rules import is_clique
from tests.scheduler.builders import cluster, job, link

# speeds far apart (running ahead pays) and links far apart (gossip is tried)
MODELS = ("B200", "H100", "A100", "L4", "T4")


@st.composite
def instances(draw: st.DrawFn) -> tuple[Snapshot, JobRequest]:
    n = draw(st.integers(2, 8))
    names = [f"c{i}" for i in range(n)]
    clusters = tuple(
        cluster(
            name,
            draw(st.sampled_from([1, 2, 3, 4, 8])),
            gpu_model=draw(st.sampled_from(MODELS)),
            price_per_gpu_hour=draw(st.sampled_from([0.5, 1.0, 3.0])),
            intra_bandwidth_gbps=draw(st.sampled_from([10.0, 100.0, 400.0])),
            bandwidth_price_per_gbps_hour=draw(st.sampled_from([0.0, 0.0, 0.5, 4.0])),
        )
        for name in names
    )
    links = tuple(
        link(
            a,
            b,
            gbps=draw(st.sampled_from([0.5, 2.0, 10.0, 100.0])),
            rtt_ms=draw(st.sampled_from([1.0, 20.0, 150.0])),
            egress=draw(st.sampled_from([0.0, 0.02, 0.09])),
        )
        for a, b in itertools.combinations(names, 2)
        if draw(st.integers(0, 7)) > 0
    )
    gpus = draw(st.integers(1, 8))
    j = job(
        gpus,
        max_gpus=gpus + draw(st.sampled_from([0, 0, 3])),
        params=draw(st.sampled_from([5_000_000, 300_000_000, 7_000_000_000])),
        flops_per_step=draw(st.sampled_from([1e13, 1e15, 1e17])),
        steps=draw(st.sampled_from([10, 1000])),
        compression=draw(st.sampled_from(["auto", "auto", "none", "int8"])),
        sync=draw(st.sampled_from(["auto", "auto", "every-step", "partial:16"])),
        qos=QoS(
            deadline_s=draw(st.sampled_from([None, None, 1.0, 100.0, 10_000.0])),
            max_cost=draw(st.sampled_from([None, None, None, 0.01, 1.0])),
        ),
    )
    overhead = draw(st.sampled_from([0.0, 0.0, 0.05]))
    cores = draw(st.sampled_from([0, 0, 2]))  # 2: every worker on one 2-core machine
    return Snapshot(clusters, links, step_overhead_s=overhead, host_cores=cores), j


@st.composite
def heuristic_instances(draw: st.DrawFn) -> tuple[Snapshot, JobRequest]:
    """More clusters than the exact search takes: `_finish` prunes there."""
    n = draw(st.integers(EXACT_MAX_CLUSTERS + 1, 16))
    names = [f"k{i:02d}" for i in range(n)]
    clusters = tuple(
        cluster(
            name,
            draw(st.sampled_from([2, 4, 8, 16])),
            gpu_model=draw(st.sampled_from(MODELS)),
            price_per_gpu_hour=draw(st.sampled_from([0.5, 1.0, 3.0])),
        )
        for name in names
    )
    links = tuple(
        link(
            a,
            b,
            gbps=draw(st.sampled_from([0.5, 10.0, 100.0])),
            rtt_ms=draw(st.sampled_from([1.0, 80.0])),
        )
        for a, b in itertools.combinations(names, 2)
        if draw(st.integers(0, 3)) > 0
    )
    gpus = draw(st.sampled_from([1, 4, 8, 16, 24]))
    j = job(
        gpus,
        params=draw(st.sampled_from([10**7, 10**9])),
        flops_per_step=draw(st.sampled_from([1e14, 1e16])),
        qos=QoS(deadline_s=draw(st.sampled_from([None, None, 50.0, 5000.0]))),
    )
    return Snapshot(clusters, links), j


def _sets(snap: Snapshot, most: int) -> list[tuple[str, ...]]:
    names = sorted(c.name for c in snap.clusters)
    return [
        sub
        for k in range(1, most + 1)
        for sub in itertools.combinations(names, k)
        if is_clique(snap, sub)
    ]


SETTINGS = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)


@SETTINGS
@given(instances())
def test_score_set_is_score_bit_for_bit(inst: tuple[Snapshot, JobRequest]) -> None:
    snap, j = inst
    model = CostModel(snap, j)
    for objective in ("time", "cost"):
        search = _Search(model, j, objective, j.min_gpus, j.max_gpus)
        for sub in _sets(snap, 4):
            allocs = search.allocs(sub)
            choices = search.combos(sub)
            times, costs = model.score_set(
                sub, choices, [(a.rate, a.intra, a.price, sum(a.gpus)) for a in allocs]
            )
            want = [
                model.score(sub, a.rate, a.intra, a.price, c, s, sum(a.gpus))
                for a in allocs
                for c, s in choices
            ]
            assert list(zip(times, costs, strict=True)) == want  # ==, not approx: ranked on


@SETTINGS
@given(instances())
def test_floors_are_never_above_a_sets_fastest_and_cheapest_choices(
    inst: tuple[Snapshot, JobRequest],
) -> None:
    snap, j = inst
    model = CostModel(snap, j)
    for objective in ("time", "cost"):
        search = _Search(model, j, objective, j.min_gpus, j.max_gpus)
        for sub in _sets(snap, 8):
            allocs = search.allocs(sub)
            if not allocs:
                continue
            scores = [
                model.score(sub, a.rate, a.intra, a.price, c, s, sum(a.gpus))
                for a in allocs
                for c, s in search.combos(sub)
            ]
            t_floor, c_floor = search._floors(sub)
            assert 0 < t_floor <= min(t for t, _ in scores), (sub, t_floor)
            assert 0 <= c_floor <= min(c for _, c in scores), (sub, c_floor)


@settings(SETTINGS, max_examples=200)
@given(instances(), st.sampled_from(["time", "cost", "cost-within-deadline"]))
def test_pruning_changes_no_plan(inst: tuple[Snapshot, JobRequest], objective: str) -> None:
    snap, j = inst
    if objective == "cost-within-deadline" and j.qos.deadline_s is None:
        objective = "cost"
    pruned = plan(snap, j, objective)  # type: ignore[arg-type]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_Search, "prune", False)
        full = plan(snap, j, objective)  # type: ignore[arg-type]
    # placement, modes, estimate, the explanation's alternatives, or why there is none
    assert pruned == full


@settings(SETTINGS, max_examples=40)
@given(heuristic_instances(), st.sampled_from(["time", "cost"]))
def test_pruning_changes_no_heuristic_plan(
    inst: tuple[Snapshot, JobRequest], objective: str
) -> None:
    snap, j = inst
    pruned = plan(snap, j, objective)  # type: ignore[arg-type]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_Search, "prune", False)
        assert pruned == plan(snap, j, objective)  # type: ignore[arg-type]


def test_pruning_skips_sets_here() -> None:
    """A case where the floor rules out most sets: the equivalence tests compare something."""
    fast = [cluster(f"h{i}", 8, gpu_model="H100") for i in range(4)]
    slow = [cluster(f"t{i}", 8, gpu_model="T4") for i in range(4)]
    names = [c.name for c in fast + slow]
    snap = Snapshot(
        tuple(fast + slow), tuple(link(a, b) for a, b in itertools.combinations(names, 2))
    )
    j = job(8)
    scored: list[tuple[str, ...]] = []
    real = _Search.subset

    def spy(self: _Search, names: tuple[str, ...], quick: bool = False) -> object:
        scored.append(names)
        return real(self, names, quick)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_Search, "subset", spy)
        pruned = plan(snap, j, "time")
        n_pruned = len(scored)
        scored.clear()
        mp.setattr(_Search, "prune", False)
        full = plan(snap, j, "time")
    assert pruned == full
    assert n_pruned < len(scored) / 2, (n_pruned, len(scored))


def test_pruning_keeps_a_set_that_meets_the_deadline() -> None:
    """Four feasible fast sets come first; the cheapest set, z, is slower but meets the
    deadline: its time floor is over half the deadline, yet it must be scored."""
    fast = [cluster(n, 1, gpu_model="H100", price_per_gpu_hour=4.0) for n in "abcd"]
    snap = Snapshot((*fast, cluster("z", 1, gpu_model="A100", price_per_gpu_hour=0.5)))
    alone = evaluate(snap, job(1), [Assignment("z", 1)])
    assert isinstance(alone, Plan)
    j = job(1, qos=QoS(deadline_s=1.5 * alone.estimate.total_time_s))
    got = plan(snap, j, "cost-within-deadline")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_Search, "prune", False)
        assert got == plan(snap, j, "cost-within-deadline")
    assert isinstance(got, Plan) and got.placement == (Assignment("z", 1),)


def test_screening_skips_sets_that_cannot_beat_the_current_one() -> None:
    """More clusters than the exact search takes: growing a set around each seed screens
    only the sets whose floor can still beat the seed or rank among the best screened
    (`_Search._cannot_beat`), with the same plan, explanation included. The seeds are the
    H100 clusters; once six sets are screened, a set that gives up one of their GPUs for a T4
    cannot run this compute-bound job faster than one of them alone: most are skipped."""
    fast = [cluster(f"h{i:02}", 8, gpu_model="H100") for i in range(4)]
    slow = [cluster(f"t{i:02}", 8, gpu_model="T4") for i in range(8)]
    names = [c.name for c in fast + slow]
    snap = Snapshot(
        tuple(fast + slow), tuple(link(a, b) for a, b in itertools.combinations(names, 2))
    )
    j = job(8, params=1_000_000)
    scored: list[tuple[str, ...]] = []
    real = _Search._score

    def spy(self: _Search, names: tuple[str, ...], allocs: list[Any]) -> object:
        if len(names) > 1:
            scored.append(names)
        return real(self, names, allocs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_Search, "_score", spy)
        pruned = plan(snap, j, "time")
        with_pruning = list(scored)
        scored.clear()
        mp.setattr(_Search, "prune", False)
        full = plan(snap, j, "time")
    assert pruned == full
    assert isinstance(pruned, Plan) and len(pruned.placement) == 1
    with_t = [s for s in with_pruning if any(n.startswith("t") for n in s)]
    without_t = [s for s in scored if any(n.startswith("t") for n in s)]
    assert with_pruning and len(with_t) < len(without_t) / 2
