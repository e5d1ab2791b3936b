"""The stop policy as pure functions: how a run ended, what to do, where the job goes."""

from __future__ import annotations

import pytest

from controller.loop.policy import (
    FAILURES,
    Decision,
    Spare,
    StageNeed,
    Stop,
    StopReason,
    decide,
    failure,
    next_state,
    replace_stages,
    stage_needs,
    stop_of,
    stop_requested,
)
from grammar.states import JobState

MAX = 3


@pytest.mark.parametrize(
    ("stop", "decision", "state"),
    [
        (StopReason.COMPLETED, Decision.DONE, JobState.SUCCEEDED),
        (StopReason.CANCELLED, Decision.DONE, None),  # already CANCELLED: only close the run
        (StopReason.INVALID, Decision.FAIL, JobState.FAILED),
        (StopReason.ERROR, Decision.RETRY, JobState.RESCHEDULING),
        (StopReason.PREEMPTED, Decision.RESCHEDULE, JobState.PENDING),
        (StopReason.CLUSTER_DOWN, Decision.RESCHEDULE, JobState.RESCHEDULING),
        (StopReason.ADOPTED, Decision.LEAVE, None),
        (StopReason.SHUTDOWN, Decision.LEAVE, None),
    ],
)
def test_each_stop_has_one_decision_and_state(
    stop: StopReason, decision: Decision, state: JobState | None
) -> None:
    assert decide(stop, attempts=1, max_attempts=MAX) is decision
    assert next_state(stop, decision) == state


def test_every_stop_reason_is_decided() -> None:
    for stop in StopReason:
        assert decide(stop, 1, MAX) in Decision


def test_errors_retry_until_the_attempts_run_out() -> None:
    assert [decide(StopReason.ERROR, n, MAX) for n in (1, 2, 3, 4)] == [
        Decision.RETRY,
        Decision.RETRY,
        Decision.FAIL,
        Decision.FAIL,
    ]
    # an invalid task fails at once; preemption and a lost cluster are not the job's fault
    assert decide(StopReason.INVALID, 1, MAX) is Decision.FAIL
    assert decide(StopReason.PREEMPTED, 99, MAX) is Decision.RESCHEDULE
    assert decide(StopReason.CLUSTER_DOWN, 99, MAX) is Decision.RESCHEDULE
    assert {StopReason.ERROR, StopReason.INVALID} == FAILURES


def test_value_errors_are_permanent_failures() -> None:
    assert failure(ValueError("bad task")) is StopReason.INVALID
    wrapped = RuntimeError("worker died")
    wrapped.__cause__ = ValueError("no such module")
    assert failure(wrapped) is StopReason.INVALID
    assert failure(RuntimeError("actor lost")) is StopReason.ERROR


def test_how_a_run_ended_follows_precedence() -> None:
    boom = RuntimeError("boom")
    running = JobState.RUNNING
    # the row belongs to another replica: whatever happened here, it is theirs
    assert stop_of(None, boom, job_state=running, owned=False) is StopReason.ADOPTED
    # a cancelled job stays cancelled even if its workers raised on the way down
    assert stop_of(None, boom, job_state=JobState.CANCELLED, owned=True) is StopReason.CANCELLED
    # an error counts before the stop that was asked for
    assert stop_of(StopReason.PREEMPTED, boom, job_state=running, owned=True) is StopReason.ERROR
    assert (
        stop_of(StopReason.CLUSTER_DOWN, None, job_state=running, owned=True)
        is StopReason.CLUSTER_DOWN
    )
    assert stop_of(None, None, job_state=running, owned=True) is StopReason.COMPLETED


def test_stop_requests_name_their_cause() -> None:
    def ask(**row: object) -> Stop | None:
        base: dict[str, object] = {
            "job_state": JobState.RUNNING,
            "owned": True,
            "preempted_by": None,
            "down_cluster": None,
        }
        return stop_requested(**{**base, **row})  # type: ignore[arg-type]

    assert ask() is None
    assert ask(job_state=JobState.CANCELLED, preempted_by="j2") == Stop(StopReason.CANCELLED)
    assert ask(owned=False) == Stop(StopReason.ADOPTED)
    assert ask(preempted_by="j2", down_cluster="eu") == Stop(StopReason.PREEMPTED, "j2")
    assert ask(down_cluster="eu") == Stop(StopReason.CLUSTER_DOWN, "eu")


# ---- a pipeline stage whose cluster went DOWN ------------------------------------------


def _needs(*where: str, gb: float = 30.0, replicas: int = 1) -> list[StageNeed]:
    return [StageNeed(c, replicas, gb * 1e9) for c in where]


def test_a_down_stage_moves_next_to_its_neighbour_and_the_run_resumes() -> None:
    spares = [Spare("b", 1, 72e9), Spare("c", 4, 72e9), Spare("d", 8, 72e9)]
    got = replace_stages(_needs("a", "b", "c"), "b", spares)
    # c holds the next stage: the hop a->b->c becomes a->c->c, one WAN link fewer
    assert got.stages == ("a", "c", "c") and got.moved == (1,)
    assert (got.decision, got.state) == (Decision.RESCHEDULE, JobState.RESCHEDULING)
    assert "stage 1: b -> c" in got.reason


def test_moved_stages_use_up_free_gpus_and_skip_gpus_too_small() -> None:
    spares = [Spare("x", 1, 72e9), Spare("small", 8, 20e9), Spare("y", 3, 72e9)]
    got = replace_stages(_needs("a", "a", "z"), "a", spares)
    # neither x nor y neighbours stage 0; y has more free GPUs; stage 1 then sits next to it
    assert got.stages == ("y", "y", "z") and got.moved == (0, 1)
    hybrid = replace_stages(_needs("a", "z", replicas=2), "a", spares)
    assert hybrid.stages == ("y", "z")  # x has 1 GPU: not enough for 2 replicas


def test_no_cluster_fits_the_stage_so_the_job_requeues() -> None:
    got = replace_stages(_needs("a", "b", gb=50.0), "a", [Spare("b", 4, 40e9), Spare("c", 0, 80e9)])
    assert got.stages is None
    assert (got.decision, got.state) == (Decision.RESCHEDULE, JobState.PENDING)
    assert "stage 0" in got.reason and "queue" in got.reason
    assert replace_stages(_needs("a"), "a", [Spare("a", 8, 80e9)]).stages is None  # not itself


def test_stage_needs_follow_the_memory_model() -> None:
    from scheduler.memory import Layer, ModelProfile, memory

    profile = ModelProfile(
        tuple(Layer(f"l{i}", 1000 * (i + 1), 1.0, 64.0, 256.0) for i in range(4))
    )
    needs = stage_needs(profile, (1, 3), ("a", "b", "c"), 1, micro_batches=4, micro_batch=2)
    assert [n.cluster for n in needs] == ["a", "b", "c"]
    # stage s of 3 keeps min(4, 3 - s) micro-batches in flight
    assert needs[1].memory_bytes == memory(profile, 1, 3, 2, 2).total
    assert needs[2].memory_bytes == memory(profile, 3, 4, 2, 1).total
    with pytest.raises(ValueError, match="stages"):
        stage_needs(profile, (1,), ("a", "b", "c"), 1, 4, 2)
