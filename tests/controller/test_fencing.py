"""Fencing: a job's runs are fenced by an epoch, so a run that outlived its replica's lease
writes nothing, on SQLite and PostgreSQL, without Ray.

Two real controller replicas (`Controller`, the loop's own heartbeat and adoption) share one
database; each launcher flushes and settles its runs through the real session factory. A
launch is what `controller.loop.ray_run` does in its transaction before Ray starts (the fence
bumped, the job RUNNING, a handle that remembers the fence); a run's end is what its thread
hands the loop (see `world.py`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import timedelta
from decimal import Decimal
from pathlib import Path

import pytest
from sqlalchemy import event, func, select, text, update

from api.processes import wait_until
from controller.jobs import lifecycle
from controller.jobs.service import cancel
from controller.loop import progress
from controller.loop.controller import Controller
from controller.loop.policy import Stop, StopReason
from controller.loop.runs import RunHandle
from controller.store.clock import db_now
from controller.store.db import is_sqlite, make_engine, make_sessionmaker
from controller.store.models import (
    Allocation,
    ClusterGpus,
    Job,
    JobEvent,
    JobMetric,
    LedgerEntry,
    Replica,
    Usage,
)
from grammar.states import JobState
from tests.controller.world import Net, east_west, report, spec
from tests.controller.world import progress as report_at


@pytest.fixture
def net(db_url: str, tmp_path: Path) -> Iterator[Net]:
    """Clusters east and west (4 A100 each) joined by a fast link; no jobs."""
    n = east_west(db_url, tmp_path)
    yield n
    n.close()


@dataclass(frozen=True)
class Written:
    """What a job's runs have written: rows of each kind."""

    metrics: int
    events: int
    usage: int
    ledger: int


def written(net: Net, job_id: str) -> Written:
    with net.sessions() as s:

        def count(model: type[JobMetric | JobEvent | Usage | LedgerEntry]) -> int:
            query = select(func.count()).select_from(model).where(model.job_id == job_id)
            return int(s.scalar(query) or 0)

        return Written(count(JobMetric), count(JobEvent), count(Usage), count(LedgerEntry))


def holding(net: Net, job_id: str) -> tuple[dict[str, int], int]:
    """The job's open allocations (GPUs per cluster) and the GPUs the inventory has in use."""
    with net.sessions() as s:
        in_use = s.scalar(select(func.sum(ClusterGpus.in_use)))
    return net.held(job_id), int(in_use or 0)


def launch(net: Net, replica: Controller, job_id: str) -> RunHandle:
    """`controller.loop.ray_run.launch`'s transaction, Ray left out: a new fencing epoch, the job
    RUNNING (an adopted one already is), and a handle with that epoch in the replica's
    launcher."""
    clusters = net.held(job_id)
    with net.sessions() as s, s.begin():
        job = s.get(Job, job_id)
        assert job is not None and job.owner == replica.id
        fence = lifecycle.begin_run(s, job, "launched", clusters)
    handle = RunHandle(
        job_id=job_id,
        clusters=clusters,
        gpu_models=dict.fromkeys(clusters, "A100"),
        flops_per_step=1e9,
        predicted_step_s=None,
        fence=fence,
    )
    replica.launcher.handles[job_id] = handle
    return handle


def silence(net: Net, replica: Controller) -> None:
    """The replica stops heartbeating: by the database's clock it was last seen 5 minutes ago
    (it is paused, say; its runs go on)."""
    with net.sessions() as s, s.begin():
        s.execute(
            update(Replica)
            .where(Replica.id == replica.id)
            .values(seen_at=db_now(s) - timedelta(minutes=5))
        )


def end(replica: Controller, run: RunHandle, ending: str) -> None:
    """The run's thread ends (`ending`: completed or error); the replica's next pass settles."""
    if ending == "completed":
        run.report = report(100, run.clusters)
    else:
        run.error = RuntimeError("actor died")
    run.done.set()
    replica.launcher.tick()
    assert run.job_id not in replica.launcher.handles


def replicas(net: Net) -> tuple[Controller, Controller]:
    """Two live replicas on the database (registered by a first pass of their loops)."""
    a = Controller(net.sessions, sqlite=False, launch=False)
    b = Controller(net.sessions, sqlite=False, launch=False)
    a.tick()
    b.tick()
    return a, b


