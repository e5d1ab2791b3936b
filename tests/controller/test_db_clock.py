"""The database's clock: replicas whose own clocks are off by an hour still agree on who is
alive and whose lease has expired (PostgreSQL; SQLite serves one replica on one host).

A skewed replica is a second engine on the same database whose clock reads a local time source
an hour off (`DbClock(local=...)`, installed for that engine with `use_clock`), so every code
path that asks the database's time on that engine (the controller loop, heartbeat ingestion,
the lease check) reads it through the skewed source.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import Engine, event, select, text
from sqlalchemy.orm import Session, sessionmaker

from agents.protocol import Heartbeat
from controller.loop.controller import Controller, live_replicas
from controller.network.leases import LeasePolicy, check_leases
from controller.network.resources import ingest_heartbeat
from controller.store.clock import DbClock, clock_of, use_clock
from controller.store.db import make_engine, make_sessionmaker
from controller.store.models import Cluster, Job, JobEvent, Replica, utcnow
from tests.controller.world import Net, spec

HOUR = timedelta(hours=1)
SKEWS = pytest.mark.parametrize("skew", [HOUR, -HOUR], ids=["ahead", "behind"])
POSTGRES = pytest.mark.parametrize("migrated_url", ["postgres"], indirect=True)
CLOSE = timedelta(seconds=30)
"""Agreement with the server's clock, far inside the skew."""
LEASES = LeasePolicy(heartbeat_interval_s=60.0, grace_s=120.0)
"""Leases long enough that no beat counts as missed while a test runs."""


def server_now(engine: Engine) -> datetime:
    """The server's time, read as the test's own reference."""
    with engine.connect() as conn:
        now: datetime = conn.execute(text("SELECT statement_timestamp()")).scalar_one()
    return now


def samples(engine: Engine) -> list[str]:
    """The clock samples `engine` runs from now on (appended as they run)."""
    ran: list[str] = []

    @event.listens_for(engine, "before_cursor_execute")
    def _record(_conn: object, _cursor: object, statement: str, *_rest: object) -> None:
        if "clock_timestamp" in statement:
            ran.append(statement)

    return ran


@dataclass
class Skewed:
    """A second replica's engine on the same database, its local clock `skew` off."""

    engine: Engine
    sessions: sessionmaker[Session]
    clock: DbClock


@pytest.fixture
def net(db_url: str, tmp_path: Path) -> Iterator[Net]:
    n = Net(db_url, tmp_path)
    n.cluster("east", gpus=4)
    n.cluster("west", gpus=4)
    yield n
    n.close()


@pytest.fixture
def skewed(db_url: str, skew: timedelta) -> Iterator[Skewed]:
    engine = make_engine(db_url)
    clock = use_clock(engine, DbClock(engine, local=lambda: utcnow() + skew))
    yield Skewed(engine, make_sessionmaker(engine), clock)
    engine.dispose()


@POSTGRES
@SKEWS
def test_the_database_clock_reads_the_server_whatever_the_local_clock_says(
    db_url: str, skew: timedelta
) -> None:
    engine = make_engine(db_url)
    ticks = [0.0]
    clock = DbClock(
        engine, local=lambda: utcnow() + skew, refresh_s=5.0, monotonic=lambda: ticks[0]
    )
    ran = samples(engine)
    assert abs(clock.now() - server_now(engine)) < CLOSE
    assert len(ran) == 1  # the first reading sampled the offset...
    for _ in range(100):
        assert abs(clock.now() - utcnow()) < CLOSE
    assert len(ran) == 1  # ...and the readings after it cost no round trip
    ticks[0] += 5.0  # until it is due again (paced by the monotonic clock)
    with engine.connect() as conn:
        assert abs(clock.now(conn) - server_now(engine)) < CLOSE
    assert len(ran) == 2
    engine.dispose()


def test_on_sqlite_the_database_clock_is_the_local_one(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'clock.db'}")
    at = datetime(2030, 1, 1, tzinfo=utcnow().tzinfo)
    clock = DbClock(engine, local=lambda: at)
    ran = samples(engine)
    assert clock.now() == at and ran == []
    assert clock_of(make_sessionmaker(engine)) is clock_of(engine)
    engine.dispose()


@POSTGRES
@SKEWS
def test_a_skewed_replica_neither_looks_dead_nor_declares_the_others_dead(
    net: Net, skewed: Skewed
) -> None:
    right = Controller(net.sessions, sqlite=False, launch=False)
    wrong = Controller(skewed.sessions, sqlite=False, launch=False)
    assert wrong.clock is skewed.clock and right.clock is clock_of(net.engine)
    right.tick()
    wrong.tick()

    # A job each, and one of a replica that did stop: silent for 5 minutes by the server.
    tenant = net.tenant("acme")
    jobs: dict[str, str] = {}
    for n, owner in enumerate((right.id, wrong.id, "replica-gone")):
        jobs[owner] = net.submit(tenant, spec(f"j{n}", gpus=1))
        assert net.place(owner=owner) == [jobs[owner]]
    with net.sessions() as s, s.begin():
        s.add(Replica(id="replica-gone", seen_at=server_now(net.engine) - timedelta(minutes=5)))

    wrong.tick()  # adopts the silent replica's job, and only that one
    right.tick()  # adopts nothing: the skewed replica is alive
    with net.sessions() as s:
        owners = dict(s.execute(select(Job.id, Job.owner)).all())
        adoptions = s.scalars(
            select(JobEvent.job_id).where(JobEvent.message.startswith("adopted by"))
        ).all()
    assert owners == {
        jobs[right.id]: right.id,
        jobs[wrong.id]: wrong.id,
        jobs["replica-gone"]: wrong.id,
    }
    assert adoptions == [jobs["replica-gone"]]
    for replica, sessions in ((right, net.sessions), (wrong, skewed.sessions)):
        with sessions() as s:
            alive = {r.id for r in live_replicas(s, replica.replica_ttl_s)}
        assert alive == {right.id, wrong.id}
    with net.sessions() as s:
        seen = s.scalar(select(Replica.seen_at).where(Replica.id == wrong.id))
    assert seen is not None and abs(seen - server_now(net.engine)) < CLOSE


@POSTGRES
@SKEWS
def test_a_lease_renewed_by_a_skewed_replica_is_not_expired_by_another(
    net: Net, skewed: Skewed
) -> None:
    def beat(sessions: sessionmaker[Session], cluster: str) -> None:
        """An agent's heartbeat, taken by the API of the replica `sessions` belongs to."""
        with sessions() as s, s.begin():
            hb = Heartbeat(cluster=cluster, gpus=[net.inventory[cluster]])
            ingest_heartbeat(s, hb, LEASES)

    beat(skewed.sessions, "east")
    beat(net.sessions, "west")
    # Each replica's lease monitor: every lease holds, whoever renewed it.
    checks: list[Callable[[], list[tuple[str, str, str]]]] = [
        lambda: check_leases(net.sessions, LEASES),
        lambda: check_leases(skewed.sessions, LEASES),
    ]
    for check in checks:
        assert check() == []
    now = server_now(net.engine)
    with net.sessions() as s:
        leases = s.execute(select(Cluster.name, Cluster.state, Cluster.lease_expires_at)).all()
    for name, state, expires in leases:
        assert state == "READY" and expires is not None, name
        assert abs(expires - (now + timedelta(seconds=LEASES.grace_s))) < CLOSE, name
