"""The reconcile loop's placement step: PENDING jobs -> GPUs reserved -> SCHEDULED.

Takes pending jobs in priority order with fair share between tenants, plans each over a fresh
snapshot, and reserves its GPUs in the same transaction as the state change. The job row is
locked with SELECT ... FOR UPDATE SKIP LOCKED, so several replicas on PostgreSQL never place
the same job twice; each GPU reservation is a conditional UPDATE, so they never hand out more
GPUs than a cluster has.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

import scheduler
from controller import lifecycle
from controller.allocations import Slot, reserve
from controller.errors import Conflict, CpnError
from controller.jobs import job_request
from controller.jobspec import JobSpec
from controller.models import Job, utcnow
from controller.snapshot import World, build_world

log = logging.getLogger("cpn.reconcile")

QUEUED = ("PENDING", "RESCHEDULING")
"""States waiting for a placement: new jobs, and jobs moving after a failure."""


@dataclass(frozen=True)
class Placed:
    job_id: str
    placement: dict[str, Any]


def _queue(session: Session) -> tuple[list[scheduler.QueuedJob], dict[str, int], dict[str, int]]:
    rows = session.execute(
        select(Job.id, Job.tenant_id, Job.gpus_min, Job.priority, Job.created_at).where(
            Job.state.in_(QUEUED)
        )
    ).all()
    queue = [
        scheduler.QueuedJob(id=i, tenant=t, gpus=g, priority=p, submitted_at=c.timestamp())
        for i, t, g, p, c in rows
    ]
    if not queue:
        return [], {}, {}
    world = build_world(session, "standard")
    usage = scheduler.tenant_usage(world.snapshot.running)
    return queue, dict(usage), dict(world.snapshot.quotas)


def plan_for(
    world: World,
    job: Job,
    efficiency: Mapping[str, float] | None,
    now: datetime,
) -> scheduler.PlanResult:
    """The held quote's placement when still possible, else the planner's best."""
    spec = JobSpec.model_validate(job.spec)
    request = job_request(spec, job.tenant_id, now)
    if job.held_price:
        held = [scheduler.Assignment(p["cluster"], p["gpus"]) for p in job.held_price["placement"]]
        result = scheduler.evaluate(world.snapshot, request, held, efficiency=efficiency)
        if isinstance(result, scheduler.Plan):
            return result
    objective: scheduler.Objective = (
        "cost-within-deadline" if request.qos.deadline_s is not None else "time"
    )
    return scheduler.plan(world.snapshot, request, objective, efficiency=efficiency)


def place_pending(
    factory: sessionmaker[Session],
    owner: str,
    efficiency: Mapping[str, float] | None = None,
    limit: int = 64,
) -> list[Placed]:
    """One pass over the queue; returns the jobs it placed.

    The world is read once per QoS class and pass, and kept current in memory as this pass
    reserves GPUs; what other replicas reserve meanwhile is caught by the conditional update
    in `reserve`, which turns into a waiting reason, never an over-commitment.
    """
    with factory() as session:
        queue, usage, quotas = _queue(session)
    order = scheduler.order_queue(queue, usage=usage, quotas=quotas)
    held = {q.id: reason for q, reason in order.held}
    placed: list[Placed] = []
    worlds: dict[str, World] = {}
    for queued in order.order[:limit]:
        try:
            result = _place_one(factory, queued.id, owner, efficiency, worlds)
        except CpnError as exc:  # a spec that stopped being valid (e.g. deadline passed)
            _fail(factory, queued.id, exc.detail)
            continue
        if result is not None:
            placed.append(result)
    for job_id, reason in held.items():
        _note(factory, job_id, f"waiting: {reason}")
    return placed


def _place_one(
    factory: sessionmaker[Session],
    job_id: str,
    owner: str,
    efficiency: Mapping[str, float] | None,
    worlds: dict[str, World],
) -> Placed | None:
    now = utcnow()
    with factory() as session, session.begin():
        job = session.scalars(
            select(Job)
            .where(Job.id == job_id, Job.state.in_(QUEUED))
            .with_for_update(skip_locked=True)
        ).first()
        if job is None:
            return None  # another replica has it, or it left PENDING
        world = worlds.get(job.qos_class)
        if world is None:
            world = worlds[job.qos_class] = build_world(session, job.qos_class, now)
        result = plan_for(world, job, efficiency, now)
        if isinstance(result, scheduler.Infeasible):
            reason = f"waiting: {result.reason}"
            if job.reason != reason:
                job.reason = reason[:512]
            return None
        if result.victims:
            _request_preemption(session, job, result.victims)
            return None
        slots = [
            Slot(world.origins[a.cluster][0], world.origins[a.cluster][1], a.gpus)
            for a in result.placement
        ]
        try:
            with session.begin_nested():
                reserve(session, job, slots)
        except Conflict as exc:
            job.reason = f"waiting: {exc.detail}"[:512]
            worlds.clear()  # someone else reserved: read the world again
            return None
        for qos_class, w in list(worlds.items()):
            worlds[qos_class] = w.after(
                job.id, job.tenant_id, job.priority, job.preemptible, result.placement
            )
        placement = plan_record(result, slots)
        job.placement = placement
        job.owner = owner
        job.preempted_by = None
        lifecycle.transition(
            session,
            job,
            "SCHEDULED",
            "placed: " + ", ".join(f"{s.cluster}:{s.gpus}" for s in slots),
            placement=placement,
        )
        return Placed(job.id, placement)


def plan_record(result: scheduler.Plan, slots: list[Slot]) -> dict[str, Any]:
    est = result.estimate
    return {
        "clusters": [
            {"cluster": s.cluster, "gpu_model": s.gpu_model, "gpus": s.gpus} for s in slots
        ],
        "compression": result.compression,
        "sync": result.sync,
        "estimate": {
            "step_time_s": est.step_time_s,
            "total_time_s": est.total_time_s,
            "wan_bytes": est.wan_bytes,
            "cost": est.cost,
            "compute_s": est.compute_s,
            "intra_s": est.intra_s,
            "wan_s": est.wan_s,
            "overhead_s": est.overhead_s,
            "effective_steps": est.effective_steps,
            "ring": list(est.ring),
            "step_overhead_s": est.step_overhead_s,
        },
        "explanation": list(result.explanation),
    }


def _request_preemption(session: Session, job: Job, victims: tuple[str, ...]) -> None:
    """Ask the victims' launchers to checkpoint and stop; the job waits until their GPUs free up."""
    for victim_id in victims:
        victim = session.get(Job, victim_id)
        if victim is None or victim.preempted_by or victim.state not in ("SCHEDULED", "RUNNING"):
            continue
        victim.preempted_by = job.id
        log.info("job %s preempts %s", job.id, victim_id)
    job.reason = f"waiting: preempting {', '.join(victims)}"[:512]


def _note(factory: sessionmaker[Session], job_id: str, reason: str) -> None:
    with factory() as session, session.begin():
        job = session.get(Job, job_id)
        if job is not None and job.state in QUEUED and job.reason != reason:
            job.reason = reason[:512]


def _fail(factory: sessionmaker[Session], job_id: str, reason: str) -> None:
    with factory() as session, session.begin():
        job = session.get(Job, job_id)
        if job is not None and job.state in QUEUED:
            lifecycle.transition(session, job, "FAILED", f"cannot be placed: {reason}")
