"""What `cpn demo`'s report says of the job whose cluster was lost: the states it went
through from the loss on, not its whole history read as if it followed the loss."""

from __future__ import annotations

from typing import Any

from api.cli.demo import since_lost


def _state(to: str, message: str = "") -> dict[str, Any]:
    return {"kind": "state", "to_state": to, "message": message}


def _warning(message: str) -> dict[str, Any]:
    return {"kind": "warning", "to_state": None, "message": message}


START = [_state("PENDING", "submitted"), _state("SCHEDULED"), _state("RUNNING", "launched")]


def test_a_job_that_went_on_without_the_cluster_stayed_running() -> None:
    events = [
        *START,
        _warning("cluster eu-west went DOWN (its agent's lease expired): the job goes on"),
        _state("SUCCEEDED", "finished 1800 steps"),
    ]
    assert since_lost(events, "eu-west") == (
        "eu-west went DOWN while the job was RUNNING; its states since: RUNNING -> SUCCEEDED"
    )


def test_a_job_restarted_from_its_checkpoint_shows_its_rescheduling() -> None:
    events = [
        *START,
        _state("RESCHEDULING", "cluster us-east is DOWN; resuming from checkpoint"),
        _state("SCHEDULED"),
        _state("RUNNING"),
        _state("SUCCEEDED"),
    ]
    assert since_lost(events, "us-east") == (
        "us-east went DOWN while the job was RUNNING; its states since: RUNNING -> "
        "RESCHEDULING -> SCHEDULED -> RUNNING -> SUCCEEDED"
    )
    # a cluster whose name another begins with is not mistaken for it
    assert since_lost(events, "us") == (
        "us went DOWN; the job's states: PENDING -> SCHEDULED -> RUNNING -> RESCHEDULING -> "
        "SCHEDULED -> RUNNING -> SUCCEEDED"
    )
