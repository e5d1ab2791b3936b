"""`cpn serve --workers N`: the loops' election, and a real multi-process server."""

from __future__ import annotations

import os
import re
import signal
import threading
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from api.election import ElectedLoops
from api.processes import start_control_plane, wait_until
from controller.loop.controller import live_replicas
from controller.store.db import make_engine, make_sessionmaker
from controller.store.models import ApiKey

REPLICA_TTL_S = 4.0
"""CPN_REPLICA_TTL_S here: a dead holder's controller counts as live this long."""


class Recorder:
    """What one process's loops did: starts (after `fail` refusals) and stops."""

    def __init__(self, fail: int = 0) -> None:
        self.fail = fail
        self.tries = 0
        self.started = threading.Event()
        self.stopped = threading.Event()

    def start(self) -> None:
        self.tries += 1
        if self.tries <= self.fail:
            raise RuntimeError("another controller is still registered")
        self.started.set()

    def stop(self) -> None:
        self.stopped.set()


def test_one_holder_runs_the_loops_and_a_waiter_takes_over_when_it_ends(tmp_path: Path) -> None:
    lock = tmp_path / "loops.lock"
    first, second = Recorder(), Recorder()
    a = ElectedLoops(lock, first.start, first.stop, retry_s=0.01)
    a.begin()
    wait_until(lambda: a.running, 10, "the first worker to run the loops")
    b = ElectedLoops(lock, second.start, second.stop, retry_s=0.01)
    b.begin()
    wait_until(lambda: b.tries >= 3, 10, "the second worker to be refused the lock")
    assert not b.running and not second.started.is_set()
    a.end()
    assert first.stopped.is_set()
    wait_until(lambda: b.running, 10, "the second worker to take the loops over")
    b.end()
    assert second.started.is_set() and second.stopped.is_set()


def test_a_refused_start_is_retried_and_an_unstarted_holder_stops_nothing(tmp_path: Path) -> None:
    loops = Recorder(fail=2)
    elected = ElectedLoops(tmp_path / "loops.lock", loops.start, loops.stop, retry_s=0.01)
    elected.begin()
    wait_until(lambda: elected.running, 10, "the loops to start on the third try")
    assert loops.tries == 3
    elected.end()
    assert loops.stopped.is_set()

    never = Recorder(fail=10**9)
    waiting = ElectedLoops(tmp_path / "loops.lock", never.start, never.stop, retry_s=0.01)
    waiting.begin()
    wait_until(lambda: never.tries >= 2, 10, "two refused starts")
    waiting.end()
    assert not never.stopped.is_set()  # what never started is not stopped


@pytest.mark.slow
def test_several_workers_serve_one_port_and_one_of_them_runs_the_controller(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'cpn.db'}"
    token_file = tmp_path / "admin-token"
    plane = start_control_plane(
        url,
        "",  # no CPN_ADMIN_TOKEN: the first admin key is generated, once
        settings={
            "CPN_ADMIN_TOKEN_FILE": str(token_file),
            "CPN_LAUNCH_JOBS": "false",
            "CPN_REPLICA_TTL_S": str(REPLICA_TTL_S),
        },
        workers=2,
    )
    sessions = make_sessionmaker(make_engine(url))
    try:
        admin = token_file.read_text().strip()
        with sessions() as db:
            assert len(db.scalars(select(ApiKey).where(ApiKey.role == "admin")).all()) == 1
        workers = wait_until(
            lambda: (pids := _worker_pids(plane.proc.lines)) and len(pids) == 2 and pids,
            60,
            "two worker processes",
        )
        holder = wait_until(
            lambda: _loops_holder(plane.proc.lines), 60, "a worker to hold the background loops"
        )
        assert holder in workers
        # Fresh connections, so the kernel hands them to either worker; every request counts.
        auth = {"Authorization": f"Bearer {admin}"}
        for _ in range(40):
            with httpx.Client(base_url=plane.url) as http:
                assert http.get("/v1/tenants", headers=auth).status_code == 200

        def served() -> float:
            scraped = httpx.get(f"{plane.url}/metrics").text
            found = re.search(
                r'cpn_http_requests_total\{method="GET",route="/v1/tenants",status="200"\} (\S+)',
                scraped,
            )
            assert found is not None
            return float(found.group(1))

        # A worker counts a request just after answering it: the last may land a moment later.
        wait_until(lambda: served() >= 40, 10, "the 40 requests counted")
        assert served() == 40
        with sessions() as db:
            assert [r.pid for r in live_replicas(db, REPLICA_TTL_S)] == [holder]
        # The holder dies: the other worker (or the holder's replacement) takes over, and
        # there is never more than one controller on this SQLite database.
        os.kill(holder, signal.SIGKILL)

        def new_controller() -> list[int] | None:
            with sessions() as db:
                pids = [r.pid for r in live_replicas(db, REPLICA_TTL_S)]
            assert len(pids) <= 1
            return pids if pids and pids[0] != holder else None

        wait_until(new_controller, 90, "another worker's controller", every=0.2)
        assert httpx.get(f"{plane.url}/v1/tenants", headers=auth).status_code == 200
    finally:
        plane.proc.stop()
    assert plane.proc.popen.returncode == 0
    with sessions() as db:
        assert live_replicas(db, REPLICA_TTL_S) == []  # the last holder deregistered


def _worker_pids(lines: list[str]) -> set[int]:
    return {
        int(m.group(1))
        for line in lines
        if (m := re.search(r"Started server process \[(\d+)\]", line))
    }


def _loops_holder(lines: list[str]) -> int | None:
    for line in lines:
        if m := re.search(r"worker (\d+) holds the background loops", line):
            return int(m.group(1))
    return None
