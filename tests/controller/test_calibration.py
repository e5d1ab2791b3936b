"""What the cost model learns from finished jobs: the per-step overhead it missed, read from
jobs and their metrics in a real database (SQLite and PostgreSQL), and how estimates use it."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy.orm import Session

import scheduler
from controller.network.snapshot import step_overhead
from controller.store.db import make_engine
from controller.store.models import Job, JobMetric, Tenant, utcnow
from tests.scheduler.builders import cluster, job, link
from wire.plan import JobPlan, PlanEstimate, Share


def _finished(
    session: Session,
    tenant: Tenant,
    n: int,
    *,
    gpus: int,
    est: dict[str, float],
    step_s: float,
    compute_per_step: float,
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
            clusters=(Share(cluster="a", gpus=gpus),),
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
    engine = make_engine(db_url)
    try:
        with Session(engine) as session, session.begin():
            assert step_overhead(session) == 0.0  # nothing observed yet
            tenant = Tenant(name="t")
            session.add(tenant)
            session.flush()
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
            assert step_overhead(session) == pytest.approx(0.014)
    finally:
        engine.dispose()


def test_fit_and_estimates_use_the_overhead_for_multi_worker_placements() -> None:
    assert scheduler.fit_step_overhead([]) == 0.0
    assert scheduler.fit_step_overhead([-1.0, -2.0]) == 0.0  # faster than modelled: no credit
    assert scheduler.fit_step_overhead([0.01, float("nan"), 0.03, 5.0]) == pytest.approx(0.03)
    with pytest.raises(ValueError, match="step_overhead_s"):
        scheduler.Snapshot((), step_overhead_s=-1.0)
    plain = scheduler.Snapshot((cluster("a", 8), cluster("b", 8)), (link("a", "b", 1.0, 10.0),))
    slow = scheduler.Snapshot(plain.clusters, plain.links, step_overhead_s=0.25)
    for gpus in (1, 4, 12):  # one worker, one cluster, two clusters
        base = scheduler.estimate(plain, job(gpus), _placement(gpus), "none", "every-step")
        more = scheduler.estimate(slow, job(gpus), _placement(gpus), "none", "every-step")
        extra = 0.0 if gpus == 1 else 0.25
        assert more.step_overhead_s == extra
        assert more.step_time_s == pytest.approx(base.step_time_s + extra)


def _placement(gpus: int) -> tuple[scheduler.Assignment, ...]:
    if gpus <= 8:
        return (scheduler.Assignment("a", gpus),)
    return (scheduler.Assignment("a", 8), scheduler.Assignment("b", gpus - 8))