@pytest.mark.parametrize("ending", ["completed", "error"])
def test_an_adopted_job_fences_off_the_run_of_the_replica_that_lost_it(
    net: Net, ending: str
) -> None:
    a, b = replicas(net)
    job_id = net.submit(net.tenant("acme"), spec("j", gpus=8))
    assert net.place(owner=a.id) == [job_id]
    old = launch(net, a, job_id)
    assert old.fence == 1
    old.on_progress(report_at(30, old.clusters))
    a.launcher.tick()
    assert net.job(job_id).checkpoint_step == 30

    # A falls silent; B adopts the job, which takes a new epoch.
    silence(net, a)
    b.tick()
    job = net.job(job_id)
    assert job.owner == b.id and job.fence == 2 and job.state is JobState.RUNNING
    held, before = holding(net, job_id), written(net, job_id)
    assert before.metrics == 1 and before.usage == 2  # WAN bytes both ways, metered

    # A was only paused: its run goes on and reports. Nothing of it is written; it is stopped.
    old.on_progress(report_at(40, old.clusters))
    a.launcher.tick()
    assert old.stop == Stop(StopReason.SUPERSEDED)
    assert written(net, job_id) == before and net.job(job_id).checkpoint_step == 30

    # Its end settles nothing: no attempt counted, no GPUs released, nothing billed.
    end(a, old, ending)
    job = net.job(job_id)
    assert (job.state, job.owner, job.attempts, job.fence) == (JobState.RUNNING, b.id, 0, 2)
    assert holding(net, job_id) == held and written(net, job_id) == before

    # B's run goes on from the checkpoint, and is the one that settles.
    new = launch(net, b, job_id)
    assert new.fence == 3
    new.on_progress(report_at(50, new.clusters))
    b.launcher.tick()
    assert net.job(job_id).checkpoint_step == 50
    assert written(net, job_id).metrics == before.metrics + 1
    end(b, new, "completed")
    assert net.job(job_id).state is JobState.SUCCEEDED
    done = net.books(job_id)
    assert done.held == {} and done.ledger_rows == done.usage_rows > 0
    # A's run was last seen alive 5 minutes back: from then until B's relaunch nothing is
    # billed (the pause is kept on the allocations so the books still add up).
    with net.sessions() as s:
        paused = s.scalars(select(Allocation).where(Allocation.job_id == job_id)).all()
    assert paused and all(a.paused_at is None and a.paused_s > 0 for a in paused)


def test_a_replica_that_takes_its_job_back_does_not_revive_its_old_run(net: Net) -> None:
    """Ownership alone cannot tell the runs apart: A owns the job again, yet its old run
    (still in its launcher) is two epochs behind and settles nothing."""
    a, b = replicas(net)
    job_id = net.submit(net.tenant("acme"), spec("j", gpus=4))
    assert net.place(owner=a.id) == [job_id]
    old = launch(net, a, job_id)
    held = holding(net, job_id)

    silence(net, a)
    b.tick()  # B adopts...
    silence(net, b)
    a.tick()  # ...and falls silent in turn: A, back, adopts the job again
    job = net.job(job_id)
    assert job.owner == a.id and job.fence == 3
    before = written(net, job_id)

    old.on_progress(report_at(20, old.clusters))
    end(a, old, "error")  # would count a failed attempt and place the job again
    job = net.job(job_id)
    assert (job.state, job.attempts, job.checkpoint_step) == (JobState.RUNNING, 0, None)
    assert holding(net, job_id) == held
    assert written(net, job_id) == before and before.metrics == 0

    # A's controller launches a new run (the old one is gone from its launcher).
    new = launch(net, a, job_id)
    assert new.fence == 4
    new.on_progress(report_at(20, new.clusters))
    a.launcher.tick()
    assert written(net, job_id).metrics == 1 and net.job(job_id).checkpoint_step == 20


def test_a_batch_that_fails_to_commit_is_written_on_the_next_pass(net: Net, db_url: str) -> None:
    """A batch refused by a lock (or a lost connection) is kept, ahead of the reports that
    arrive meanwhile, and the run's WAN counters stay where the database has them."""
    a, _ = replicas(net)
    job_id = net.submit(net.tenant("acme"), spec("j", gpus=8))
    assert net.place(owner=a.id) == [job_id]
    run = launch(net, a, job_id)
    run.on_progress(report_at(30, run.clusters))

    # A flusher that gives up on a lock at once, and another session holding the job's row.
    if is_sqlite(db_url):
        impatient = make_engine(db_url)

        @event.listens_for(impatient, "connect")
        def _short_wait(dbapi_conn: object, _record: object) -> None:
            dbapi_conn.execute("PRAGMA busy_timeout=50")  # type: ignore[attr-defined]

    else:
        impatient = make_engine(db_url, connect_args={"options": "-c lock_timeout=50"})
    holder = net.sessions()
    try:
        holder.begin()
        holder.execute(update(Job).where(Job.id == job_id).values(reason=Job.reason))
        with pytest.raises(progress.TRANSIENT):
            progress.flush(make_sessionmaker(impatient), run)
        assert run.pending == [report_at(30, run.clusters)] and run.wan_seen == {}
        run.on_progress(report_at(40, run.clusters))  # arrives meanwhile
    finally:
        holder.rollback()
        holder.close()
        impatient.dispose()

    a.launcher.tick()
    assert run.pending == []
    with net.sessions() as s:
        steps = s.scalars(select(JobMetric.step).where(JobMetric.job_id == job_id)).all()
        wan = s.scalar(
            select(func.sum(Usage.quantity)).where(
                Usage.job_id == job_id, Usage.kind == "wan_bytes"
            )
        )
    assert sorted(steps) == [30, 40] and net.job(job_id).checkpoint_step == 40
    assert wan == Decimal(2 * 1000 * 40)  # every byte of both links, metered once


