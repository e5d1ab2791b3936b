"""The heuristic path (more clusters than the exact search takes): its plans obey every rule
and agree with `evaluate`, and it finds a plan whenever one cluster alone could take the job."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import Infeasible, JobRequest, Plan, QoS, Snapshot, evaluate, plan
from scheduler.optimizer import EXACT_MAX_CLUSTERS
from scheduler.rules import is_clique
from tests.scheduler.builders import cluster, job, link


@st.composite
def large(draw: st.DrawFn) -> tuple[Snapshot, JobRequest, str]:
    n = draw(st.integers(EXACT_MAX_CLUSTERS + 1, 24))
    names = [f"k{i:02d}" for i in range(n)]
    clusters = tuple(
        cluster(
            nm,
            draw(st.sampled_from([0, 2, 4, 8, 16])),
            gpu_model=draw(st.sampled_from(["H100", "A100", "L4", "B200"])),
            price_per_gpu_hour=draw(st.sampled_from([0.5, 1.0, 3.0])),
            state=draw(st.sampled_from(["READY"] * 5 + ["DOWN"])),
            cordoned=draw(st.integers(0, 9)) == 0,
            region=draw(st.sampled_from(["us", "eu", "ap"])),
        )
        for nm in names
    )
    links = tuple(
        link(
            a,
            b,
            gbps=draw(st.sampled_from([0.5, 5.0, 50.0])),
            rtt_ms=draw(st.sampled_from([2.0, 80.0])),
        )
        for a, b in itertools.combinations(names, 2)
        if draw(st.integers(0, 3)) > 0
    )
    lo = draw(st.sampled_from([4, 8, 16, 24, 32]))
    qos = QoS(
        max_clusters=draw(st.sampled_from([None, 2, 4])),
        regions=draw(st.sampled_from([None, ("us", "eu")])),
    )
    j = job(
        lo,
        max_gpus=lo + draw(st.sampled_from([0, 8])),
        params=draw(st.sampled_from([10**8, 10**9])),
        qos=qos,
    )
    return Snapshot(clusters, links), j, draw(st.sampled_from(["time", "cost"]))


@settings(max_examples=40, deadline=None, derandomize=True)
@given(large())
def test_heuristic_plans_obey_the_rules(inst: tuple[Snapshot, JobRequest, str]) -> None:
    snap, j, objective = inst
    got = plan(snap, j, objective, slack=0.0)  # type: ignore[arg-type]
    allowed = [
        c
        for c in snap.clusters
        if c.schedulable and (j.qos.regions is None or c.region in j.qos.regions)
    ]
    if any(c.gpus_free >= j.min_gpus for c in allowed):
        assert isinstance(got, Plan), got  # a single cluster would do: never infeasible
    if isinstance(got, Infeasible):
        return
    names = [a.cluster for a in got.placement]
    assert j.min_gpus <= got.gpus <= j.max_gpus
    assert all(snap.by_name[a.cluster].gpus_free >= a.gpus >= 1 for a in got.placement)
    assert set(names) <= {c.name for c in allowed}
    assert j.qos.max_clusters is None or len(names) <= j.qos.max_clusters
    assert is_clique(snap, names)
    again = evaluate(snap, j, got.placement, objective, slack=0.0)  # type: ignore[arg-type]
    assert isinstance(again, Plan)
    key = "total_time_s" if objective == "time" else "cost"
    # evaluate picks the best compression/sync for the placement: never worse than the plan's
    assert getattr(again.estimate, key) == pytest.approx(getattr(got.estimate, key), rel=1e-9)
    assert plan(snap, j, objective, slack=0.0) == got  # type: ignore[arg-type]


def test_a_gang_larger_than_any_cluster_finds_linked_room_past_stranded_seeds() -> None:
    """The four clusters the heuristic seeds from (most power alone; ties by name) have room
    but no linked neighbour with any; five clusters linked to each other have 160 GPUs. A
    gang of 48 must be placed there, not refused as "no set of pairwise-linked clusters"."""
    stranded = [cluster(n, 32) for n in ("a", "b", "c", "d")]
    region = [f"z{i}" for i in range(5)]
    snap = Snapshot(
        (*stranded, *(cluster(n, 32) for n in region)),
        tuple(link(x, y) for x, y in itertools.combinations(region, 2)),
    )
    assert len(snap.clusters) > EXACT_MAX_CLUSTERS  # the heuristic's path
    got = plan(snap, job(48), "time")
    assert isinstance(got, Plan), got
    assert {a.cluster for a in got.placement} <= set(region) and got.gpus == 48
    assert is_clique(snap, [a.cluster for a in got.placement])
