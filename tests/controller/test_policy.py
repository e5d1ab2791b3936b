"""The stop policy as pure functions: how a run ended, what to do, where the job goes."""

from __future__ import annotations

import pytest

from controller.policy import (
    FAILURES,
    Decision,
    Stop,
    StopReason,
    decide,
    failure,
    next_state,
    stop_of,
    stop_requested,
)
from controller.states import JobState

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
