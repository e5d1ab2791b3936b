"""The controller SIGKILLed at its most delicate points, then started again over the same
SQLite database, one point after the other (one Ray start per run of jobs, not per crash):

1. in the middle of a placement pass, GPUs reserved but not committed (`place.before_commit`);
2. right after a placement committed, before the job was launched (`place.after_commit`);
3. in the middle of settling a finished job, its GPUs released, usage metered and ledger
   written but not committed (`settle.after_usage`).

After each crash the books as the dead process left them must balance; after the last restart
every job must succeed exactly once, be settled exactly once, the ledger must equal usage times
prices to the last decimal, and no GPU may stay held.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from grammar.states import JobState
from tests.faults.conftest import Network
from tests.faults.invariants import assert_books

pytestmark = pytest.mark.slow
STEPS = 20


def checkpoint_steps(folder: Path) -> list[int]:
    """The steps of a job's checkpoint files (`step-00000020.pt`)."""
    return sorted(int(m[1]) for p in folder.glob("*.pt") if (m := re.search(r"(\d+)", p.stem)))


def test_controller_killed_mid_placement_and_mid_settlement(network: Network) -> None:
    # Every job is submitted before a placement pass can run: a pass blocked at its
    # failpoint holds SQLite's one write lock, so a submission after it would wait that lock
    # out (503) -- on a loaded machine the next 0.3 s pass came between two submissions.
    network.start(migrate=True, controller=False)
    network.build()
    job_ids = network.submit(3, steps=STEPS)
    network.crash()
    network.start("place.before_commit")
    network.reached("place.before_commit", 60)
    network.crash()

    # The reservation died with its transaction: nothing placed, nothing held.
    crashed = assert_books(network.database_url)
    print("killed before a placement committed:", crashed.summary())
    assert set(crashed.states.values()) == {JobState.PENDING}, crashed.summary()
    assert crashed.open_allocations == {} and set(crashed.in_use.values()) == {0}

    network.start("place.after_commit")
    network.reached("place.after_commit", 60)
    network.crash()

    # One job placed and committed, then the pass died before launching it: its GPUs are
    # held by its allocation and counted in use, exactly once.
    crashed = assert_books(network.database_url)
    print("killed after a placement committed:", crashed.summary())
    scheduled = [j for j, s in crashed.states.items() if s is JobState.SCHEDULED]
    assert len(scheduled) == 1, crashed.summary()
    assert crashed.open_allocations == {scheduled[0]: 1} and sum(crashed.in_use.values()) == 1

    network.start("settle.after_usage")  # adopts the placed job, places the others, runs them
    network.reached("settle.after_usage", 180)
    network.crash()

    # The settlement died uncommitted: the job still runs on the books, nothing was charged
    # for it, and its GPUs are still held by its open allocation.
    crashed = assert_books(network.database_url)
    print("killed while settling a finished job:", crashed.summary())
    saved = {j: checkpoint_steps(network.workdir / "checkpoints" / j) for j in job_ids}
    print("checkpoints at the crash:", {j[:8]: steps for j, steps in saved.items()})
    assert crashed.ledger_rows == 0 and crashed.terminal_events == {}, crashed.summary()
    assert set(crashed.states.values()) <= {JobState.RUNNING, JobState.SCHEDULED}
    assert sum(crashed.in_use.values()) == 3 and crashed.usage_rows == crashed.unpriced

    network.start()  # no failpoint: the new replica adopts the jobs, resumes and settles them
    network.wait_ended(job_ids, 180)
    after = assert_books(network.database_url)
    print("after the last restart:", after.summary())
    assert set(after.states.values()) == {JobState.SUCCEEDED}, after.summary()
    for job_id in job_ids:
        assert after.terminal_events[job_id] == {JobState.SUCCEEDED: 1}, job_id
        states = network.state_events(job_id)  # placed once, ran once, succeeded once
        assert states == ["PENDING", "SCHEDULED", "RUNNING", "SUCCEEDED"], states
        report = network.report(job_id)
        print(
            f"job {job_id[:8]}: resumed from step {report['resumed_from_step']}, last run", end=" "
        )
        print(f"trained {report['wall_s']:.1f} s, billed {after.gpu_seconds[job_id]} GPU-s")
        assert report["steps"] == STEPS, report
        # No step is trained twice that was checkpointed before the crash: the run resumed
        # from the newest checkpoint, or started over when there was none.
        assert report["resumed_from_step"] == max(saved[job_id], default=None), report
        adoptions = [m for m in network.info_events(job_id) if "adopted by replica" in m]
        assert len(adoptions) == (2 if job_id == scheduled[0] else 1), adoptions
        if crashed.states[job_id] is JobState.RUNNING:
            # Its run died with the replica: the time until the relaunch is not billed.
            assert network.paused_s(job_id) > 0, job_id
    assert after.open_allocations == {} and set(after.in_use.values()) == {0}, after.summary()
    assert after.usage_rows == after.ledger_rows > 0 and after.ledger_total > 0, after.summary()
    assert network.beats is not None
    assert 500 not in network.beats.codes, network.beats.codes
