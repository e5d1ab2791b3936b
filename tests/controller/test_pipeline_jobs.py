"""Pipeline and hybrid jobs in the control plane, fast (no Ray): the spec's `parallelism`, the
plan that records it (the spec's, or the memory model's under `auto`), the stage run the
launcher builds from the plan, and activation bytes metered like WAN bytes.

The run itself (stage actors over gloo) is `tests/training/test_pipeline.py`'s; a pipeline job
through a real `cpn serve` and Ray is `test_pipeline_job_end_to_end` below (slow).
"""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from sqlalchemy import select, update

from controller.loop.ray_run import pipeline_spec_of, train_spec_of
from controller.network.snapshot import SETUP_PRIOR_S
from controller.store.models import Cluster, Job, JobEvent, Usage
from controller.values.plan import MICRO_BATCHES_FALLBACK, keep_stages
from grammar.states import JobState
from scheduler.pipeline_cost import (
    ALL_REDUCE_OVERHEAD_S,
    MICRO_BATCH_OVERHEAD_S,
    micro_batch_candidates,
)
from tests.controller.world import Net, progress, report
from training.pipeline.report import report_of, stage_progress
from training.pipeline.spec import PipelineReport, StageResult
from training.results import WanBytes
from wire.spec import JobSpec, Work, stored_spec

TASK = "builtin:char-transformer"


def _spec(name: str, **kw: Any) -> JobSpec:
    base: dict[str, Any] = {"name": name, "task": TASK, "gpus": 2, "steps": 20}
    return JobSpec.model_validate({**base, **kw})


@pytest.fixture
def net(db_url: str, tmp_path: Path) -> Iterator[Net]:
    """Clusters east and west, one A100 each, joined by a slow link: a 2-GPU job spans both."""
    n = Net(db_url, tmp_path)
    n.cluster("east", gpus=1, price="2.5")
    n.cluster("west", gpus=1, price="2.5")
    n.link("east", "west", gbps=0.1, rtt_ms=40.0)
    yield n
    n.close()


# ---- the spec ---------------------------------------------------------------------------


def test_spec_parallelism_defaults_and_refusals() -> None:
    """`auto` by default (old stored specs too); what a pipeline run cannot do is refused at
    submission, naming the field and the fix."""
    plain = _spec("a")
    assert plain.parallelism == "auto" and plain.pipeline.micro_batches is None  # the planner's
    old = plain.model_dump(mode="json")
    del old["parallelism"], old["pipeline"]
    assert stored_spec(old).parallelism == "auto"
    ok = _spec("p", parallelism="pipeline", compression="int8", pipeline={"stages": " 2 "})
    assert ok.pipeline.stages == "2" and ok.compression == "int8"
    assert _spec("h", gpus=4, parallelism="hybrid", pipeline={"stages": "@2"}).pipeline.stages
    refused: dict[str, dict[str, Any]] = {
        "compression": {"compression": "topk:0.01"},
        "sync": {"sync": "local-sgd:8"},
        "gpus": {"gpus": None, "min_gpus": 2, "max_gpus": 4},
        "pipeline.stages": {"pipeline": {"stages": "3"}},
        "data.residency": {"data": {"residency": "local", "clusters": ["east"]}},
    }
    for field, kw in refused.items():
        with pytest.raises(ValidationError, match=field.replace(".", r"\.")):
            _spec("x", parallelism="pipeline", **kw)
    with pytest.raises(ValidationError, match="stages"):
        _spec("x", parallelism="pipeline", pipeline={"stages": "@0"})
    with pytest.raises(ValidationError, match="parallelism"):
        _spec("x", parallelism="sideways")


# ---- the plan and the launch --------------------------------------------------------------


def _placed(net: Net, spec: JobSpec) -> Job:
    tenant = net.tenant(f"t-{spec.name}")
    job_id = net.submit(tenant, spec)
    assert net.place() == [job_id]
    return net.job(job_id)


def _pipeline_of(net: Net, job: Job) -> Any:
    spec = stored_spec(job.spec)
    with net.sessions() as s:
        fresh = s.get(Job, job.id)
        assert fresh is not None
        train = train_spec_of(net.launcher.config, fresh, spec, net.held(job.id))
    return pipeline_spec_of(job, spec, train)


