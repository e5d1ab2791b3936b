"""The planner against brute force: every allocation of GPUs to clusters, each one scored by
the public `evaluate` (which picks the compression and sync for it), the best one kept."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grammar.quality import SLACK
from scheduler import (
    Assignment,
    Infeasible,
    JobRequest,
    Plan,
    QoS,
    Snapshot,
    evaluate,
    plan,
)
from tests.scheduler.builders import cluster, job, link

MODELS = ("H100", "A100", "L4", "V100")


@st.composite
def instances(draw: st.DrawFn) -> tuple[Snapshot, JobRequest, str]:
    n = draw(st.sampled_from([1, 2, 3, 4, 5, 6, 7, 8, 8, 6, 5, 4]))
    names = [f"c{i}" for i in range(n)]
    clusters = tuple(
        cluster(
            name,
            draw(st.sampled_from([0, 1, 2, 2] if n > 5 else [0, 1, 2, 3, 3])),
            gpu_model=draw(st.sampled_from(MODELS)),
            price_per_gpu_hour=draw(st.sampled_from([0.5, 1.0, 2.0, 4.0])),
            intra_bandwidth_gbps=draw(st.sampled_from([10.0, 100.0])),
            state=draw(st.sampled_from(["READY"] * 6 + ["SUSPECT", "DOWN"])),
            cordoned=draw(st.integers(0, 7)) == 0,
            region=draw(st.sampled_from(["us", "us", "eu"])),
        )
        for name in names
    )
    links = tuple(
        link(
            a,
            b,
            gbps=draw(st.sampled_from([0.1, 1.0, 10.0, 100.0])),
            rtt_ms=draw(st.sampled_from([1.0, 30.0, 150.0])),
            egress=draw(st.sampled_from([0.0, 0.02, 0.09])),
        )
        for a, b in itertools.combinations(names, 2)
        if draw(st.integers(0, 9)) > 0
    )
    lo = draw(st.sampled_from([1, 2, 3, 4, 5, 6, 4, 5]))
    hi = lo + draw(st.sampled_from([0, 0, 2]))
    qos = QoS(
        max_clusters=draw(st.sampled_from([None, None, None, 2, 3])),
        regions=draw(st.sampled_from([None, None, None, ("us",)])),
        deadline_s=draw(st.sampled_from([None, None, None, 50.0, 500.0])),
        max_cost=draw(st.sampled_from([None, None, None, 0.5, 5.0])),
    )
    j = job(
        lo,
        max_gpus=hi,
        params=draw(st.sampled_from([10_000_000, 300_000_000])),
        flops_per_step=draw(st.sampled_from([1e14, 1e15, 1e16])),
        steps=draw(st.sampled_from([10, 100])),
        compression=draw(st.sampled_from(["auto", "none", "powersgd:4"])),
        sync=draw(st.sampled_from(["auto", "every-step"])),
        qos=qos,
    )
    objective = draw(st.sampled_from(["time", "cost"]))
    return Snapshot(clusters, links), j, objective


def brute_force(snap: Snapshot, j: JobRequest, objective: str) -> Plan | None:
    best: Plan | None = None
    ranges = [range(0, c.gpus_free + 1) for c in snap.clusters]
    for gpus in itertools.product(*ranges):
        if not j.min_gpus <= sum(gpus) <= j.max_gpus:
            continue
        pl = [Assignment(c.name, g) for c, g in zip(snap.clusters, gpus, strict=True) if g]
        r = evaluate(snap, j, pl, objective, slack=0.0)  # type: ignore[arg-type]
        if not isinstance(r, Plan):
            continue
        e = r.estimate
        key = (e.total_time_s, e.cost) if objective == "time" else (e.cost, e.total_time_s)
        if best is None:
            best = r
            continue
        b = best.estimate
        bkey = (b.total_time_s, b.cost) if objective == "time" else (b.cost, b.total_time_s)
        if key < bkey:
            best = r
    return best


@settings(
    max_examples=80,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(instances())
def test_plan_equals_exhaustive_search(inst: tuple[Snapshot, JobRequest, str]) -> None:
    snap, j, objective = inst
    got = plan(snap, j, objective, slack=0.0)  # type: ignore[arg-type]
    want = brute_force(snap, j, objective)
    if want is None:
        assert isinstance(got, Infeasible), got
        return
    assert isinstance(got, Plan), (got, want.placement)
    g, w = got.estimate, want.estimate
    if objective == "time":
        assert g.total_time_s == pytest.approx(w.total_time_s, rel=1e-9)
    else:
        assert g.cost == pytest.approx(w.cost, rel=1e-9)
    # the plan it returns is also what evaluate says about that placement
    again = evaluate(snap, j, got.placement, objective, slack=0.0)  # type: ignore[arg-type]
    assert isinstance(again, Plan)
    assert again.estimate.total_time_s == pytest.approx(g.total_time_s)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(instances())
def test_the_least_lossy_choice_within_the_slack_of_the_best(
    inst: tuple[Snapshot, JobRequest, str],
) -> None:
    # quality is part of the objective: never lossier than the best by the objective, never
    # more than SLACK behind it
    snap, j, objective = inst
    best = plan(snap, j, objective, slack=0.0)  # type: ignore[arg-type]
    got = plan(snap, j, objective)  # type: ignore[arg-type]
    if not isinstance(best, Plan):
        assert not isinstance(got, Plan)
        return
    assert isinstance(got, Plan)
    key = "total_time_s" if objective == "time" else "cost"
    assert getattr(got.estimate, key) <= getattr(best.estimate, key) * (1 + SLACK) + 1e-9
    assert got.estimate.quality_cost <= best.estimate.quality_cost + 1e-9
    assert any(line.startswith("quality: ") for line in got.explanation)


@settings(max_examples=15, deadline=None, derandomize=True)
@given(instances())
def test_plan_is_deterministic(inst: tuple[Snapshot, JobRequest, str]) -> None:
    snap, j, objective = inst
    assert plan(snap, j, objective) == plan(snap, j, objective)  # type: ignore[arg-type]


def test_cost_optimum_inside_the_gpu_split_is_found() -> None:
    # Neither "fastest GPUs first" (c0 x3 + c1 x5) nor "cheapest FLOPs first" fills is the
    # cheapest here: c0 x2 + c1 x6 is, because c1's slow 5 Gb/s fabric makes its all-reduce
    # grow with its share. Found by random search; kept as a fixed case for the cost DP.
    snap = Snapshot(
        (
            cluster("c0", 3, gpu_model="B200", price_per_gpu_hour=9.0, intra_bandwidth_gbps=400.0),
            cluster("c1", 6, gpu_model="L4", price_per_gpu_hour=1.0, intra_bandwidth_gbps=5.0),
            cluster("c2", 1, gpu_model="B200", price_per_gpu_hour=2.0, intra_bandwidth_gbps=5.0),
        ),
        (
            link("c0", "c1", gbps=50.0, rtt_ms=1.0, egress=0.05),
            link("c0", "c2", gbps=5.0, rtt_ms=50.0, egress=0.05),
            link("c1", "c2", gbps=0.5, rtt_ms=50.0, egress=0.0),
        ),
    )
    j = job(8, params=1_000_000_000, flops_per_step=1e16, compression="none", sync="every-step")
    got = plan(snap, j, "cost")
    want = brute_force(snap, j, "cost")
    assert isinstance(got, Plan) and want is not None
    assert got.estimate.cost == pytest.approx(want.estimate.cost, rel=1e-9)
    assert {(a.cluster, a.gpus) for a in got.placement} == {("c0", 2), ("c1", 6)}
