"""Job and cluster states, as every layer names them; the job state machine's table, as data.

Pure: `controller.jobs.lifecycle.transition` is the one function that moves a job and refuses
what this table does not allow. The states are StrEnums, so the stored strings, the REST API
and the events keep the names they always had.

A cluster is PENDING until its agent's first heartbeat; READY while heartbeats arrive; SUSPECT
after a few missed ones (it keeps its work and is still offered new work); DOWN once its
lease's grace expired.
"""

from __future__ import annotations

from enum import StrEnum


class JobState(StrEnum):
    PENDING = "PENDING"
    """Submitted, waiting for a placement (also: preempted, waiting to resume)."""
    SCHEDULED = "SCHEDULED"
    """GPUs reserved on a placement; the owning replica is about to launch it."""
    RUNNING = "RUNNING"
    """Workers are training."""
    RESCHEDULING = "RESCHEDULING"
    """Its run ended early (a cluster went DOWN, an attempt failed); being placed again."""
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"


STATES: tuple[JobState, ...] = tuple(JobState)

TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.PENDING: frozenset({JobState.SCHEDULED, JobState.CANCELLED, JobState.FAILED}),
    JobState.SCHEDULED: frozenset(
        {
            JobState.RUNNING,
            JobState.PENDING,
            JobState.RESCHEDULING,
            JobState.CANCELLED,
            JobState.FAILED,
        }
    ),
    # RUNNING -> PENDING is preemption: the job is checkpointed and queued again.
    JobState.RUNNING: frozenset(
        {
            JobState.SUCCEEDED,
            JobState.FAILED,
            JobState.CANCELLED,
            JobState.RESCHEDULING,
            JobState.PENDING,
        }
    ),
    JobState.RESCHEDULING: frozenset(
        {JobState.SCHEDULED, JobState.PENDING, JobState.FAILED, JobState.CANCELLED}
    ),
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
}
"""Where each state may go. Terminal states go nowhere."""

TERMINAL = frozenset(s for s, nxt in TRANSITIONS.items() if not nxt)
"""SUCCEEDED, FAILED, CANCELLED: the job has ended."""

QUEUED = (JobState.PENDING, JobState.RESCHEDULING)
"""States waiting for a placement: new or preempted jobs, and jobs moving after a failure."""

ACTIVE = (JobState.SCHEDULED, JobState.RUNNING)
"""States that hold GPUs and belong to a replica's launcher."""


def can_move(from_state: JobState | str, to_state: JobState | str) -> bool:
    return JobState(to_state) in TRANSITIONS[JobState(from_state)]


class ClusterState(StrEnum):
    PENDING = "PENDING"
    READY = "READY"
    SUSPECT = "SUSPECT"
    DOWN = "DOWN"


LIVE = (ClusterState.READY, ClusterState.SUSPECT)
"""The states of a cluster whose agent holds a lease: it runs work and is offered new work."""


def job_state_diagram() -> str:
    """The job state machine as a Mermaid state diagram, generated from `TRANSITIONS`: the
    one kept in `controller/jobs/README.md` (a test holds the two equal)."""
    lines = ["stateDiagram-v2", f"    [*] --> {JobState.PENDING.value}"]
    for state in STATES:
        lines += [f"    {state.value} --> {to.value}" for to in STATES if to in TRANSITIONS[state]]
    lines += [f"    {state.value} --> [*]" for state in STATES if state in TERMINAL]
    return "\n".join(lines)
