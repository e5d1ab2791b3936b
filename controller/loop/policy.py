"""How a run ended and what the controller does about it: a pure policy over typed reasons.

In the manner of Ray Train's FailurePolicy: the launcher records *why* a run stopped as a
`StopReason` (never as text to match later), and `decide` turns that reason and the job's
failed attempts into a `Decision`. `next_state` says which state the decision moves the job
to. No I/O here: the settlement (`controller.loop.settle`) applies the decision in one transaction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from grammar.states import JobState
from scheduler.memory import ModelProfile, memory


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


# ---- a pipeline stage whose cluster went DOWN ---------------------------------------------


@dataclass(frozen=True)
class StageNeed:
    """One stage of a running pipeline: where it is, its replicas (one GPU each) and the
    bytes one of its GPUs holds (`scheduler.memory.memory` of its layers)."""

    cluster: str
    replicas: int
    memory_bytes: float


@dataclass(frozen=True)
class Spare:
    """A cluster that could take stages: its free GPUs and one GPU's usable bytes
    (`scheduler.memory.gpu_memory_bytes`)."""

    cluster: str
    free_gpus: int
    gpu_bytes: float


@dataclass(frozen=True)
class StageReplacement:
    """What to do about a pipeline that lost a cluster: re-place its stages there on other
    clusters and launch again (RESCHEDULING; the run resumes from the stages' consistent
    checkpoint cut, `training.pipeline.checkpoint`), or, when some stage fits nowhere, queue
    the job again (PENDING) until GPUs free up."""

    decision: Decision
    state: JobState
    stages: tuple[str, ...] | None
    """The new cluster of every stage, in pipeline order; None when the job requeues."""
    moved: tuple[int, ...] = ()
    reason: str = ""


def stage_needs(
    profile: ModelProfile,
    cuts: Sequence[int],
    clusters: Sequence[str],
    replicas: int,
    micro_batches: int,
    micro_batch: int,
) -> tuple[StageNeed, ...]:
    """Each stage's need from the memory model: stage s holds layers [cut s-1, cut s) and,
    under 1F1B, at most min(M, S - s) micro-batches of activations in flight."""
    bounds = [0, *cuts, len(profile.layers)]
    s_count = len(clusters)
    if len(bounds) - 1 != s_count:
        raise ValueError(f"stages: {len(cuts)} cut(s) make {len(bounds) - 1} stages, not {s_count}")
    return tuple(
        StageNeed(
            clusters[s],
            replicas,
            memory(
                profile, bounds[s], bounds[s + 1], micro_batch, min(micro_batches, s_count - s)
            ).total,
        )
        for s in range(s_count)
    )


def replace_stages(
    stages: Sequence[StageNeed], down: str, spares: Sequence[Spare]
) -> StageReplacement:
    """Move every stage on `down` to a cluster with free GPUs for its replicas whose GPUs hold
    its memory, in pipeline order. Preferred: a cluster holding a neighbouring stage (the hop
    stays inside one cluster), then one already in the pipeline (no new WAN link), then the
    most free GPUs, then the name. Requeue when any moved stage fits nowhere."""
    free = {s.cluster: s.free_gpus for s in spares if s.cluster != down}
    gpu = {s.cluster: s.gpu_bytes for s in spares}
    placed = [s.cluster for s in stages]
    moved: list[int] = []
    for i, st in enumerate(stages):
        if st.cluster != down:
            continue
        neighbours = {placed[j] for j in (i - 1, i + 1) if 0 <= j < len(placed)} - {down}
        used = set(placed) - {down}
        fits = [
            c for c, n in free.items() if n >= st.replicas and gpu.get(c, 0.0) >= st.memory_bytes
        ]
        if not fits:
            return StageReplacement(
                Decision.RESCHEDULE,
                JobState.PENDING,
                None,
                reason=f"stage {i} ({st.memory_bytes / 1e9:.3g} GB a GPU, {st.replicas} GPU(s))"
                f" fits no cluster left after {down} went down: the job waits in the queue",
            )
        best = min(fits, key=lambda c: (c not in neighbours, c not in used, -free[c], c))
        free[best] -= st.replicas
        placed[i] = best
        moved.append(i)
    if not moved:
        return StageReplacement(
            Decision.RESCHEDULE, JobState.RESCHEDULING, tuple(placed), reason="no stage moved"
        )
    return StageReplacement(
        Decision.RESCHEDULE,
        JobState.RESCHEDULING,
        tuple(placed),
        tuple(moved),
        reason=", ".join(f"stage {i}: {down} -> {placed[i]}" for i in moved)
        + "; the run resumes from the stages' last common checkpoint",
    )
