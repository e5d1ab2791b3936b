"""One job's launch failure never blocks another's in the same launcher pass.

A launch raises before any worker starts when the job's own part cannot be prepared (here:
its checkpoint directory cannot be made, as on a read-only root filesystem). The launcher
settles that as a failed attempt through the policy (`controller.loop.policy.decide`: retry, or
fail on the last attempt), gives the GPUs back, and goes on with the next job. No Ray: the
failure comes before the launch touches it (`controller.loop.ray_run.launch`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from controller.store.models import Job
from grammar.states import JobState
from tests.controller.world import MAX_ATTEMPTS, Net, spec


@pytest.fixture
def net(db_url: str, tmp_path: Path) -> Iterator[Net]:
    n = Net(db_url, tmp_path / "checkpoints")
    n.cluster("east", gpus=8)
    yield n
    n.close()


def _block_checkpoint_dir(root: Path, job_id: str) -> None:
    """A file where the job's checkpoint directory goes: making the directory raises."""
    root.mkdir(parents=True, exist_ok=True)
    (root / job_id).write_text("not a directory")


def test_a_launch_that_raises_is_a_failed_attempt_and_the_pass_goes_on(
    net: Net, tmp_path: Path
) -> None:
    tenant = net.tenant("acme")
    first = net.submit(tenant, spec("first", gpus=4))
    last_try = net.submit(tenant, spec("last-try", gpus=4))
    assert net.place() == [first, last_try]
    with net.sessions() as s, s.begin():
        row = s.get(Job, last_try)
        assert row is not None
        row.attempts = MAX_ATTEMPTS - 1  # its last attempt
    root = tmp_path / "checkpoints"
    for job_id in (first, last_try):
        _block_checkpoint_dir(root, job_id)

    # the controller's launch pass: every job it owns, in order; none may stop the others
    launched = [net.launcher.launch(job_id) for job_id in (first, last_try)]

    assert launched == [False, False]
    assert net.launcher.handles == {}
    retried = net.job(first)
    assert retried.state is JobState.RESCHEDULING and retried.attempts == 1
    assert net.messages(first)[-1] == "attempt 1 failed; retrying from the last checkpoint"
    failed = net.job(last_try)
    assert failed.state is JobState.FAILED and failed.attempts == MAX_ATTEMPTS
    for job_id in (first, last_try):
        assert net.held(job_id) == {}  # GPUs back
    assert net.books().held == {}


def test_after_a_failed_launch_the_next_placement_launches_again(net: Net, tmp_path: Path) -> None:
    """The failure is the attempt's, not the job's forever: once the cause is gone, the job
    is placed again like any retried job."""
    tenant = net.tenant("acme")
    job_id = net.submit(tenant, spec("j", gpus=4))
    net.place()
    _block_checkpoint_dir(tmp_path / "checkpoints", job_id)
    assert net.launcher.launch(job_id) is False
    assert net.job(job_id).state is JobState.RESCHEDULING
    (tmp_path / "checkpoints" / job_id).unlink()
    assert net.place() == [job_id]
    assert net.job(job_id).state is JobState.SCHEDULED
