"""The plan is the run: the WAN ring the planner priced is the ring the runtime runs.

A real plan over four clusters with one slow link (the planner's ring avoids it), turned into
the run's TrainSpec by the controller's ordering, trained on a real local Ray: the worker's
report shows bytes on the ring's edges only, none on the slow link."""

from __future__ import annotations

import pytest

import training
from controller.loop.ray_run import ring_ordered
from scheduler import Plan, Snapshot, plan
from tests.scheduler.builders import cluster, job, link
from training import TrainSpec

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.slow]


def test_the_runtime_runs_the_planners_ring() -> None:
    names = "abcd"
    # a slow link a-b; every other pair fast: the planner's ring goes round it
    links = tuple(
        link(x, y, gbps=0.005 if {x, y} == {"a", "b"} else 1.0, rtt_ms=1.0)
        for i, x in enumerate(names)
        for y in names[i + 1 :]
    )
    snap = Snapshot(tuple(cluster(n, 1) for n in names), links)
    got = plan(snap, job(4, params=10_000, compression="none", sync="every-step"), "time")
    assert isinstance(got, Plan) and {a.cluster for a in got.placement} == set(names)
    ring = got.estimate.ring
    edges = set(zip(ring, (*ring[1:], ring[0]), strict=True))
    assert ("a", "b") not in edges and ("b", "a") not in edges
    # the clusters as the controller received them (alphabetical: a, b, c, d puts a next to b)
    given = {a.cluster: a.gpus for a in sorted(got.placement, key=lambda a: a.cluster)}
    ordered = ring_ordered(given, ring)
    assert list(ordered) == list(ring)
    report = training.run(
        TrainSpec(task="builtin:mnist1d-mlp", clusters=ordered, steps=2, eval_every=2)
    )
    used = {edge for edge, n in report.wan_bytes.items() if n > 0}
    assert used == edges  # what ran is what was planned, edge for edge
    assert ordered == {a.cluster: a.gpus for a in got.placement}


def test_ring_ordered_keeps_clusters_the_ring_does_not_name() -> None:
    assert list(ring_ordered({"a": 1, "b": 2, "c": 1}, ("c", "a"))) == ["c", "a", "b"]
    assert ring_ordered({"a": 1, "b": 2}, ()) == {"a": 1, "b": 2}
