"""The database SIGKILLed while jobs run and heartbeats flow, then started again.

A PostgreSQL server of the test's own (initdb, pg_ctl, its own port): its postmaster gets
`kill -9` while three jobs train on Ray and the agents heartbeat. The serve must outlive the
outage, answer 503 with Retry-After (never 500) meanwhile, and once the server is back every
job must succeed exactly once with the books balanced.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest

from api.processes import wait_until
from grammar.states import JobState
from tests.faults.conftest import ADMIN_TOKEN, Network, Postgres, running_steps
from tests.faults.invariants import assert_books

pytestmark = pytest.mark.slow  # needs the server binaries (initdb, pg_ctl), not a server
STEPS = 300


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_postgres_killed_while_jobs_run_and_heartbeats_flow(
    postgres: Postgres, tmp_path: Path
) -> None:
    network = Network(tmp_path, postgres.url)
    try:
        plane = network.start(migrate=True)
        network.build()
        assert network.beats is not None
        job_ids = network.submit(3, steps=STEPS)

        def training() -> dict[str, int] | None:
            steps = running_steps(postgres.url)
            reached = [steps.get(j, 0) for j in job_ids]
            return steps if max(reached) > 0 and min(reached) < STEPS else None

        at_kill = wait_until(training, 120, "jobs training")
        before = dict(network.beats.codes)
        postmaster = postgres.postmaster_pid()
        os.kill(postmaster, signal.SIGKILL)
        wait_until(lambda: _gone(postmaster), 30, "the postmaster to die")
        print("steps reached when PostgreSQL was killed:", {j[:8]: n for j, n in at_kill.items()})
        # Requests while the database is gone: a 503 problem with Retry-After, never a 500.
        wait_until(
            lambda: network.beats is not None and network.beats.codes[503] >= 6,
            60,
            "heartbeats answered 503",
        )
        answer = httpx.get(
            f"{plane.url}/v1/jobs", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30
        )
        assert answer.status_code == 503, answer.text
        assert answer.headers.get("retry-after") and "problem" in answer.headers["content-type"]
        assert plane.proc.alive(), plane.proc.tail()
        during = {k: v - before.get(k, 0) for k, v in network.beats.codes.items()}
        print("heartbeat answers during the outage:", during)

        # The backends notice their postmaster's death and exit; then the server starts over
        # the same data directory (crash recovery replays the WAL).
        wait_until(lambda: _restart(postgres), 60, "PostgreSQL to start again", every=0.5)

        network.wait_ended(job_ids, 240)
        after = assert_books(postgres.url)
        print("after PostgreSQL came back:", after.summary())
        assert plane.proc.alive() and network.plane is plane, "the serve survived the outage"
        assert set(after.states.values()) == {JobState.SUCCEEDED}, after.summary()
        for job_id in job_ids:
            assert after.terminal_events[job_id] == {JobState.SUCCEEDED: 1}, job_id
            states = network.state_events(job_id)
            assert states == ["PENDING", "SCHEDULED", "RUNNING", "SUCCEEDED"], states
            report = network.report(job_id)  # one run, never restarted nor resumed
            print(f"job {job_id[:8]}: trained {report['wall_s']:.1f} s, billed", end=" ")
            print(f"{after.gpu_seconds[job_id]} GPU-s")
            assert report["resumed_from_step"] is None and report["restarts"] == 0, report
            assert report["steps"] == STEPS, report
        assert after.open_allocations == {} and set(after.in_use.values()) == {0}
        assert after.usage_rows == after.ledger_rows > 0 and after.ledger_total > 0
        codes = network.beats.codes
        print("heartbeat answers in all:", dict(codes))
        assert 500 not in codes and codes[503] > 0 and codes[200] > 0, codes
        assert set(codes) <= {200, 503}, codes
    finally:
        network.close()


def _restart(postgres: Postgres) -> bool:
    try:
        postgres.start()
    except AssertionError:
        return False  # shared memory still held by an exiting backend: try again
    return True