def test_a_progress_batch_racing_a_cancel_is_written(net: Net, db_url: str) -> None:
    """The flush waits for the cancel's lock on the job and then writes its batch (it does not
    lose it to the cancel's new version); the cancelled run's settlement bills those bytes."""
    if is_sqlite(db_url):
        pytest.skip("one writer at a time on SQLite: a flush cannot wait inside a cancel")
    a, _ = replicas(net)
    job_id = net.submit(net.tenant("acme"), spec("j", gpus=8))
    assert net.place(owner=a.id) == [job_id]
    run = launch(net, a, job_id)
    run.on_progress(report_at(30, run.clusters))

    failed: list[BaseException] = []

    def flush() -> None:
        try:
            progress.flush(net.sessions, run)
        except BaseException as exc:  # reported to the test
            failed.append(exc)

    with net.sessions() as s, s.begin():
        job = s.get(Job, job_id)
        assert job is not None
        cancel(s, job, "cancelled by tenant")
        s.flush()  # the job's row is now locked by this transaction
        flusher = threading.Thread(target=flush)
        flusher.start()
        wait_until(lambda: _waiting_on_a_lock(net), 30, "the flush to wait for the cancel's lock")
    flusher.join(30)
    assert not flusher.is_alive() and failed == []

    assert net.job(job_id).state is JobState.CANCELLED
    assert written(net, job_id).metrics == 1 and net.job(job_id).checkpoint_step == 30
    a.launcher.tick()
    assert run.stop == Stop(StopReason.CANCELLED)
    end(a, run, "completed")
    with net.sessions() as s:
        unpriced = s.scalar(
            select(func.count()).select_from(Usage).where(Usage.job_id == job_id, ~Usage.priced)
        )
    assert unpriced == 0 and net.books(job_id).held == {}


def _waiting_on_a_lock(net: Net) -> bool:
    """Whether a session of this database waits on a lock (PostgreSQL; read on a connection of
    its own: the statistics views hold still within a transaction)."""
    with net.engine.connect() as conn:
        waiting = conn.execute(
            text(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock'"
            )
        ).scalar_one()
    return bool(waiting)


def test_the_fence_migration_goes_up_and_down_keeping_jobs(tmp_path: Path) -> None:
    """0009 adds `jobs.fence` (for the jobs there, the epoch their checkpoints carried before:
    their attempts) and its downgrade drops it, rows kept. On SQLite, whose downgrade copies the
    table (PostgreSQL's upgrade is checked by `test_migrations.py`)."""
    from alembic import command
    from sqlalchemy import MetaData, inspect

    from controller.store.migrate import alembic_config, upgrade
    from tests.controller.test_migrations import _fill

    url = f"sqlite:///{tmp_path / 'fence.db'}"
    upgrade(url, "0008")
    engine = make_engine(url)
    meta = MetaData()
    meta.reflect(engine, only=["tenants", "jobs"])
    with engine.begin() as conn:
        tenant = _fill(conn, meta.tables["tenants"], {})
        job = _fill(conn, meta.tables["jobs"], {"tenants": tenant})
    upgrade(url, "0009")
    with engine.connect() as conn:
        assert conn.execute(text("SELECT id, fence, attempts FROM jobs")).one() == (job, 1, 1)
    command.downgrade(alembic_config(url), "0008")
    assert "fence" not in {c["name"] for c in inspect(engine).get_columns("jobs")}
    with engine.connect() as conn:
        assert conn.execute(text("SELECT id FROM jobs")).scalar_one() == job
    engine.dispose()


def test_a_jobs_log_keeps_its_newest_lines_across_runs(
    net: Net, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 51: a job keeps its newest `LOGS_KEPT` lines (within `LOGS_TRIM`), counting what
    an earlier run of it wrote too; a superseded run writes none."""
    from controller.store.models import JobLog
    from training.logs import LogLine

    monkeypatch.setattr(progress, "LOGS_KEPT", 10)
    monkeypatch.setattr(progress, "LOGS_TRIM", 4)
    job_id = net.submit(net.tenant("acme"), spec("j", gpus=2))
    assert net.place() == [job_id]

    def said(run: RunHandle, step: int, n: int) -> None:
        p = report_at(step, run.clusters)
        p.logs = [LogLine(1.0 + step, "east/0", "stdout", f"{step}:{i}") for i in range(n)]
        run.on_progress(p)
        progress.flush(net.sessions, run)

    def texts() -> list[str]:
        with net.sessions() as s:
            return list(s.scalars(select(JobLog.text).where(JobLog.job_id == job_id)))

    first = net.start(job_id)
    for step in range(1, 5):
        said(first, step, 3)  # 12 lines: trimmed to the newest 10 at the 12th
    assert texts() == [f"{s}:{i}" for s in range(1, 5) for i in range(3)][-10:]
    second = replace(first, pending=[], log_lines=None)  # another run: it counts the 10 kept
    said(second, 5, 2)
    assert len(texts()) == 10 and texts()[-2:] == ["5:0", "5:1"]
