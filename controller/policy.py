"""How a run ended and what the controller does about it: a pure policy over typed reasons.

In the manner of Ray Train's FailurePolicy: the launcher records *why* a run stopped as a
`StopReason` (never as text to match later), and `decide` turns that reason and the job's
failed attempts into a `Decision`. `next_state` says which state the decision moves the job
to. No I/O here: the settlement (`controller.settle`) applies the decision in one transaction.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from controller.states import JobState


class StopReason(StrEnum):
    """Why a run stopped."""

    COMPLETED = "completed"
    """The workers ran every step."""
    ERROR = "error"
    """The run raised; another attempt may succeed."""
    INVALID = "invalid"
    """The run raised a ValueError (a task that cannot load, a bad spec): retrying won't help."""
    CANCELLED = "cancelled"
    """A tenant or an admin cancelled the job (it is CANCELLED already)."""
    PREEMPTED = "preempted"
    """A job of higher priority needs the GPUs: checkpoint, queue again, resume later."""
    CLUSTER_DOWN = "cluster-down"
    """A cluster the run used went DOWN: place again on what is left."""
    ADOPTED = "adopted"
    """Another replica owns the job now; it runs and settles there."""
    SUPERSEDED = "superseded"
    """A newer run holds the job's fencing epoch (it was adopted or launched again): this run
    writes nothing more and settles nothing; the newer one does."""
    SHUTDOWN = "shutdown"
    """This controller is stopping; the job stays RUNNING for a live replica to adopt."""
    BUDGET = "budget"
    """The tenant's spend reached its budget: checkpoint, stop, FAILED "budget exhausted"."""


FAILURES = frozenset({StopReason.ERROR, StopReason.INVALID})
"""Stops that count as a failed attempt."""


class Decision(StrEnum):
    DONE = "done"
    """The run is over for good: close it; a completed job SUCCEEDS."""
    RETRY = "retry"
    """The attempt failed: close it and place the job again, resuming from its checkpoint."""
    RESCHEDULE = "reschedule"
    """Not the job's fault (preemption, a lost cluster): close the run, place the job again."""
    FAIL = "fail"
    """The job cannot succeed: close the run, FAILED."""
    LEAVE = "leave"
    """The run is not this replica's to close: leave the job and its GPUs as they are."""


@dataclass(frozen=True)
class Stop:
    """A request to stop a run, with what names the cause (the preempting job, the cluster)."""

    reason: StopReason
    detail: str = ""


def failure(error: BaseException) -> StopReason:
    """INVALID for errors no retry can fix (a ValueError, or one raised from a ValueError)."""
    if isinstance(error, ValueError) or isinstance(error.__cause__, ValueError):
        return StopReason.INVALID
    return StopReason.ERROR


def stop_of(
    requested: StopReason | None,
    error: BaseException | None,
    *,
    job_state: JobState,
    owned: bool,
    current: bool = True,
) -> StopReason:
    """How a run ended, from what was asked of it, what it raised, and the job's row now.

    Precedence: a run whose fencing epoch is not the job's (`current` False) was superseded;
    a job another replica owns is theirs; a cancelled job stays cancelled; an error counts
    before the stop that was asked for; otherwise the request, or COMPLETED.
    """
    if not current:
        return StopReason.SUPERSEDED
    if not owned:
        return StopReason.ADOPTED
    if job_state is JobState.CANCELLED:
        return StopReason.CANCELLED
    if error is not None:
        return failure(error)
    return requested or StopReason.COMPLETED


def decide(stop: StopReason, attempts: int, max_attempts: int) -> Decision:
    """What to do about a run that stopped. `attempts` counts failed attempts, this one
    included when `stop` is a failure."""
    if stop is StopReason.COMPLETED or stop is StopReason.CANCELLED:
        return Decision.DONE
    if stop is StopReason.INVALID or stop is StopReason.BUDGET:
        return Decision.FAIL
    if stop is StopReason.ERROR:
        return Decision.FAIL if attempts >= max_attempts else Decision.RETRY
    if stop is StopReason.PREEMPTED or stop is StopReason.CLUSTER_DOWN:
        return Decision.RESCHEDULE
    return Decision.LEAVE  # ADOPTED, SUPERSEDED, SHUTDOWN


def next_state(stop: StopReason, decision: Decision) -> JobState | None:
    """The state a decision moves the job to; None: it stays where it is.

    A preempted job waits in the queue (PENDING) for GPUs to free up; a job that lost a
    cluster or failed an attempt is placed again at once (RESCHEDULING)."""
    if decision is Decision.DONE:
        return JobState.SUCCEEDED if stop is StopReason.COMPLETED else None
    if decision is Decision.FAIL:
        return JobState.FAILED
    if decision is Decision.RETRY:
        return JobState.RESCHEDULING
    if decision is Decision.RESCHEDULE:
        return JobState.PENDING if stop is StopReason.PREEMPTED else JobState.RESCHEDULING
    return None


def stop_requested(
    *,
    job_state: JobState,
    owned: bool,
    preempted_by: str | None,
    down_cluster: str | None,
    over_budget: str | None = None,
) -> Stop | None:
    """Whether a running job's row now asks its run to stop, and why (first cause wins).

    `over_budget` says how its tenant's spend reached the budget: that ends the job before a
    preemption or a lost cluster would queue it again."""
    if job_state is JobState.CANCELLED:
        return Stop(StopReason.CANCELLED)
    if not owned:
        return Stop(StopReason.ADOPTED)
    if over_budget:
        return Stop(StopReason.BUDGET, over_budget)
    if preempted_by:
        return Stop(StopReason.PREEMPTED, preempted_by)
    if down_cluster:
        return Stop(StopReason.CLUSTER_DOWN, down_cluster)
    return None