def test_pipeline_job_plan_and_stage_run(net: Net) -> None:
    """A pipeline job's plan records one stage a GPU in pipeline order; the launcher runs the
    plan's stages with the spec's split, schedule and activation compression, every step in
    sync, every stage checkpointing under the job's root and resuming from it when a shard
    is there; a data job keeps `training.run`."""
    job = _placed(
        net,
        _spec(
            "pipe",
            parallelism="pipeline",
            compression="fp16",
            pipeline={"stages": "@3", "micro_batches": 8, "schedule": "1f1b"},
        ),
    )
    assert job.state is JobState.SCHEDULED and job.placement is not None
    par = job.placement.parallel
    assert par.mode == "pipeline"
    assert sorted(s.cluster for s in par.stages) == ["east", "west"]
    assert par.micro_batches == 8 and par.bubble == pytest.approx(1 / 9)
    assert any("pipeline" in line for line in job.placement.explanation)
    # what it reserves of the ports is its stages' activations over its steps' time
    est = job.placement.estimate
    rate = -(-est.wan_bytes * 8 // 2) / (est.total_time_s - est.setup_s) / 1000
    assert job.placement.wan_kbps == dict.fromkeys(("east", "west"), pytest.approx(rate, abs=1))
    run = _pipeline_of(net, job)
    assert run.placement.stage_clusters == tuple(s.cluster for s in par.stages)
    assert run.placement.replicas == 1 and run.cuts == (3,)
    assert (run.micro_batches, str(run.schedule), str(run.activations)) == (8, "1f1b", "fp16")
    assert str(run.train.sync) == "every-step" and run.train.resume
    assert run.train.checkpoint is not None and run.train.checkpoint.endswith(job.id)
    assert run.train.run_id == job.id
    assert run.train.clusters == {"east": 1, "west": 1}
    # stored and read back: the plan's JSON keeps the parallelism
    again = type(job.placement).model_validate(job.placement.model_dump(mode="json"))
    assert again.parallel == par


def test_auto_takes_pipeline_only_when_the_model_fits_no_gpu(db_url: str, tmp_path: Path) -> None:
    """Under `auto` the plan's memory verdict decides: a model whose parameters, gradients and
    Adam state exceed an A100 becomes a pipeline over the job's GPUs; a small one stays data
    parallel, and the launcher then runs `training.run` (no stage run)."""
    net = Net(db_url, tmp_path)
    try:
        net.cluster("east", gpus=3)
        net.cluster("west", gpus=2)
        net.link("east", "west")
        big = _placed(
            net,
            _spec(
                "big", gpus=4, task="builtin:mnist1d-mlp",
                work=Work(params=10**10, flops_per_step=1e12),
            ),
        )  # fmt: skip
        assert big.placement is not None
        par = big.placement.parallel
        assert par.mode == "pipeline" and len(par.stages) == 4
        assert par.model_gb is not None and par.model_gb > max(par.gpu_gb.values())
        assert "more than the largest" in par.reason
        small = _placed(net, _spec("small", gpus=1, task="builtin:mnist1d-mlp"))
        assert small.placement is not None and small.placement.parallel.mode == "data"
        assert "fits" in small.placement.parallel.reason
        assert _pipeline_of(net, small) is None
    finally:
        net.close()


def test_auto_weighs_every_depth_and_layout_whose_stages_fit(db_url: str, tmp_path: Path) -> None:
    """A 6 B-parameter model (96 GB of state) over two clusters of two 80 GB GPUs: two stages
    fit a GPU each (48 GB), so `auto` weighs two stages with replicas inside their clusters,
    two whole pipelines, and four stages of one GPU; the replicas' 12 GB gradient all-reduce
    a step outweighs the deeper pipeline's bubble, so the four stages win, and the plan says
    what it weighed."""
    net = Net(db_url, tmp_path)
    try:
        net.cluster("east", gpus=2)
        net.cluster("west", gpus=2)
        net.link("east", "west", gbps=0.1, rtt_ms=40.0)
        work = Work(params=6 * 10**9, flops_per_step=1e14)
        job = _placed(net, _spec("big", gpus=4, task="builtin:mnist1d-mlp", work=work))
        assert job.placement is not None
        par = job.placement.parallel
        assert par.mode == "pipeline" and [s.replicas for s in par.stages] == [1, 1, 1, 1]
        chosen = re.search(r"a pipeline of 4 stages, one a GPU, step ([0-9.]+) s", par.reason)
        weighed = re.findall(
            r"(inside their clusters|whole pipelines \(.*?\)) ([0-9.]+) s", par.reason
        )
        assert chosen is not None and len(weighed) == 2, par.reason
        assert all(float(chosen[1]) < float(step) for _, step in weighed)
        assert job.placement.estimate.step_time_s == pytest.approx(float(chosen[1]), rel=1e-3)
    finally:
        net.close()


@pytest.mark.parametrize(
    ("facts", "chosen"),
    [
        # small activations: a split's all-reduces are cheap, one 4-way split wins
        ({"blocks": 24, "heads": 16, "activation_bytes": 2**14}, "each layer split over 4 GPUs"),
        # a MB a sample a block to all-reduce: the pipeline's one boundary a stage wins
        ({"blocks": 24, "heads": 16, "activation_bytes": 2**20}, "a pipeline of 4 stages"),
        # a task of the tenant's own whose heads 4 does not divide: 2-way splits only
        ({"blocks": 24, "heads": 6, "activation_bytes": 2**14}, "(3D)"),
        # no layer facts: no split weighed
        ({}, "a pipeline of 4 stages"),
    ],
)
def test_auto_weighs_tensor_splits_as_the_work_says_the_layers_split(
    db_url: str, tmp_path: Path, facts: dict[str, int], chosen: str
) -> None:
    """A 6 B-parameter model (96 GB of state) on one cluster of four 80 GB GPUs, its work
    saying how its layers split: `auto` weighs every split width the heads allow beside the
    pipelines, as `cpn plan` does, takes the shortest step, says what it weighed, and the
    launcher runs the split it chose."""
    net = Net(db_url, tmp_path)
    try:
        net.cluster("big", gpus=4)
        work = Work(params=6 * 10**9, flops_per_step=1e14, **facts)
        task = "builtin:char-gpt" if facts.get("heads", 4) % 4 == 0 else "mycorp.train:gpt"
        spec = _spec("big", gpus=4, task=task, work=work, args={"batch_size": 32})
        job = _placed(net, spec)
        assert job.placement is not None
        par = job.placement.parallel
        step = job.placement.estimate.step_time_s
        found = re.search(r"; ([^;]*), step ([0-9.]+) s \(weighed: (.*)\)$", par.reason)
        assert found is not None, par.reason
        assert chosen in found[1] and float(found[2]) == pytest.approx(step, rel=1e-3)
        weighed = [float(x) for x in re.findall(r" ([0-9.]+) s(?:,|$)", found[3])]
        assert weighed and all(step < x for x in weighed), par.reason
        splits = re.findall(r"split over (\d) GPUs", par.reason)
        widths = {int(t) for t in splits}
        assert widths == ({2, 4} if facts and facts["heads"] % 4 == 0 else {2} if facts else set())
        run = _pipeline_of(net, job)
        assert run is not None
        assert run.placement.tensor == par.tensor
        assert run.placement.stage_clusters == tuple(st.cluster for st in par.stages)
        if par.mode == "tensor":
            assert (par.tensor, len(par.stages)) == (4, 1)
    finally:
        net.close()


def test_an_auto_split_placed_again_keeps_its_stages_not_a_gpu_it_does_not_fit(
    db_url: str, tmp_path: Path
) -> None:
    """An `auto` tensor split placed again (one stage) stays split: one stage of four whole
    replicas of the model would fit no GPU."""
    from controller.network.snapshot import build_world
    from controller.values.plan import parallel_of

    net = Net(db_url, tmp_path)
    try:
        net.cluster("big", gpus=4)
        work = Work(
            params=6 * 10**9, flops_per_step=1e14, blocks=24, heads=16, activation_bytes=2**14
        )
        spec = _spec("big", gpus=4, task="builtin:char-gpt", work=work, args={"batch_size": 32})
        job = _placed(net, spec)
        assert job.placement is not None and job.placement.parallel.mode == "tensor"
        with net.sessions() as s:
            world = build_world(s, job.qos_class)
        shares = job.placement.clusters
        again = parallel_of(spec, shares, world.snapshot, world.origins, keep=1)
        assert again.mode == "tensor" and len(again.stages) == 1 and again.tensor > 1
        assert "keeps its 1 stages" in again.reason
        deeper = parallel_of(spec, shares, world.snapshot, world.origins, keep=2)
        assert len(deeper.stages) == 2
    finally:
        net.close()


@pytest.mark.parametrize(
    ("names", "pairs"),
    [
        ("abcd", ("ac", "bd")),  # every order of the four clusters weighed
        ("abcdef", ("ad", "be", "cf")),  # too many: the shares' order and the fast chains
    ],
)
def test_whole_pipelines_pair_the_clusters_whose_links_carry_the_activations(
    db_url: str, tmp_path: Path, names: str, pairs: tuple[str, ...]
) -> None:
    """Clusters of one GPU, a hybrid of two stages: no stage can keep its replicas in one
    cluster, so the replicas are whole pipelines. Whichever clusters make a replica is
    weighed: the transformer's activations take the fast links, its gradients the slow
    ones, though the shares list the clusters in order (which would pair a-b, c-d, ...).
    Above four clusters, each chain along the fastest links is weighed beside the shares'
    order (`WHOLE_ORDERS_MAX`)."""
    net = Net(db_url, tmp_path)
    try:
        for name in names:
            net.cluster(name, gpus=1)
        fast = {frozenset(p) for p in pairs}
        for x, y in itertools.combinations(names, 2):
            if frozenset((x, y)) in fast:
                net.link(x, y, gbps=10.0, rtt_ms=2.0)
            else:
                net.link(x, y, gbps=0.05, rtt_ms=40.0)
        spec = _spec(
            "pairs", gpus=len(names), parallelism="hybrid", pipeline={"stages": "2"},
            preference=list(names), qos={"max_clusters": len(names)},
        )  # fmt: skip
        job = _placed(net, spec)
        assert job.placement is not None
        par = job.placement.parallel
        assert par.mode == "hybrid"
        assert all(len(s.replica_clusters) == len(pairs) for s in par.stages)
        rows = zip(*(s.replica_clusters for s in par.stages), strict=True)
        assert {frozenset(r) for r in rows} == fast, par.reason
        assert "weighed: " in par.reason
    finally:
        net.close()


@pytest.mark.parametrize(
    ("task", "batch", "whole"),
    [
        # at batch 8 the MLP's gradients (92 kB) outweigh its activations (4 kB): replicas
        # inside each stage's cluster
        ("builtin:mnist1d-mlp", 8, False),
        # the transformer's activations outweigh its gradients: whole pipelines, one a cluster
        (TASK, None, True),
    ],
)
def test_hybrid_plan_weighs_replicas_inside_clusters_against_whole_pipelines(
    db_url: str, tmp_path: Path, task: str, batch: int | None, whole: bool
) -> None:
    """Hybrid over two clusters of two GPUs: one stage a cluster with two replicas each
    (activations over the WAN), or a whole two-stage pipeline in each cluster (gradients
    over the WAN), whichever the pipeline estimate times faster; the plan says both, and the
    launcher runs the one chosen."""
    net = Net(db_url, tmp_path)
    try:
        net.cluster("east", gpus=2)
        net.cluster("west", gpus=2)
        net.link("east", "west", gbps=0.1, rtt_ms=40.0)
        args = {"batch_size": batch} if batch else {}
        job = _placed(net, _spec("hyb", task=task, gpus=4, parallelism="hybrid", args=args))
        assert job.placement is not None
        par = job.placement.parallel
        assert par.mode == "hybrid" and [s.replicas for s in par.stages] == [2, 2]
        assert "weighed: " in par.reason
        run = _pipeline_of(net, job)
        assert run.placement.replicas == 2 and run.placement.world == 4
        wan = {(a.src, a.dst) for a in job.placement.price.egress} if job.placement.price else set()
        if whole:
            assert [s.cluster for s in par.stages] in (["east", "east"], ["west", "west"])
            assert all(sorted(s.replica_clusters) == ["east", "west"] for s in par.stages)
            assert "2 whole pipelines" in par.reason
            assert sorted(run.placement.pipelines) == [("east", "east"), ("west", "west")]
            assert run.placement.replica_clusters(0) in (("east", "west"), ("west", "east"))
            assert (
                "all-reduce over the WAN between its 2 whole pipelines' clusters"
                in (job.placement.explanation[-1])
            )
        else:
            assert sorted(s.cluster for s in par.stages) == ["east", "west"]
            assert all(not s.replica_clusters for s in par.stages)
            assert run.placement.pipelines == ()
        assert wan == {("east", "west"), ("west", "east")}  # gradients or activations, priced
    finally:
        net.close()


# ---- metering -----------------------------------------------------------------------------


def _east_west_and_south(net: Net) -> None:
    """East and west, two GPUs each on a fast link, where a first plan goes; south, dearer and
    on slower links, where a lost cluster's stages can move."""
    net.cluster("east", gpus=2)
    net.cluster("west", gpus=2)
    net.cluster("south", gpus=2, price="9.0")  # dearer: not chosen at first
    net.link("east", "west")
    for a, b in [("east", "south"), ("west", "south")]:
        net.link(a, b, gbps=1.0)  # slower: the first plan takes east and west


def _stage(rank: int, cluster: str, sent: dict[tuple[str, str], int], loss: float | None) -> Any:
    return StageResult(
        rank=rank, stage=rank, cluster=cluster, step=0, loss=loss, compute_s=0.1 * (rank + 1),
        wait_s=0.05, steps_s=0.3, wan=WanBytes(sent), raw_bytes=2 * sum(sent.values()),
        params=1000,
    )  # fmt: skip


def test_activation_bytes_are_metered_and_the_job_succeeds(net: Net) -> None:
    """Stage results as the driver hands them after each segment become progress reports;
    the launcher's pass meters the new activation bytes per link as WAN usage (priced as
    egress), and the run's report settles the job SUCCEEDED with the pipeline's figures."""
    job = _placed(net, _spec("meter", parallelism="pipeline", steps=10))
    run = _pipeline_of(net, job)
    a, b = run.placement.stage_clusters
    handle = net.start(job.id)
    sent = [({(a, b): 4000}, {(b, a): 4000}), ({(a, b): 9000}, {(b, a): 8000})]
    for step, (fwd, back) in zip((5, 10), sent, strict=True):
        results = [_stage(0, a, fwd, None), _stage(1, b, back, 2.0 / step)]
        p = stage_progress(run, step, results, wall_s=0.1 * step)
        assert p.wan_bytes_total == sum(fwd.values()) + sum(back.values())
        assert p.compression_ratio == 2.0 and p.loss == 2.0 / step
        handle.on_progress(p)
        net.launcher.tick()
    final = PipelineReport(
        task=TASK, parallel="pipeline", stage_clusters=[a, b], replicas=1, cuts=[2],
        micro_batches=4, schedule="gpipe", activations="none", steps=10, final_loss=0.2,
        final_accuracy=0.5, wall_s=1.0, stage_compute_s=[0.1, 0.2], stage_wait_s=[0.05, 0.05],
        stage_params=[1000, 1000], activation_bytes=WanBytes({(a, b): 9500, (b, a): 8000}),
        compression_ratio=1.0, bubble_fraction=0.2, measured_bubble=0.3, wan_emulated=True,
    )  # fmt: skip
    out = report_of(run, final)
    assert out.clusters == {a: 1, b: 1} and out.sync_stats["bubble_fraction"] == 0.2
    assert not out.stopped
    last = stage_progress(run, 10, [_stage(0, a, {(a, b): 9500}, None)], 1.0, last_loss=0.2)
    assert last.loss == 0.2  # the stage with the loss missing: the previous loss, never NaN
    handle.on_progress(last)
    done = net.finish(handle, report=out)
    assert done.state is JobState.SUCCEEDED
    with net.sessions() as s:
        metered: dict[tuple[str, str], int] = {}
        for u in s.scalars(select(Usage).where(Usage.job_id == job.id, Usage.kind == "wan_bytes")):
            key = (u.cluster, u.dst_cluster or "")
            metered[key] = metered.get(key, 0) + int(u.quantity)
        events = list(s.scalars(select(JobEvent).where(JobEvent.job_id == job.id)))
    assert metered == {(a, b): 9500, (b, a): 8000}
    books = net.books(job.id)
    assert books.usage_rows >= 3 and books.charged > 0
    succeeded = [e for e in events if e.to_state is JobState.SUCCEEDED]
    assert succeeded and succeeded[0].data["report"]["wan_bytes_total"] == 17500


# ---- the stored plan is the pipeline's estimate ------------------------------------------


def test_stored_plan_of_a_pipeline_is_priced_as_a_pipeline(net: Net) -> None:
    """Two stages over the 0.1 Gbit/s, 40 ms link: the link is the bottleneck, so a GPipe
    step is M link times of one micro-batch's activations forward, M of their gradients back,
    a micro-batch's fixed cost on each of M + S - 1 slots and the link's RTT once
    (`scheduler.pipeline_cost`), and the WAN carries M activations and M gradients a step, not
    the data-parallel all-reduce; the price is the stages' GPU-hours plus that egress."""
    job = _placed(net, _spec("priced", parallelism="pipeline", pipeline={"micro_batches": 8}))
    plan = job.placement
    assert plan is not None and plan.parallel.mode == "pipeline"
    micro_bytes = 8192 * 64 / 8  # char-transformer: 8 KiB a sample crosses; batch 64 in 8
    link_s = micro_bytes * 8 / 0.1e9
    step = 2 * 8 * link_s + (8 + 2 - 1) * MICRO_BATCH_OVERHEAD_S + 40e-3  # compute: ~0.02 ms
    assert plan.estimate.step_time_s == pytest.approx(step, rel=1e-3)
    # the steps and the run's set-up (the prior: no run observed yet)
    assert plan.estimate.setup_s == SETUP_PRIOR_S
    assert plan.estimate.total_time_s == pytest.approx(
        SETUP_PRIOR_S + 20 * plan.estimate.step_time_s
    )
    assert plan.estimate.wan_bytes == round(2 * 8 * micro_bytes * 20)
    assert plan.price is not None and plan.estimate.cost == pytest.approx(plan.price.total)
    gpu_cost = 2 * 2.5 * plan.estimate.total_time_s / 3600
    egress = plan.estimate.wan_bytes / 1e9 * 0.01
    assert plan.price.total == pytest.approx(gpu_cost + egress, rel=1e-4)
    assert sorted((e.src, e.dst) for e in plan.price.egress) == [
        ("east", "west"),
        ("west", "east"),
    ]
    assert any(line.startswith("priced as a pipeline of 2 stages") for line in plan.explanation)


def test_the_planner_chooses_the_micro_batches_a_spec_leaves_open(net: Net) -> None:
    """Without `pipeline.micro_batches` the plan takes the shortest step's count
    (`scheduler.pipeline_cost.best_micro_batches`) at the micro-batch cost finished runs
    measured (the prior here: none ran), says so, and the run executes that count."""
    job = _placed(net, _spec("open", parallelism="pipeline"))
    plan = job.placement
    assert plan is not None
    par = plan.parallel
    assert par.micro_batches is not None and par.micro_overhead_s == MICRO_BATCH_OVERHEAD_S
    said = f"{par.micro_batches} micro-batch{'es' if par.micro_batches > 1 else ''} a step"
    assert any(said in r for r in plan.explanation), plan.explanation
    # the link paces both GPipe phases (its compute is far less): the whole batch's
    # activations forward and gradients back whatever M, a micro-batch's fixed cost on each
    # of M + 1 slots, the link's RTT once; so where the link is all, the fewest
    batch_bytes = 8192 * 64  # a whole batch's activations
    steps = {
        m: 2 * batch_bytes * 8 / 0.1e9 + (m + 1) * MICRO_BATCH_OVERHEAD_S + 40e-3
        for m in micro_batch_candidates(64, 2)
    }
    assert par.micro_batches == min(steps, key=lambda m: (steps[m], m)) == 1
    assert plan.estimate.step_time_s == pytest.approx(steps[par.micro_batches], rel=1e-3)
    assert _pipeline_of(net, job).micro_batches == par.micro_batches


def test_a_tenants_task_without_a_batch_keeps_the_default_micro_batches(net: Net) -> None:
    """A task of the tenant's own whose batch the spec does not say: the planner cannot weigh
    micro-batches, runs the default and says what would let it."""
    work = {"params": 10**6, "flops_per_step": 1e9}
    job = _placed(net, _spec("own", parallelism="pipeline", work=work))
    plan = job.placement
    assert plan is not None and plan.parallel.micro_batches == MICRO_BATCHES_FALLBACK
    assert any("args.batch_size would let the planner" in r for r in plan.explanation)


# ---- a DOWN cluster's stages are re-placed --------------------------------------------------

BIG = Work(params=10**10, flops_per_step=1e12)
"""160 GB of parameters, gradients and Adam state: no A100 holds it, a quarter fits one."""


def _running_pipeline(net: Net) -> tuple[Job, Any]:
    tenant = net.tenant("acme")
    job_id = net.submit(tenant, _spec("big", gpus=4, parallelism="pipeline", work=BIG))
    assert net.place() == [job_id]
    run = net.start(job_id)
    run.on_progress(progress(8, run.clusters, total_steps=20))
    net.launcher.tick()
    return net.job(job_id), run


def test_a_down_clusters_stages_move_and_the_pipeline_relaunches(
    db_url: str, tmp_path: Path
) -> None:
    """Four stages on east and west (two GPUs each); west goes DOWN. Only west's stages move,
    to south (the one cluster left with GPUs their memory fits: north's L4s hold 21.6 GB, a
    stage needs 40), east's stay on their GPUs; the job goes RESCHEDULING, naming each move,
    then SCHEDULED on the new stages with their GPUs reserved and west's released, and the
    relaunch runs the same four stages (same split: the stage checkpoints resume)."""
    net = Net(db_url, tmp_path)
    try:
        _east_west_and_south(net)
        job, run = _running_pipeline(net)
        net.cluster("north", gpus=4, model="L4", price="0.5")  # cheap, free, too small
        net.link("west", "north")
        assert job.placement is not None
        before = [s.cluster for s in job.placement.parallel.stages]
        assert sorted(before) == ["east", "east", "west", "west"]
        assert net.lose("west") == [("west", "READY", "DOWN")]
        net.launcher.tick()
        moved = net.finish(run, report=report(8, run.clusters, stopped=True))
        assert moved.state is JobState.SCHEDULED and moved.owner == "replica-a"
        assert net.states(job.id)[-3:] == [
            JobState.RUNNING,
            JobState.RESCHEDULING,
            JobState.SCHEDULED,
        ]
        assert moved.placement is not None
        after = [s.cluster for s in moved.placement.parallel.stages]
        assert after == ["south" if c == "west" else c for c in before]
        why = [m for m in net.messages(job.id) if m.startswith("cluster west is DOWN")]
        moves = [f"stage {i}: west -> south" for i, c in enumerate(before) if c == "west"]
        assert why and all(m in why[0] for m in moves) and "checkpoint" in why[0]
        assert net.held(job.id) == {"east": 2, "south": 2}
        assert net.books().in_use == {"east": 2, "west": 0, "south": 2, "north": 0}
        assert {s.cluster: s.gpus for s in moved.placement.clusters} == {"east": 2, "south": 2}
        assert "west" not in moved.placement.wan_kbps  # nothing reserved of the lost cluster
        assert moved.placement.price is not None
        assert {g.cluster for g in moved.placement.price.gpu} == {"east", "south"}
        # the relaunch: the same stages on their new clusters, resuming from the checkpoints
        stage_run = _pipeline_of(net, moved)
        assert stage_run.placement.stage_clusters == tuple(after)
        assert stage_run.train.resume and stage_run.train.clusters == {"east": 2, "south": 2}
        relaunched = net.start(job.id)
        assert net.job(job.id).state is JobState.RUNNING and relaunched.fence == run.fence + 1
    finally:
        net.close()


def test_a_stage_that_fits_nowhere_queues_the_pipeline(db_url: str, tmp_path: Path) -> None:
    """West goes DOWN and only north's L4s are free: a stage's 40 GB fits none of them, so
    the job waits in the queue (PENDING, saying why) with all its GPUs given back."""
    net = Net(db_url, tmp_path)
    try:
        net.cluster("east", gpus=2)
        net.cluster("west", gpus=2)
        net.link("east", "west")
        job, run = _running_pipeline(net)
        net.cluster("north", gpus=4, model="L4")
        net.link("east", "north")
        net.lose("west")
        net.launcher.tick()
        queued = net.finish(run, report=report(8, run.clusters, stopped=True))
        assert queued.state is JobState.PENDING
        assert "fits no cluster left after west went down" in queued.reason
        assert net.held(job.id) == {}
        assert net.books().in_use == {"east": 0, "west": 0, "north": 0}
    finally:
        net.close()


# ---- a hybrid placed again keeps its stages ------------------------------------------------


def test_keep_stages_puts_several_stages_on_a_cluster() -> None:
    assert keep_stages({"n": 4}, 2) == keep_stages({"n": 4}, 2)
    one = keep_stages({"n": 4}, 2)
    assert one is not None and (one.stage_clusters, one.replicas) == (("n", "n"), 2)
    odd = keep_stages({"a": 3, "b": 1}, 2)  # no equal width 2 over 3 + 1: one GPU a stage
    assert odd is not None and (odd.stage_clusters, odd.replicas) == (("a", "a"), 1)
    wide = keep_stages({"a": 2, "b": 4}, 3)
    assert wide is not None and (wide.stage_clusters, wide.replicas) == (("a", "b", "b"), 2)
    assert keep_stages({"a": 1}, 2) is None


def test_a_hybrid_replanned_onto_one_cluster_keeps_its_stage_count(
    db_url: str, tmp_path: Path
) -> None:
    """A hybrid of two stages (over east and west, two replicas each) fails an attempt and is
    placed again where only north's four GPUs are free. One stage a cluster would make it a
    single stage, whose run refuses the two-stage checkpoints ("stages: ... resume with the
    same number of stages"); it keeps two stages of two replicas, both on north."""
    net = Net(db_url, tmp_path)
    try:
        net.cluster("east", gpus=2)
        net.cluster("west", gpus=2)
        net.cluster("north", gpus=4, price="9.0")
        for a, b in [("east", "west"), ("east", "north"), ("west", "north")]:
            net.link(a, b)
        tenant = net.tenant("acme")
        # long enough that the set-up (SETUP_PRIOR_S) does not put every option in the slack
        job_id = net.submit(tenant, _spec("hyb", gpus=4, steps=200_000, parallelism="hybrid"))
        assert net.place() == [job_id]
        first = net.job(job_id).placement
        assert first is not None and first.parallel.mode == "hybrid"
        used = {c for s in first.parallel.stages for c in (*s.replica_clusters, s.cluster)}
        assert used == {"east", "west"}  # replicas inside clusters or whole pipelines
        run = net.start(job_id)
        failed = net.finish(run, error=RuntimeError("a stage actor died"))
        assert failed.state is JobState.RESCHEDULING
        with net.sessions() as s, s.begin():  # east and west take no new work now
            s.execute(update(Cluster).where(Cluster.name != "north").values(cordoned=True))
        assert net.place() == [job_id]
        again = net.job(job_id)
        assert again.state is JobState.SCHEDULED and net.held(job_id) == {"north": 4}
        assert again.placement is not None
        par = again.placement.parallel
        assert par.mode == "hybrid" and [(s.cluster, s.replicas) for s in par.stages] == [
            ("north", 2),
            ("north", 2),
        ]
        assert "keeps its 2 stages" in par.reason
        stage_run = _pipeline_of(net, again)
        assert stage_run.placement.stages == 2 and stage_run.placement.replicas == 2
    finally:
        net.close()


# ---- cpn plan ------------------------------------------------------------------------------


def test_cpn_plan_shows_the_parallelism(tmp_path: Path) -> None:
    """`cpn plan` on a model too large for any GPU of the snapshot: the memory-aware planner's
    pipeline (stages per cluster, memory per GPU, micro-batches and bubble, why), as text and
    in `--json`; a small model stays data parallel."""
    cluster = {"region": "r", "intra_bandwidth_gbps": 100, "price_per_gpu_hour": 1.0}
    snapshot = {
        "clusters": [
            {**cluster, "name": "a", "gpu_model": "A10G", "gpus_free": 2, "state": "READY"},
            {**cluster, "name": "b", "gpu_model": "L4", "gpus_free": 2, "state": "READY"},
        ],
        "links": [
            {"a": "a", "b": "b", "bandwidth_gbps": 1, "rtt_ms": 80, "egress_price_per_gb": 0}
        ],
    }
    job = {
        "params": 1_500_000_000, "flops_per_step": 1e15, "steps": 100, "gpus": 4, "batch": 16,
        "model": {"blocks": 24, "dim": 2048, "seq": 512, "vocab": 32000},
    }  # fmt: skip
    (tmp_path / "snap.json").write_text(json.dumps(snapshot))
    cpn = str(Path(sys.executable).with_name("cpn"))

    def plan(job: dict[str, Any], *extra: str) -> subprocess.CompletedProcess[str]:
        (tmp_path / "job.json").write_text(json.dumps(job))
        args = ["--snapshot", str(tmp_path / "snap.json"), "--job", str(tmp_path / "job.json")]
        return subprocess.run(
            [cpn, "plan", *args, *extra], capture_output=True, text=True, timeout=60, check=False
        )

    r = plan(job, "--json")
    assert r.returncode == 0, r.stderr
    par = json.loads(r.stdout)["parallelism"]
    assert par["mode"] == "pipeline" and par["requested"] == "auto"
    assert len(par["stages"]) >= 2 and par["micro_batches"] >= 1
    assert all(st["memory_gb"] <= st["gpu_gb"] for st in par["stages"])
    assert "more than the largest" in par["reason"]
    est = par["estimate"]  # priced as a pipeline (scheduler.pipeline_cost), not as data parallel
    assert est["step_s"] == pytest.approx(par["step_s"], rel=1e-9)
    assert est["bubble"] == pytest.approx(par["bubble"]) and est["steps"] == 100
    assert est["total_time_s"] == pytest.approx(100 * est["step_s"])
    assert est["cost"] == pytest.approx(len(par["stages"]) * 1.0 * est["total_time_s"] / 3600)
    text = plan(job).stdout
    assert "parallelism: pipeline" in text and "stage 0 on" in text and "bubble" in text
    assert "pipeline estimate: step" in text
    small = json.loads(plan({**job, "params": 1000, "model": None}, "--json").stdout)
    assert small["parallelism"]["mode"] == "data"


# ---- end to end ----------------------------------------------------------------------------


def _serve(tmp_path: Path) -> Any:
    """A real `cpn serve` on SQLite with its own local Ray (2 CPUs), quick heartbeats and
    reconciles, checkpoints under `tmp_path`."""
    from api.processes import start_control_plane

    env = {
        "CPN_HEARTBEAT_INTERVAL_S": "0.5",
        "CPN_LEASE_GRACE_S": "10",
        "CPN_PROBE_INTERVAL_S": "30",
        "CPN_RECONCILE_INTERVAL_S": "0.3",
        "CPN_RAY_NUM_CPUS": "2",
        "CPN_CHECKPOINT_ROOT": str(tmp_path / "checkpoints"),
    }
    return start_control_plane(
        f"sqlite:///{tmp_path / 'cpn.db'}", "cpn_admin_e2e-0123456789abcdef0123456789", settings=env
    )


def _ended(admin: Any, job_id: str, what: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The job once it ends (SUCCEEDED or FAILED, within 240 s) and its events."""
    from api.processes import wait_until

    done = wait_until(
        lambda: (j := admin.get(f"/v1/jobs/{job_id}"))["state"] in {"SUCCEEDED", "FAILED"} and j,
        240,
        what,
    )
    return done, list(admin.paginate(f"/v1/jobs/{job_id}/events"))


@pytest.mark.slow
def test_pipeline_job_end_to_end(tmp_path: Path) -> None:
    """A pipeline job through a real `cpn serve` (its own local Ray) and real agents: two
    stages on two clusters of one GPU each, activations (int8) over an emulated WAN; it runs
    to SUCCEEDED, its report carries the pipeline's figures and its activation bytes are
    metered per link and charged as egress."""
    from api.client import Client
    from api.processes import start_agent, wait_until, write_inventory

    plane = _serve(tmp_path)
    admin = Client(plane.url, plane.admin_token, timeout=60)
    agents = []
    try:
        for name in ("east", "west"):
            admin.create_cluster(name, name)
            admin.post(
                "/v1/pricing/gpu",
                {"cluster": name, "gpu_model": "A100", "qos_class": "standard",
                 "price_per_gpu_hour": 2.0},
            )  # fmt: skip
        admin.declare_link(
            "east", "west", bandwidth_gbps=1.0, rtt_ms=10.0, egress_price_per_gb=0.05
        )
        tenant = admin.post("/v1/tenants", {"name": "acme"})
        client = Client(plane.url, admin.create_api_key("tenant", tenant["id"])["token"])
        for name in ("east", "west"):
            inventory = write_inventory(
                tmp_path / f"{name}.yaml", [{"model": "A100", "memory_gib": 80, "count": 1}]
            )
            token = admin.create_api_key("agent", name)["token"]
            agents.append(start_agent(name, plane.url, token, inventory))
        wait_until(
            lambda: all(c["state"] == "READY" and c["gpus"] for c in admin.clusters()),
            60,
            "clusters READY",
        )
        job = client.post(
            "/v1/jobs",
            {"name": "pipe", "task": "builtin:mnist1d-mlp", "gpus": 2, "steps": 6,
             "parallelism": "pipeline", "compression": "int8",
             "pipeline": {"micro_batches": 2}, "args": {"eval_every": 3}},
        )  # fmt: skip
        done, events = _ended(admin, job["id"], "the pipeline job ends")
        assert done["state"] == "SUCCEEDED", events
        par = done["placement"]["parallel"]
        assert par["mode"] == "pipeline" and sorted(s["cluster"] for s in par["stages"]) == [
            "east",
            "west",
        ]
        assert any("stage workers" in e["message"] for e in events)
        report = next(e for e in events if e.get("to_state") == "SUCCEEDED")["data"]["report"]
        assert report["steps"] == 6 and report["compression"] == "int8"
        for stage in (0, 1):  # every stage saved its own shard of the last step
            shards = tmp_path / "checkpoints" / job["id"] / f"stage-{stage}"
            assert (shards / "step-00000006.pt").is_file()
        sent = report["wan_bytes"]
        assert set(sent) == {"east->west", "west->east"} and all(n > 0 for n in sent.values())
        usage = client.get(f"/v1/tenants/{tenant['id']}/usage")
        metered: dict[str, int] = {}
        for row in usage["rows"]:
            if row["kind"] == "wan_bytes" and row.get("job_id", job["id"]) == job["id"]:
                key = f"{row['cluster']}->{row['dst_cluster']}"
                metered[key] = metered.get(key, 0) + int(float(row["quantity"]))
        assert metered == sent
        assert any(e["kind"] == "egress" for e in client.get(
            f"/v1/tenants/{tenant['id']}/ledger")["items"])  # fmt: skip
    finally:
        for proc in agents:
            proc.stop()
        plane.proc.stop(timeout=60)
        admin.close()


# ---- tensor parallelism and 3D ------------------------------------------------------------


def test_tensor_spec_refusals_name_the_field() -> None:
    """A split needs a parallelism that runs it, whole groups of GPUs, and one cluster."""
    ok = _spec("t", task="builtin:char-gpt", gpus=4, parallelism="tensor", tensor=2)
    assert ok.tensor == 2
    assert _spec("t", task="builtin:char-gpt", gpus=4, parallelism="tensor").tensor is None
    refused: dict[str, dict[str, Any]] = {
        "tensor: splitting layers needs parallelism": {"parallelism": "data", "tensor": 2},
        "tensor: 3 GPUs do not make groups of 2": {
            "gpus": 3,
            "parallelism": "tensor",
            "tensor": 2,
        },
        "pipeline.stages: a tensor job runs the whole model in one cluster": {
            "gpus": 4,
            "parallelism": "tensor",
            "pipeline": {"stages": "2"},
        },
        "pipeline.stages: a pipeline runs one replica of 2 GPUs per stage": {
            "gpus": 2,
            "parallelism": "pipeline",
            "tensor": 2,
            "pipeline": {"stages": "2"},
        },
    }
    for message, kw in refused.items():
        with pytest.raises(ValidationError, match=message):
            _spec("x", task="builtin:char-gpt", **kw)


def test_tensor_job_of_a_task_that_does_not_split_is_refused(net: Net) -> None:
    from controller.jobs.request import job_request
    from controller.values.errors import Invalid

    for task, message in (
        ("builtin:char-transformer", "has no layer that splits over GPUs"),
        ("builtin:char-gpt", "4 attention heads, which do not split over 8 GPUs"),
    ):
        spec = _spec("x", task=task, gpus=8, parallelism="tensor")
        with pytest.raises(Invalid, match=message) as err:
            job_request(spec, "t")
        assert err.value.field == "tensor"
    # a task of the tenant's own: its work's heads, when it declares them
    own: dict[str, Any] = {"task": "mycorp.train:gpt", "gpus": 8, "parallelism": "tensor"}
    facts = {"params": 10**9, "flops_per_step": 1e12, "blocks": 12, "heads": 12}
    with pytest.raises(Invalid, match="12 attention heads, which do not split over 8") as err:
        job_request(_spec("x", **own, work=facts), "t")
    assert err.value.field == "tensor"
    unsaid = {"params": 10**9, "flops_per_step": 1e12}
    job_request(_spec("x", **own, work=unsaid), "t")  # checked where it runs
    # a built-in's heads are its model's, whatever its work says
    stand_in = {**facts, "heads": 8}
    with pytest.raises(Invalid, match="4 attention heads"):
        job_request(_spec("x", task="builtin:char-gpt", gpus=8, parallelism="tensor",
                          work=stand_in), "t")  # fmt: skip
    with pytest.raises(ValidationError, match="give blocks and heads together"):
        Work(params=10**9, flops_per_step=1e12, blocks=12)


@pytest.fixture
def big(db_url: str, tmp_path: Path) -> Iterator[Net]:
    """A 4-GPU cluster and two 2-GPU ones, joined by slow links."""
    n = Net(db_url, tmp_path)
    n.cluster("big", gpus=4, price="2.5")
    n.cluster("east", gpus=2, price="2.0")
    n.cluster("west", gpus=2, price="2.0")
    for a, b in (("big", "east"), ("big", "west"), ("east", "west")):
        n.link(a, b, gbps=0.1, rtt_ms=40.0)
    yield n
    n.close()


def test_tensor_job_splits_its_layers_inside_one_cluster(big: Net) -> None:
    """A tensor job takes one cluster (cheaper GPUs spread over two do not tempt it), its plan
    says how its layers split and what each GPU computes, and the launcher runs that split."""
    job = _placed(big, _spec("tp", task="builtin:char-gpt", gpus=4, parallelism="tensor", tensor=2))
    assert job.placement is not None
    plan = job.placement
    assert [(s.cluster, s.gpus) for s in plan.clusters] == [("big", 4)]
    par = plan.parallel
    assert par.mode == "tensor" and par.tensor == 2
    assert [(s.cluster, s.replicas) for s in par.stages] == [("big", 2)]
    assert "split over 2 GPU(s) of big, 2 data-parallel group(s)" in par.reason
    assert plan.estimate.wan_bytes == 0
    # no split job has finished here: its all-reduces are counted at the prior, and it says so
    assert par.all_reduce_overhead_s == ALL_REDUCE_OVERHEAD_S > 0
    priced = next(line for line in plan.explanation if line.startswith("priced as"))
    assert "all-reduce inside a cluster costs 0.1 ms beyond its bytes (a prior" in priced
    run = _pipeline_of(big, job)
    assert run.placement.stage_clusters == ("big",)
    assert (run.placement.replicas, run.placement.tensor) == (2, 2)
    assert run.train.clusters == {"big": 4}


def test_3d_job_puts_split_stages_on_clusters(big: Net) -> None:
    """pipeline + tensor: a stage replica is a group of `tensor` GPUs of one cluster, and the
    plan is priced for all of them."""
    from controller.values.plan import pipeline_estimate

    spec = _spec(
        "3d",
        task="builtin:char-gpt",
        gpus=4,
        parallelism="pipeline",
        tensor=2,
        preference=["east", "west"],
        qos={"max_clusters": 2},
    )
    job = _placed(big, spec)
    assert job.placement is not None
    par = job.placement.parallel
    assert par.mode == "pipeline" and par.tensor == 2 and len(par.stages) == 2
    assert all(s.replicas == 1 for s in par.stages)
    assert "(3D)" in par.reason
    run = _pipeline_of(big, job)
    assert run.placement.world == 4 and run.placement.tensor == 2
    # priced for every GPU of every group: the same stages unsplit hold half the GPUs
    from controller.network.snapshot import build_world

    with big.sessions() as s:
        world = build_world(s, job.qos_class)
    whole = par.model_copy(update={"tensor": 1})
    shares = job.placement.clusters
    split_est = pipeline_estimate(spec, par, shares, world.snapshot, world.origins, "standard")
    whole_est = pipeline_estimate(spec, whole, shares, world.snapshot, world.origins, "standard")
    assert split_est is not None and whole_est is not None
    assert sum(g.gpus for g in split_est[1].gpu) == 4
    assert sum(g.gpus for g in whole_est[1].gpu) == 2


@pytest.mark.slow
def test_tensor_job_end_to_end(tmp_path: Path) -> None:
    """A tensor job through a real `cpn serve` (its own local Ray) and a real agent: the
    layers of builtin:char-gpt split over a cluster's 2 GPUs, run to SUCCEEDED, its report
    saying the split, its shards whole under the job's root, nothing on the WAN, and its
    GPUs billed."""
    from api.client import Client
    from api.processes import start_agent, wait_until, write_inventory

    plane = _serve(tmp_path)
    admin = Client(plane.url, plane.admin_token, timeout=60)
    agent = None
    try:
        admin.create_cluster("east", "east")
        admin.post(
            "/v1/pricing/gpu",
            {"cluster": "east", "gpu_model": "A100", "qos_class": "standard",
             "price_per_gpu_hour": 2.0},
        )  # fmt: skip
        tenant = admin.post("/v1/tenants", {"name": "acme"})
        client = Client(plane.url, admin.create_api_key("tenant", tenant["id"])["token"])
        inventory = write_inventory(
            tmp_path / "east.yaml", [{"model": "A100", "memory_gib": 80, "count": 2}]
        )
        agent = start_agent("east", plane.url, admin.create_api_key("agent", "east")["token"],
                            inventory)  # fmt: skip
        wait_until(
            lambda: all(c["state"] == "READY" and c["gpus"] for c in admin.clusters()),
            60,
            "cluster READY",
        )
        job = client.post(
            "/v1/jobs",
            {"name": "tp", "task": "builtin:char-gpt", "gpus": 2, "steps": 4,
             "parallelism": "tensor", "args": {"eval_every": 2, "batch_size": 8}},
        )  # fmt: skip
        done, events = _ended(admin, job["id"], "the tensor job ends")
        assert done["state"] == "SUCCEEDED", events
        par = done["placement"]["parallel"]
        assert par["mode"] == "tensor" and par["tensor"] == 2
        assert any("layers split over 2 GPUs" in e["message"] for e in events), events
        report = next(e for e in events if e.get("to_state") == "SUCCEEDED")["data"]["report"]
        assert report["steps"] == 4, report.keys()
        assert not report["wan_bytes"], report
        assert (tmp_path / "checkpoints" / job["id"] / "stage-0" / "step-00000004.pt").is_file()
        usage = client.get(f"/v1/tenants/{tenant['id']}/usage")
        gpu_rows = [r for r in usage["rows"] if r["kind"] == "gpu_seconds"]
        assert gpu_rows and all(r["cluster"] == "east" for r in gpu_rows)
    finally:
        if agent is not None:
            agent.stop()
        plane.proc.stop(timeout=60)
        admin.close()


def test_a_down_clusters_split_stage_moves_with_all_its_gpus(db_url: str, tmp_path: Path) -> None:
    """A 3D job (2 stages, each split over 2 GPUs) on east and west; west goes DOWN. Its
    stage moves to south with both its GPUs, the split stays, west's GPUs are released and
    the relaunch runs the same split stages."""
    net = Net(db_url, tmp_path)
    try:
        _east_west_and_south(net)
        tenant = net.tenant("acme")
        spec = _spec("3d", task="builtin:char-gpt", gpus=4, parallelism="pipeline", tensor=2)
        job_id = net.submit(tenant, spec)
        assert net.place() == [job_id]
        run = net.start(job_id)
        run.on_progress(progress(8, run.clusters, total_steps=20))
        net.launcher.tick()
        job = net.job(job_id)
        assert job.placement is not None and job.placement.parallel.tensor == 2
        assert sorted(s.cluster for s in job.placement.parallel.stages) == ["east", "west"]
        net.lose("west")
        net.launcher.tick()
        moved = net.finish(run, report=report(8, run.clusters, stopped=True))
        assert moved.state is JobState.SCHEDULED and moved.placement is not None
        assert sorted(s.cluster for s in moved.placement.parallel.stages) == ["east", "south"]
        assert moved.placement.parallel.tensor == 2
        assert net.held(job_id) == {"east": 2, "south": 2}
        assert net.books().in_use == {"east": 2, "west": 0, "south": 2}
        stage_run = _pipeline_of(net, moved)
        assert stage_run.placement.tensor == 2 and stage_run.placement.world == 4
        assert stage_run.train.clusters == {"east": 2, "south": 2}
    finally:
        net.close()


def test_cpn_jobs_says_how_a_plan_splits_its_layers() -> None:
    """`cpn jobs show`'s parallelism line: stages in order, replicas, the split's width."""
    from api.cli.jobs import _parallel

    par: dict[str, Any] = {
        "mode": "pipeline",
        "tensor": 2,
        "micro_batches": 4,
        "stages": [{"cluster": "east", "replicas": 1}, {"cluster": "west", "replicas": 1}],
    }
    assert _parallel(par) == "pipeline: east -> west, layers split over 2 GPUs, 4 micro-batches"
    whole = {**par, "tensor": 1, "stages": [{"cluster": "east", "replicas": 2}]}
    assert _parallel(whole) == "pipeline: east (x2 each), 4 micro-batches"
    across = {
        "mode": "hybrid",
        "tensor": 1,
        "micro_batches": 2,
        "stages": [
            {"cluster": "a", "replicas": 2, "replica_clusters": ["a", "c"]},
            {"cluster": "b", "replicas": 2, "replica_clusters": ["b", "d"]},
        ],
    }
    assert _parallel(across) == "hybrid: a -> b | c -> d (2 whole pipelines), 2 micro-batches"


def test_a_whole_pipelines_report_counts_every_replicas_clusters() -> None:
    """The report settlement reads counts each whole pipeline replica's GPUs on its own
    clusters (not every replica on replica 0's)."""
    from training.pipeline import PipelineSpec
    from training.pipeline.split import Placement
    from training.spec import TrainSpec

    placement = Placement(("a", "b"), 2, pipelines=(("a", "b"), ("c", "d")))
    run = PipelineSpec(TrainSpec(task=TASK, clusters=placement.workers(), steps=4), placement)
    final = PipelineReport(
        task=TASK, parallel="hybrid", stage_clusters=["a", "b"], replicas=2, cuts=[2],
        micro_batches=2, schedule="gpipe", activations="none", steps=4, final_loss=0.2,
        final_accuracy=0.5, wall_s=1.0, stage_compute_s=[0.1, 0.2], stage_wait_s=[0.05, 0.05],
        stage_params=[1000, 1000], activation_bytes=WanBytes({("a", "c"): 8000}),
        compression_ratio=1.0, bubble_fraction=0.2, measured_bubble=0.3, wan_emulated=True,
        pipelines=[["a", "b"], ["c", "d"]],
    )  # fmt: skip
    out = report_of(run, final)
    assert out.clusters == {"a": 1, "b": 1, "c": 1, "d": 1}
    assert out.sync_stats["whole_pipelines"] == 1.0
    inside = report_of(run, replace(final, pipelines=[]))
    assert inside.clusters == {"a": 2, "b": 2} and inside.sync_stats["whole_pipelines"] == 0.0
