"""The job state machine at work: every state change goes through `transition`, which refuses
what `grammar.states.TRANSITIONS` does not allow and records the change with its reason;
every run ends through `end_run`, which gives the GPUs back and bills them."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import insert, select
from sqlalchemy.orm import Session

from controller.money import budget, sla
from controller.money.metering import (
    cap_at_held,
    meter_allocations,
    meter_minimum_terms,
    price_usage,
    start_billing,
)
from controller.network.allocations import release
from controller.store.models import REASON_MAX, Allocation, Job, JobEvent, bounded, utcnow
from controller.values.errors import Conflict
from grammar.states import (
    ACTIVE,
    QUEUED,
    STATES,
    TERMINAL,
    TRANSITIONS,
    JobState,
    can_move,
)

__all__ = [
    "ACTIVE",
    "QUEUED",
    "STATES",
    "TERMINAL",
    "TRANSITIONS",
    "JobState",
    "can_move",
    "created",
    "end_run",
    "transition",
]


def transition(
    session: Session, job: Job, to_state: JobState | str, reason: str, **data: Any
) -> JobEvent:
    """Move `job` to `to_state`, or raise Conflict naming the states and what is allowed."""
    to = JobState(to_state)
    if not can_move(job.state, to):
        allowed = ", ".join(sorted(TRANSITIONS[JobState(job.state)])) or "nothing (it has ended)"
        raise Conflict(
            f"job {job.id} is {job.state} and cannot become {to}; from {job.state} it may "
            f"become {allowed}",
            field="state",
        )
    event = JobEvent(
        job_id=job.id,
        kind="state",
        from_state=job.state,
        to_state=to,
        message=reason,
        data=data,
    )
    now = utcnow()
    if to is JobState.RUNNING:
        if job.started_at is None:
            job.started_at = now
        start_billing(session, job, now)  # billing runs while the job runs, not while it waits
    if to in TERMINAL:
        job.finished_at = now
    job.state = to
    job.reason = bounded(reason, REASON_MAX)
    session.add(event)
    return event


_INSERT_EVENT = insert(JobEvent)


def created(session: Session, job: Job, reason: str) -> None:
    """The first event of every job: it entered PENDING (`created_many` of one)."""
    created_many(session, [(job, reason)])


def created_many(session: Session, jobs: Sequence[tuple[Job, str]]) -> None:
    """The first event of each job, with the reason it entered PENDING. Written at once, as
    one Core statement (a submission's hot path), so the jobs' rows must be written already."""
    at = utcnow()
    session.connection().execute(
        _INSERT_EVENT,
        [
            {
                "job_id": job.id,
                "at": at,
                "kind": "state",
                "from_state": None,
                "to_state": JobState.PENDING,
                "message": reason,
                "data": {},
            }
            for job, reason in jobs
        ],
    )


def begin_run(session: Session, job: Job, message: str, clusters: dict[str, int]) -> int:
    """A new run of the job starts: returns its fencing epoch (committed with the launch, so
    an older run still alive somewhere has its progress, settlement and checkpoints refused
    from then on). A placed job becomes RUNNING; an adopted one resumes billing."""
    job.fence += 1
    if job.state is JobState.SCHEDULED:
        transition(session, job, JobState.RUNNING, message, clusters=clusters)
    else:
        start_billing(session, job, utcnow())
        session.add(JobEvent(job_id=job.id, kind="info", message=message))
    return job.fence


def leave(session: Session, job: Job, cluster_id: str, message: str) -> int:
    """A cluster left the job's run, which goes on without it (`training.faults`): its GPUs
    and WAN share go back now, once (a second call finds nothing open), billed up to now; the
    job stays RUNNING. Returns the GPUs released."""
    released = release(session, job, None, cluster_id)
    if released:
        session.add(JobEvent(job_id=job.id, kind="warning", message=message))
    return released


def joined(session: Session, job: Job, cluster_id: str, at: datetime, message: str) -> None:
    """A cluster reserved for the job's run joined it at `at`: billed from then on."""
    for alloc in session.scalars(
        select(Allocation).where(
            Allocation.job_id == job.id,
            Allocation.cluster_id == cluster_id,
            Allocation.ended_at.is_(None),
            Allocation.billed_from.is_(None),
        )
    ):
        alloc.billed_from = at
    session.add(JobEvent(job_id=job.id, kind="info", message=message))


def end_run(session: Session, job: Job, until: datetime | None = None) -> None:
    """End the job's run on the books: give its GPUs back, meter what it used, price it, and
    refund what its providers' SLAs promise for a missed promise.

    Every way a run ends calls this (success, failure, retry, cancel, preemption, a cluster
    going DOWN); it is idempotent, so a cancelled job's run that stops later settles again
    without charging twice (and prices the WAN bytes its last reports brought in). `until`:
    when the run's workers stopped (billing ends there, not when the books are written)."""
    budget.unhold(session, job)  # first: the tenant row before any GPU row, as placements do
    release(session, job, until)
    meter_allocations(session, job, until)
    meter_minimum_terms(session, job)  # before the cap: a held quote covers it too
    price_usage(session, job.id)
    cap_at_held(session, job)
    sla.credit_run(session, job)
