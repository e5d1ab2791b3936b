"""The job state machine: every transition is checked here and recorded with its reason."""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from controller.errors import Conflict
from controller.models import Job, JobEvent, utcnow

STATES = ("PENDING", "SCHEDULED", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED", "RESCHEDULING")
TERMINAL = frozenset({"SUCCEEDED", "FAILED", "CANCELLED"})

ALLOWED: dict[str, frozenset[str]] = {
    "PENDING": frozenset({"SCHEDULED", "CANCELLED", "FAILED"}),
    "SCHEDULED": frozenset({"RUNNING", "PENDING", "RESCHEDULING", "CANCELLED", "FAILED"}),
    # RUNNING -> PENDING is preemption: the job is checkpointed and queued again.
    "RUNNING": frozenset({"SUCCEEDED", "FAILED", "CANCELLED", "RESCHEDULING", "PENDING"}),
    "RESCHEDULING": frozenset({"SCHEDULED", "PENDING", "FAILED", "CANCELLED"}),
    "SUCCEEDED": frozenset(),
    "FAILED": frozenset(),
    "CANCELLED": frozenset(),
}


def can_move(from_state: str, to_state: str) -> bool:
    return to_state in ALLOWED.get(from_state, frozenset())


def transition(session: Session, job: Job, to_state: str, reason: str, **data: Any) -> JobEvent:
    """Move `job` to `to_state`, or raise Conflict naming the states and what is allowed."""
    if not can_move(job.state, to_state):
        allowed = ", ".join(sorted(ALLOWED.get(job.state, ()))) or "nothing (it has ended)"
        raise Conflict(
            f"job {job.id} is {job.state} and cannot become {to_state}; from {job.state} it may "
            f"become {allowed}",
            field="state",
        )
    event = JobEvent(
        job_id=job.id,
        kind="state",
        from_state=job.state,
        to_state=to_state,
        message=reason,
        data=data,
    )
    now = utcnow()
    if to_state == "RUNNING" and job.started_at is None:
        job.started_at = now
    if to_state in TERMINAL:
        job.finished_at = now
    job.state = to_state
    job.reason = reason[:512]
    session.add(event)
    return event


def created(session: Session, job: Job, reason: str) -> JobEvent:
    """The first event of every job: it entered PENDING."""
    event = JobEvent(
        job_id=job.id, kind="state", from_state=None, to_state="PENDING", message=reason
    )
    session.add(event)
    return event
