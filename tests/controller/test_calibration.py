"""What the cost model learns from finished jobs: the per-step overhead it missed, read from
jobs and their metrics in a real database (SQLite and PostgreSQL), and how estimates use it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.orm import Session

import scheduler
from controller.network.snapshot import Calibration, calibration, step_overhead
from controller.store.db import make_engine
from controller.store.models import Job, JobEvent, JobMetric, StepObservation, Tenant, utcnow
from tests.controller.world import TASK, Net
from tests.scheduler.builders import cluster, job, link
from training import Progress
from wire.plan import JobPlan, Parallel, PlanEstimate, Share, StageShare
from wire.spec import JobSpec


def _finished(
    session: Session,
    tenant: Tenant,
    n: int,
    *,
    gpus: int,
    est: dict[str, float],
    step_s: float,
    compute_per_step: float,
    clusters: tuple[str, ...] = ("a",),
) -> None:
    steps = 100
    j = Job(
        tenant_id=tenant.id,
        name=f"j{n}",
        spec={},
        state="SUCCEEDED",
        gpus_min=gpus,
        gpus_max=gpus,
        placement=JobPlan(
            clusters=tuple(Share(cluster=c, gpus=gpus // len(clusters)) for c in clusters),
            compression="none",
            sync="every-step",
            estimate=PlanEstimate(total_time_s=1.0, wan_bytes=0, **est),
        ),
        finished_at=utcnow() - timedelta(minutes=n),
    )
    session.add(j)
    session.flush()
    for step in (50, steps):  # only the last report counts
        session.add(
            JobMetric(
                job_id=j.id,
                step=step,
                step_time_s=step_s if step == steps else 99.0,
                compute_time_s=compute_per_step * step,
            )
        )


def test_step_overhead_is_the_median_residual_of_finished_jobs(db_url: str) -> None:
    with _books(db_url) as (session, tenant):
        assert step_overhead(session) == (0.0, 0.0)  # nothing observed yet
        est: dict[str, Any] = {"step_time_s": 0.003, "compute_s": 0.001}
        # residuals: 0.020 - 0.004 - 0.002 = 0.014; 0.010 - 0.004 - 0.002 = 0.004; and a
        # job estimated with an overhead of 0.005 already: 0.030 - 0.004 - (0.008 - 0.001
        # - 0.005) = 0.024. The median is 0.014.
        _finished(session, tenant, 1, gpus=4, est=est, step_s=0.020, compute_per_step=0.004)
        _finished(session, tenant, 2, gpus=4, est=est, step_s=0.010, compute_per_step=0.004)
        with_overhead = {"step_time_s": 0.008, "compute_s": 0.001, "step_overhead_s": 0.005}
        _finished(
            session, tenant, 3, gpus=2, est=with_overhead, step_s=0.030, compute_per_step=0.004
        )
        # a single worker waits on nobody: not a sample
        _finished(session, tenant, 4, gpus=1, est=est, step_s=9.0, compute_per_step=0.004)
        session.flush()
        assert step_overhead(session) == pytest.approx((0.0, 0.014))  # all on one cluster
        # across clusters, apart: what their exchanges' runtime adds is no one cluster's
        for n, step_s in ((5, 0.055), (6, 0.075)):
            _finished(session, tenant, n, gpus=4, est=est, step_s=step_s,
                      compute_per_step=0.004, clusters=("a", "b"))  # fmt: skip
        session.flush()
        assert step_overhead(session) == pytest.approx((0.059, 0.014))


def test_fit_and_estimates_use_the_overhead_for_multi_worker_placements() -> None:
    assert scheduler.fit_step_overhead([]) == 0.0
    assert scheduler.fit_step_overhead([-1.0, -2.0]) == 0.0  # faster than modelled: no credit
    assert scheduler.fit_step_overhead([0.01, float("nan"), 0.03, 5.0]) == pytest.approx(0.03)
    with pytest.raises(ValueError, match="step_overhead_s"):
        scheduler.Snapshot((), step_overhead_s=-1.0)
    plain = scheduler.Snapshot((cluster("a", 8), cluster("b", 8)), (link("a", "b", 1.0, 10.0),))
    with pytest.raises(ValueError, match="local_step_overhead_s"):
        scheduler.Snapshot((), local_step_overhead_s=-1.0)
    slow = scheduler.Snapshot(
        plain.clusters, plain.links, step_overhead_s=0.25, local_step_overhead_s=0.1
    )
    for gpus, extra in ((1, 0.0), (4, 0.1), (12, 0.25)):  # one worker, one cluster, two
        base = scheduler.estimate(plain, job(gpus), _placement(gpus), "none", "every-step")
        more = scheduler.estimate(slow, job(gpus), _placement(gpus), "none", "every-step")
        assert more.step_overhead_s == extra
        assert more.step_time_s == pytest.approx(base.step_time_s + extra)


def _placement(gpus: int) -> tuple[scheduler.Assignment, ...]:
    if gpus <= 8:
        return (scheduler.Assignment("a", gpus),)
    return (scheduler.Assignment("a", 8), scheduler.Assignment("b", gpus - 8))


@contextmanager
def _books(db_url: str) -> Iterator[tuple[Session, Tenant]]:
    """A session on `db_url` in one transaction, and a tenant whose jobs it holds."""
    engine = make_engine(db_url)
    try:
        with Session(engine) as session, session.begin():
            tenant = Tenant(name="t")
            session.add(tenant)
            session.flush()
            yield session, tenant
    finally:
        engine.dispose()


def _ran(
    session: Session,
    tenant: Tenant,
    name: str,
    *,
    cluster: str,
    gpus: int,
    wall_s: float,
    attempts: int = 0,
    estimated_s: float = 10.0,
    hosts: int | None = None,
    host_cores: int | None = None,
) -> str:
    """A finished run of 100 steps at 0.1 s each that took `wall_s` RUNNING to SUCCEEDED
    (its report saying on how many Ray nodes its workers ran, where `hosts` is given, and
    that machine's cores, where `host_cores` is)."""
    end = utcnow()
    j = Job(
        tenant_id=tenant.id,
        name=name,
        spec={},
        state="SUCCEEDED",
        gpus_min=gpus,
        gpus_max=gpus,
        attempts=attempts,
        placement=JobPlan(
            clusters=(Share(cluster=cluster, gpus=gpus),),
            compression="none",
            sync="every-step",
            estimate=PlanEstimate(step_time_s=0.1, total_time_s=estimated_s, wan_bytes=0),
        ),
        started_at=end - timedelta(seconds=wall_s),
        finished_at=end,
    )
    session.add(j)
    session.flush()
    session.add(JobMetric(job_id=j.id, step=100, step_time_s=0.1, compute_time_s=5.0))
    if hosts is not None:
        report: dict[str, int] = {"steps": 100, "hosts": hosts}
        if host_cores is not None:
            report["host_cores"] = host_cores
        session.add(
            JobEvent(job_id=j.id, kind="state", to_state="SUCCEEDED", data={"report": report})
        )
    return j.id


def test_set_up_time_is_fitted_per_cluster_from_finished_runs(db_url: str) -> None:
    """A run's time outside its steps (launch, set-up, evaluation, the drain): its wall time
    RUNNING to SUCCEEDED less its steps at their observed step time; the prior until a run
    is seen; per cluster where runs used it; a run that restarted is no sample."""
    from controller.network.snapshot import SETUP_PRIOR_S, observed

    with _books(db_url) as (session, tenant):
        assert observed(session).setup_s == SETUP_PRIOR_S
        # 100 steps of 0.1 s: 10 s of steps; walls 22 s and 14 s on a, 40 s on b
        for n, (where, wall, tries) in enumerate(
            [("a", 22.0, 1), ("a", 14.0, 1), ("b", 40.0, 1), ("b", 500.0, 2)]
        ):
            _ran(session, tenant, f"j{n}", cluster=where, gpus=1, wall_s=wall, attempts=tries)
        session.flush()
        seen = observed(session)
        assert seen.setup_s == pytest.approx(12.0)  # median of 12, 4, 30
        assert dict(seen.setup_by_cluster) == pytest.approx({"a": 8.0, "b": 30.0})
        # the runs took 2.2, 1.4 and 4.0 times their estimate: a quote's range is its
        # estimate times (1, the 90th percentile), the estimate itself kept inside
        assert seen.spread == pytest.approx((1.0, 3.64))


def test_the_set_up_is_in_every_estimate_and_its_price() -> None:
    snap = scheduler.Snapshot((cluster("a", 4, setup_s=20.0),), setup_s=5.0)
    j = job(4, flops_per_step=1e12, steps=10)
    got = scheduler.plan(snap, j, "time")
    assert isinstance(got, scheduler.Plan)
    est = got.estimate
    assert est.setup_s == 20.0  # the cluster's own, not the snapshot's default
    assert est.total_time_range_s == (est.total_time_s, est.total_time_s)  # no spread seen
    wide = scheduler.plan(replace(snap, spread=(0.5, 2.0)), j, "time")
    assert isinstance(wide, scheduler.Plan)
    lo, hi = wide.estimate.total_time_range_s
    assert lo == pytest.approx(0.5 * est.total_time_s) and hi == pytest.approx(2 * lo * 2)
    assert est.total_time_s == pytest.approx(20.0 + 10 * est.step_time_s)
    assert est.cost == pytest.approx(4 * 2.0 * est.total_time_s / 3600, rel=1e-6)


def test_set_up_that_grows_with_the_workers_is_fitted_per_gpu(db_url: str) -> None:
    """Where the workers start on a few cores one after another (this machine), set-up grows
    with the run's GPUs: the fit keeps a per-GPU part and the rest per cluster."""
    from controller.network.snapshot import observed

    with _books(db_url) as (session, tenant):
        for n, gpus in enumerate((2, 4, 6)):
            wall = 10.0 + 1.0 + 2.5 * gpus
            _ran(session, tenant, f"g{n}", cluster="a", gpus=gpus, wall_s=wall, estimated_s=1.0)
        session.flush()
        seen = observed(session)
        assert seen.setup_per_gpu_s == pytest.approx(2.5)
        assert seen.setup_s == pytest.approx(1.0)
        assert dict(seen.setup_by_cluster) == pytest.approx({"a": 1.0})


def test_one_cold_start_does_not_set_the_set_up_a_gpu(db_url: str) -> None:
    """The first run after the control plane's Ray started set up in twice the time its
    GPUs took in the runs after it (bench/results/promise.md): the slope is the median of the
    runs' pairwise slopes, which it does not move as it moved a least-squares line."""
    from controller.network.snapshot import observed

    with _books(db_url) as (session, tenant):
        for n, (gpus, setup) in enumerate(((6, 25.9), (2, 4.5), (6, 13.1), (6, 12.9), (8, 17.5))):
            _ran(session, tenant, f"r{n}", cluster="a", gpus=gpus, wall_s=10.0 + setup,
                 estimated_s=1.0)  # fmt: skip
        session.flush()
        seen = observed(session)
    assert seen.setup_per_gpu_s == pytest.approx(2.17, abs=0.01)  # least squares: 2.43


@pytest.mark.parametrize(
    ("hosts", "per_gpu", "base"), [(1, 2.0, 0.0), (2, 0.0, 12.0), (None, 0.0, 12.0)]
)
def test_one_runs_set_up_on_one_host_is_counted_a_gpu(
    db_url: str, hosts: int | None, per_gpu: float, base: float
) -> None:
    """One finished run of 6 GPUs whose set-up took 12 s: too few for a slope, so where its
    workers ran on one Ray node (they start on its cores one after another) all of it is
    counted per GPU, and a 2-GPU job is planned 4 s of set-up; on several nodes, or where
    the report does not say, it is fixed (12 s whatever the GPUs)."""
    from controller.network.snapshot import observed

    with _books(db_url) as (session, tenant):
        _ran(session, tenant, "six", cluster="a", gpus=6, wall_s=22.0, hosts=hosts)
        session.flush()
        seen = observed(session)
        assert seen.setup_per_gpu_s == pytest.approx(per_gpu)
        assert seen.setup_s == pytest.approx(base)
        snap = scheduler.Snapshot(
            (cluster("a", 2, setup_s=dict(seen.setup_by_cluster)["a"]),),
            setup_s=seen.setup_s,
            setup_per_gpu_s=seen.setup_per_gpu_s,
        )
        assert scheduler.setup_of(snap, ["a"], 2) == pytest.approx(base + 2 * per_gpu)


def test_a_run_is_measured_only_where_it_trained_on_its_planned_split() -> None:
    """Compute per step is written down for each cluster between two reports of the same
    members that all trained; not across a join, nor while a newcomer sat out a round (its
    state on its way: the others trained on a split without it), nor across a restart."""
    from dataclasses import replace as with_

    from controller.loop.progress import observations
    from controller.loop.runs import RunHandle
    from tests.controller.world import progress

    handle = RunHandle(
        job_id="j",
        clusters={"a": 1, "b": 1, "c": 2},
        gpu_models={"a": "H100", "b": "A100", "c": "A100"},
        flops_per_step=1e12,
        predicted_step_s=None,
        batch_shares={"a": 0.5, "b": 0.25, "c": 0.25},
    )

    def at(step: int, **compute: float) -> Progress:
        return with_(progress(step, dict.fromkeys(compute, 1)), compute_by_cluster=compute)

    got = observations(handle, at(20, a=2.0, b=4.0), (10, {"a": 1.0, "b": 2.0}))
    assert {o.gpu_model: (o.compute_s, o.flops) for o in got} == {
        "H100": (0.1, 1e12 * 0.5 / 0.75),
        "A100": (0.2, 1e12 * 0.25 / 0.75),
    }
    joined = at(30, a=3.0, b=6.0, c=0.0)  # c joined: it sits out while its state crosses
    assert observations(handle, joined, (20, {"a": 2.0, "b": 4.0})) == []
    sat_out = at(40, a=4.0, b=8.0, c=0.0)
    assert observations(handle, sat_out, (30, joined.compute_by_cluster)) == []
    trained = at(50, a=5.0, b=10.0, c=1.0)
    assert len(observations(handle, trained, (40, sat_out.compute_by_cluster))) == 3
    restarted = at(60, a=0.5, b=1.0, c=0.1)  # a new group's counters start again
    assert observations(handle, restarted, (50, trained.compute_by_cluster)) == []


def _store(
    session: Session,
    tenant: Tenant,
    name: str,
    n: int,
    plan: JobPlan,
    step_s: float,
    compute: float,
) -> None:
    """A job finished `n` minutes ago on `plan`, its last report at step 100 (`step_s` a step,
    `compute` seconds of compute in all)."""
    j = Job(
        tenant_id=tenant.id,
        name=name,
        spec={},
        state="SUCCEEDED",
        gpus_min=plan.gpus,
        gpus_max=plan.gpus,
        placement=plan,
        finished_at=utcnow() - timedelta(minutes=n),
    )
    session.add(j)
    session.flush()
    session.add(JobMetric(job_id=j.id, step=100, step_time_s=step_s, compute_time_s=compute))


def _pipelined(
    session: Session, tenant: Tenant, n: int, *, est_step_s: float, used: float, step_s: float
) -> None:
    """A finished 2-stage pipeline job of 4 micro-batches (5 slots a step), estimated at
    `est_step_s` a step with a micro-batch cost of `used`, measured at `step_s`."""
    plan = JobPlan(
        clusters=(Share(cluster="a", gpus=1), Share(cluster="b", gpus=1)),
        compression="none",
        sync="every-step",
        parallel=Parallel(
            mode="pipeline",
            stages=(StageShare(cluster="a"), StageShare(cluster="b")),
            micro_batches=4,
            micro_overhead_s=used,
        ),
        estimate=PlanEstimate(
            total_time_s=1.0, wan_bytes=0, step_time_s=est_step_s, compute_s=est_step_s
        ),
    )
    _store(session, tenant, f"p{n}", n, plan, step_s, 1.0)


def test_a_micro_batchs_cost_is_fitted_from_finished_pipelines_alone(db_url: str) -> None:
    """The slot a pipeline's step is made of, measured against the slot its estimate gave
    without the micro-batch cost it counted: the median over finished pipelines (the prior
    before any), never below 0. Pipelines stay out of the data-parallel step overhead."""
    from controller.network.snapshot import observed
    from scheduler.pipeline_cost import MICRO_BATCH_OVERHEAD_S

    with _books(db_url) as (session, tenant):
        assert observed(session).micro_overhead_s == MICRO_BATCH_OVERHEAD_S
        # slots of 0.1 s planned, 0.005 of them the cost counted: 0.095 without it;
        # measured 0.2 and 0.12 a slot: 0.105 and 0.025, median 0.065
        _pipelined(session, tenant, 1, est_step_s=0.5, used=0.005, step_s=1.0)
        _pipelined(session, tenant, 2, est_step_s=0.5, used=0.005, step_s=0.6)
        session.flush()
        seen = observed(session)
        assert seen.micro_overhead_s == pytest.approx(0.065)
        assert seen.step_overhead_s == 0.0  # no data-parallel job ran
        _pipelined(session, tenant, 3, est_step_s=0.5, used=0.0, step_s=0.1)
        _pipelined(session, tenant, 4, est_step_s=0.5, used=0.0, step_s=0.1)
        _pipelined(session, tenant, 5, est_step_s=0.5, used=0.0, step_s=0.1)
        session.flush()
        assert observed(session).micro_overhead_s == 0.0  # faster than planned: no credit


def _split_job(
    session: Session, tenant: Tenant, n: int, *, stages: int, est: float, step_s: float
) -> None:
    """A finished job whose layers split over 2 GPUs a stage, 16 all-reduces a step counted
    at 1 ms each, estimated at `est` a step, measured at `step_s`."""
    plan = JobPlan(
        clusters=(Share(cluster="a", gpus=2 * stages),),
        compression="none",
        sync="every-step",
        parallel=Parallel(
            mode="tensor" if stages == 1 else "pipeline",
            stages=tuple(StageShare(cluster="a") for _ in range(stages)),
            tensor=2,
            micro_batches=2,
            micro_overhead_s=0.005,
            all_reduce_overhead_s=0.001,
            all_reduces=16,
        ),
        estimate=PlanEstimate(total_time_s=1.0, wan_bytes=0, step_time_s=est, compute_s=est),
    )
    _store(session, tenant, f"t{n}", n, plan, step_s, 1.0)


def test_a_splits_all_reduce_cost_is_fitted_from_one_stage_split_runs(db_url: str) -> None:
    """A one-stage split's step over its estimate, spread over its all-reduces, plus what the
    estimate counted for each: the median (the prior before any, and said to be one). Split
    runs stay out of the micro-batch fit, and a split pipeline (3D) out of both: two unknowns
    in one number."""
    from controller.network.snapshot import observed
    from scheduler.pipeline_cost import ALL_REDUCE_OVERHEAD_S, MICRO_BATCH_OVERHEAD_S

    with _books(db_url) as (session, tenant):
        before = observed(session)
        assert before.all_reduce_overhead_s == ALL_REDUCE_OVERHEAD_S > 0
        assert before.priors == {"micro_overhead_s", "all_reduce_overhead_s", "ps_push_s"}
        # 0.16 s over the estimate in 16 all-reduces: 10 ms more each, 11 ms in all
        _split_job(session, tenant, 1, stages=1, est=0.1, step_s=0.26)
        _split_job(session, tenant, 2, stages=2, est=0.1, step_s=9.0)  # 3D: not fitted
        session.flush()
        seen = observed(session)
        assert seen.all_reduce_overhead_s == pytest.approx(0.011)
        assert seen.micro_overhead_s == MICRO_BATCH_OVERHEAD_S  # nothing fitted it
        assert seen.priors == {"micro_overhead_s", "ps_push_s"}


def _ps_job(session: Session, tenant: Tenant, n: int, *, est: float, step_s: float) -> None:
    """A finished async-ps job on two clusters, planned at `est` a tick with a push counted
    at 2 ms, measured at `step_s`."""
    plan = JobPlan(
        clusters=(Share(cluster="a", gpus=1), Share(cluster="b", gpus=1)),
        compression="none",
        sync="async-ps:4",
        estimate=PlanEstimate(
            total_time_s=1.0,
            wan_bytes=0,
            step_time_s=est,
            compute_s=0.001,
            ps_push_s=0.002,
        ),
    )
    _store(session, tenant, f"ps{n}", n, plan, step_s, 0.1)


def test_an_async_ps_push_cost_is_fitted_from_async_ps_runs_alone(db_url: str) -> None:
    """An async-ps job's tick over its estimate, plus the push cost it counted: the median
    (the prior before any, and said to be one); its pushes stay out of the fleet's step
    overhead, which every other mode pays."""
    from controller.network.snapshot import PS_PUSH_PRIOR_S, observed

    with _books(db_url) as (session, tenant):
        before = observed(session)
        assert before.ps_push_s == PS_PUSH_PRIOR_S > 0 and "ps_push_s" in before.priors
        _ps_job(session, tenant, 1, est=0.010, step_s=0.045)  # 35 ms more: 37 ms a push
        _ps_job(session, tenant, 2, est=0.010, step_s=0.047)
        _ps_job(session, tenant, 3, est=0.010, step_s=0.049)
        session.flush()
        seen = observed(session)
        assert seen.ps_push_s == pytest.approx(0.039)
        assert "ps_push_s" not in seen.priors
        assert seen.step_overhead_s == 0.0  # no other multi-worker job ran


def test_a_pipeline_takes_fewer_micro_batches_where_each_costs_more() -> None:
    """`best_micro_batches`: with no fixed cost the bubble decides (the most micro-batches);
    as each costs more, fewer; the estimate counts the cost in every slot."""
    from scheduler.pipeline_cost import StageWork, best_micro_batches, estimate_pipeline

    clusters = {"a": cluster("a", 8), "b": cluster("b", 8)}
    links = {("a", "b"): link("a", "b", 10.0, 1.0)}
    loads = [("a", 0.4, 0.0, 1), ("b", 0.4, 0.0, 1)]  # 0.4 s a step a stage, no activations
    picks = [best_micro_batches(loads, clusters, links, 64, c) for c in (0.0, 0.005, 0.05, 1.0)]
    assert picks[0] == 64 and picks[-1] == 1
    assert picks == sorted(picks, reverse=True) and len(set(picks)) > 2
    work = [StageWork("a", 0.1, 0.0), StageWork("b", 0.1, 0.0)]
    plain = estimate_pipeline(work, clusters, links, 4, 1)
    costly = estimate_pipeline(work, clusters, links, 4, 1, micro_overhead_s=0.02)
    assert costly.step_s == pytest.approx(plain.step_s + 5 * 0.02)
    with pytest.raises(ValueError, match="micro_overhead_s"):
        estimate_pipeline(work, clusters, links, 4, 1, micro_overhead_s=-1.0)


def test_a_quote_plans_with_the_efficiency_the_placement_plans_with(
    db_url: str, tmp_path: Path
) -> None:
    """A quote is priced on the GPU efficiency the jobs' compute steps show, as the
    controller's placement is (`calibrated_efficiency`): a quote priced on the datasheet was
    held to a run its placement timed otherwise (bench/results/promise.md's one-cluster job:
    no compute in its held estimate, after a run had shown this machine's)."""
    net = Net(db_url, tmp_path / "checkpoints")
    try:
        net.cluster("a", gpus=2, model="A100")
        tenant = net.tenant("acme")
        spec = JobSpec(name="q", task=TASK, gpus=2, steps=100, compression="none",
                       sync="every-step")  # fmt: skip
        before = net.quote(tenant, spec)["time"].estimate
        done = net.submit(tenant, spec)
        with net.sessions() as s, s.begin():  # a run showed the A100s at 1 % of their peak
            peak = scheduler.peak_tflops("A100")
            assert peak is not None
            slow = 1e12 / (peak * 1e12 * 0.01)
            s.add(StepObservation(job_id=done, gpu_model="A100", gpus=1, flops=1e12,
                                  compute_s=slow, predicted_s=None))  # fmt: skip
        with net.sessions() as s:
            assert calibration(s).for_task(TASK) == pytest.approx({"A100": 0.01, "*": 0.01})
        after = net.quote(tenant, spec)["time"].estimate
    finally:
        net.close()
    assert before.compute_s is not None and after.compute_s is not None
    assert after.compute_s == pytest.approx(before.compute_s * scheduler.DEFAULT_EFFICIENCY / 0.01)
    assert after.total_time_s > before.total_time_s


def test_each_task_plans_with_its_own_fit_where_it_ran(db_url: str, tmp_path: Path) -> None:
    """A step's share of peak depends on its work as much as on its GPU: a task that ran on a
    model plans with its own fit of it, the fleet's scaled by its speed against the fleet's
    of the models it never ran on, and a task never seen with the fleet's."""
    net = Net(db_url, tmp_path / "checkpoints")
    try:
        net.cluster("a", gpus=2, model="A100")
        tenant = net.tenant("acme")
        peak = {m: scheduler.peak_tflops(m) for m in ("A100", "L4")}
        ran = []
        for task, model, eff in (("builtin:mnist1d-mlp", "A100", 0.01), ("builtin:mnist1d-cnn",
                                 "A100", 0.04), ("builtin:mnist1d-mlp", "L4", 0.02)):  # fmt: skip
            job_id = net.submit(tenant, JobSpec(name="r", task=task, gpus=2, steps=10))
            ran.append(job_id)
            top = peak[model]
            assert top is not None
            with net.sessions() as s, s.begin():
                s.add(StepObservation(job_id=job_id, gpu_model=model, gpus=1, flops=1e12,
                                      compute_s=1 / (top * eff), predicted_s=None))  # fmt: skip
        with net.sessions() as s:
            cal = calibration(s)
    finally:
        net.close()
    mlp = cal.for_task("builtin:mnist1d-mlp")
    cnn = cal.for_task("builtin:mnist1d-cnn")
    other = cal.for_task("builtin:char-gpt")
    assert mlp is not None and cnn is not None and other is not None
    assert mlp["A100"] == pytest.approx(0.01) and mlp["L4"] == pytest.approx(0.02)
    assert cnn["A100"] == pytest.approx(0.04)  # its own, not the fleet's mean
    # never ran on L4: the fleet's, times how much faster than the fleet it ran on A100
    assert cnn["L4"] == pytest.approx(cal.fleet["L4"] * 0.04 / cal.fleet["A100"])
    assert cnn["L4"] > mlp["L4"]
    assert other == cal.fleet and 0.01 < cal.fleet["A100"] < 0.04
    assert Calibration().for_task("builtin:mnist1d-mlp") is None  # no observation: the priors


@pytest.mark.parametrize(("hosts", "cores"), [(1, 2), (2, 0)])
def test_workers_that_shared_a_machines_cores_are_fitted_as_if_each_had_its_own(
    db_url: str, hosts: int, cores: int
) -> None:
    """On the embedded default every GPU is a CPU worker slot of one machine: 6 workers on
    its 2 cores computed each step 3 times as long as 2 workers did, at the same work each.
    The fit divides that out (one efficiency from both runs) and the snapshot names the
    machine's cores, so a plan multiplies it back for its own workers. Where the workers ran
    on several machines their steps are taken as they came."""
    from controller.network.snapshot import observed

    peak = scheduler.peak_tflops("A100")
    assert peak is not None
    with _books(db_url) as (session, tenant):
        for name, gpus in (("six", 6), ("two", 2)):
            job_id = _ran(session, tenant, name, cluster="a", gpus=gpus, wall_s=20.0,
                          hosts=hosts, host_cores=2)  # fmt: skip
            took = scheduler.crowding(gpus, 2) / (peak * 0.01)  # as a shared machine ran it
            session.add(StepObservation(job_id=job_id, gpu_model="A100", gpus=1, flops=1e12,
                                        compute_s=took, predicted_s=None))  # fmt: skip
        session.flush()
        assert observed(session).host_cores == cores
        fit = calibration(session).fleet["A100"]
    if cores:
        assert fit == pytest.approx(0.01)
    else:  # the least-squares fit of 1 and 3 times: slower than either alone would say
        assert fit == pytest.approx(0.01 * 2 / (1 + 3))


def test_a_plan_says_when_its_workers_share_one_machines_cores() -> None:
    """The plan names the crowding it planned with, so a user comparing its step with a
    GPU's datasheet sees why: 6 workers on 2 cores, each step at 3x its compute."""
    from controller.values.plan import plan_of

    for cores, says in ((2, True), (0, False)):
        snap = scheduler.Snapshot((cluster("a", 6),), host_cores=cores)
        result = scheduler.plan(snap, job(6, flops_per_step=1e12, steps=10), "time")
        assert isinstance(result, scheduler.Plan)
        said = plan_of(result, snap, {"a": ("a", "H100")}, "standard").explanation
        line = [x for x in said if "6 workers share one machine's 2 cores" in x and "3x" in x]
        assert bool(line) == says
