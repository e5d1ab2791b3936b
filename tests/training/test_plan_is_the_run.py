"""The plan is the run: the WAN ring the planner priced is the ring the runtime runs, and a
job placed by the control plane runs its plan decision by decision.

A real plan over four clusters with one slow link (the planner's ring avoids it), turned into
the run's TrainSpec by the controller's ordering, trained on a real local Ray: the worker's
report shows bytes on the ring's edges only, none on the slow link."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

import training
from controller.loop.ray_run import train_spec_of
from controller.store.migrate import upgrade
from controller.store.models import Job
from grammar import SyncKind, parse_sync
from scheduler import Plan, Snapshot, plan
from tests.controller.world import TASK, Net
from tests.scheduler.builders import cluster, job, link
from training import TrainSpec
from training.faults import ring_ordered
from wire.spec import JobSpec

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
    # 4 MB a copy: bandwidth-bound, so the ring (a tree sends whole copies hop by hop)
    got = plan(snap, job(4, params=1_000_000, compression="none", sync="every-step"), "time")
    assert isinstance(got, Plan) and {a.cluster for a in got.placement} == set(names)
    assert got.estimate.tree == ()
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


def test_the_runtime_runs_the_planners_tree() -> None:
    """Three datacenters 150 ms apart and a small model: latency dominates, so the planner
    all-reduces over a tree (2 hops an exchange, the ring's 4), rooted at the cluster with
    the most bandwidth; the run, given the plan's tree as the controller gives it, sends on
    the tree's edges only, both ways, none on the link between the two leaves."""
    names = "abc"
    links = (
        link("a", "b", gbps=1.0, rtt_ms=150.0),
        link("a", "c", gbps=2.0, rtt_ms=150.0),
        link("b", "c", gbps=2.0, rtt_ms=150.0),
    )
    snap = Snapshot(tuple(cluster(n, 1) for n in names), links)
    got = plan(snap, job(3, params=20_000, compression="none", sync="every-step"), "time")
    assert isinstance(got, Plan) and {a.cluster for a in got.placement} == set(names)
    tree = dict(got.estimate.tree)
    assert tree == {"a": "c", "b": "c"}  # c has the most bandwidth to the others
    assert any("tree all-reduce from c" in line for line in got.explanation), got.explanation
    even = replace(snap, links=tuple(replace(k, rtt_ms=0.0, bandwidth_gbps=1.0) for k in links))
    ring = plan(even, job(3, params=20_000, compression="none", sync="every-step"), "time")
    assert isinstance(ring, Plan) and ring.estimate.tree == ()  # no latency: the ring
    given = {a.cluster: a.gpus for a in got.placement}
    report = training.run(
        TrainSpec(task="builtin:mnist1d-mlp", clusters=given, steps=2, eval_every=2, tree=tree)
    )
    on_tree = {("a", "c"), ("c", "a"), ("b", "c"), ("c", "b")}
    assert {edge for edge, n in report.wan_bytes.items() if n > 0} >= on_tree
    # off the tree only the start-up's model digests (gloo's own all-gather), counted apart
    off = sum(n for edge, n in report.wan_bytes.items() if edge not in on_tree)
    assert off <= report.wan_setup_bytes < 1000


def test_ring_ordered_keeps_clusters_the_ring_does_not_name() -> None:
    assert list(ring_ordered({"a": 1, "b": 2, "c": 1}, ("c", "a"))) == ["c", "a", "b"]
    assert ring_ordered({"a": 1, "b": 2}, ()) == {"a": 1, "b": 2}


@pytest.fixture
def net(tmp_path: Path) -> Iterator[Net]:
    """Three datacenters of unequal GPUs (the session's Ray clusters a, b, c) on a real
    SQLite control plane: a 2x H100, b 1x A100, c 1x L4, joined by 1 Gbit/s links."""
    url = f"sqlite:///{tmp_path / 'cpn.db'}"
    upgrade(url)
    n = Net(url, tmp_path / "checkpoints")
    for name, gpus, model in (("a", 2, "H100"), ("b", 1, "A100"), ("c", 1, "L4")):
        n.cluster(name, gpus=gpus, model=model)
    for x, y in ("ab", "bc", "ca"):
        n.link(x, y, gbps=1.0, rtt_ms=2.0)
    yield n
    n.close()


@pytest.mark.parametrize(
    ("compression", "sync"), [("auto", "auto"), ("int8", "local-sgd:4"), ("none", "stale:1")]
)
def test_what_ran_is_what_was_planned_decision_by_decision(
    net: Net, compression: str, sync: str
) -> None:
    """A job placed by the control plane, launched as the controller launches it
    (`train_spec_of`) and trained on Ray: the report shows the plan's placement, compression
    and sync, its batch split (by throughput where gradients are averaged every step, equally
    per worker where clusters take local steps) and bytes on its ring's edges only."""
    spec = JobSpec(name="p", task=TASK, gpus=4, steps=6, compression=compression, sync=sync)
    job_id = net.submit(net.tenant("acme"), spec)
    assert net.place() == [job_id]
    with net.sessions() as s:
        job = s.get(Job, job_id)
        assert job is not None and job.placement is not None
        planned = job.placement
        train = train_spec_of(net.launcher.config, job, spec, net.held(job_id))
    run = replace(train, checkpoint=None, resume=False, eval_every=3, batch_size=400)
    report = training.run(run)
    assert report.clusters == {a.cluster: a.gpus for a in planned.clusters}
    assert (report.compression, report.sync) == (planned.compression, planned.sync)
    shares = planned.estimate.batch_shares
    # to the sample: each of the 4 workers takes a whole number of the 400
    assert report.batch_shares == pytest.approx(shares, abs=4 / 400)
    if parse_sync(planned.sync).kind in (SyncKind.EVERY_STEP, SyncKind.STALE):
        assert shares["a"] > shares["b"] > shares["c"]  # by throughput
    else:
        assert shares == pytest.approx({"a": 0.5, "b": 0.25, "c": 0.25})  # per worker
    ring = planned.estimate.ring
    edges = set(planned.estimate.tree.items()) or set(zip(ring, (*ring[1:], ring[0]), strict=True))
    assert run.tree == planned.estimate.tree  # the tree, when the plan chose one
    used = {edge for edge, n in report.wan_bytes.items() if n > 0}
    off = sum(n for e, n in report.wan_bytes.items() if e not in edges | {(b, a) for a, b in edges})
    assert used and off <= report.wan_setup_bytes  # the start-up's digests go round the ring


def test_an_auto_split_runs_as_planned(net: Net) -> None:
    """A model no GPU holds whose work says how its layers split (builtin:char-gpt standing
    in for a 6 B-parameter one): `auto` weighs the split beside the pipeline, and the run on
    Ray is the split it chose: one stage, its layers over a's two workers."""
    from controller.loop.ray_run import pipeline_spec_of
    from training.pipeline import run_pipeline
    from wire.spec import Work

    work = Work(params=6 * 10**9, flops_per_step=1e14, blocks=2, heads=4, activation_bytes=2**14)
    spec = JobSpec(
        name="split", task="builtin:char-gpt", gpus=2, steps=2, work=work,
        args={"batch_size": 8, "eval_every": 2}, qos={"max_clusters": 1}, preference=["a"],
    )  # fmt: skip
    job_id = net.submit(net.tenant("acme"), spec)
    assert net.place() == [job_id]
    with net.sessions() as s:
        job = s.get(Job, job_id)
        assert job is not None and job.placement is not None
        par = job.placement.parallel
        train = train_spec_of(net.launcher.config, job, spec, net.held(job_id))
        run = pipeline_spec_of(job, spec, replace(train, checkpoint=None, resume=False))
    assert (par.mode, par.tensor, [st.cluster for st in par.stages]) == ("tensor", 2, ["a"])
    assert "weighed: a pipeline of 2 stages" in par.reason
    assert run is not None
    report = run_pipeline(run)
    assert (report.parallel, report.tensor, report.stage_clusters) == ("tensor", 2, ["a"])
    assert report.steps == 2
