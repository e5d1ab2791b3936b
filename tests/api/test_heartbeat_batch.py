"""Heartbeat group commit (`api.heartbeats`): batches, last-writer-wins, failures as 503.

On SQLite and PostgreSQL. The batcher runs for real (its writer thread, the real database);
a batch is made deterministic by holding its one writer until every beat has joined.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import anyio
import httpx
import pytest
from sqlalchemy import event, select, text
from sqlalchemy.engine.default import CacheStats
from sqlalchemy.orm import Session, sessionmaker

from agents.protocol import GpuInventory as GpuReport
from agents.protocol import Heartbeat
from api.group_commit import BatchFailed
from api.heartbeats import HeartbeatBatcher, latest_per_cluster
from controller.network.leases import LeasePolicy
from controller.network.resources import RENEW_CHUNK, HeartbeatResult, PeerTable
from controller.store.db import make_engine, make_sessionmaker
from controller.store.models import Cluster, ClusterGpus
from controller.values.errors import NotFound
from tests.api.batches import one_batch
from tests.conftest import LiveServer

POLICY = LeasePolicy(heartbeat_interval_s=10, grace_s=40)


def _beat(cluster: str, count: int) -> Heartbeat:
    gpus = [GpuReport(model="A100-80GB", memory_gib=80, count=count, allocatable=count)]
    return Heartbeat(cluster=cluster, gpus=gpus)


@contextmanager
def _sessions(url: str, clusters: int) -> Iterator[sessionmaker[Session]]:
    engine = make_engine(url)
    sessions = make_sessionmaker(engine)
    with sessions() as session:
        session.add_all(Cluster(name=f"c{i}", region="r1") for i in range(clusters))
        session.commit()
    try:
        yield sessions
    finally:
        engine.dispose()


def _counts(sessions: sessionmaker[Session]) -> dict[str, int]:
    with sessions() as session:
        rows = session.execute(
            select(Cluster.name, ClusterGpus.count).join(
                ClusterGpus, ClusterGpus.cluster_id == Cluster.id
            )
        ).all()
    return dict(rows)


def _states(sessions: sessionmaker[Session]) -> dict[str, str]:
    with sessions() as session:
        return dict(session.execute(select(Cluster.name, Cluster.state)).all())


async def _one_batch(
    batcher: HeartbeatBatcher, bodies: list[Heartbeat]
) -> list[HeartbeatResult | Exception]:
    """Ingest `bodies` concurrently, all in one batch (`one_batch`); each beat's lease."""
    return [r if isinstance(r, Exception) else r[0] for r in await one_batch(batcher, bodies)]


def test_latest_report_of_a_cluster_wins() -> None:
    bodies = [_beat("a", 1), _beat("b", 2), _beat("a", 3)]
    latest = latest_per_cluster(bodies)
    assert latest["a"].gpus[0].count == 3 and latest["b"].gpus[0].count == 2
    assert list(latest) == ["b", "a"]  # written in the order the last reports came


def test_a_batch_with_two_reports_for_one_cluster_keeps_the_latest(db_url: str) -> None:
    with _sessions(db_url, 2) as sessions:
        batcher = HeartbeatBatcher(sessions, POLICY, PeerTable(), workers=1, window_s=0)
        bodies = [_beat("c0", 4), _beat("c1", 2), _beat("c0", 8)]
        results = anyio.run(_one_batch, batcher, bodies)
        assert batcher.batches == 1 and batcher.items == 3
        assert all(isinstance(r, HeartbeatResult) and r.state == "READY" for r in results)
        assert results[0] == results[2]  # both reports of c0 answered with the one renewal
        assert _counts(sessions) == {"c0": 8, "c1": 2}
        assert _states(sessions) == {"c0": "READY", "c1": "READY"}


def test_a_refused_report_fails_alone(db_url: str) -> None:
    """An unknown cluster wrote nothing: its beat gets its 404, the others are stored."""
    with _sessions(db_url, 1) as sessions:
        batcher = HeartbeatBatcher(sessions, POLICY, PeerTable(), workers=1, window_s=0)
        results = anyio.run(_one_batch, batcher, [_beat("c0", 4), _beat("nope", 1)])
        assert isinstance(results[0], HeartbeatResult)
        assert isinstance(results[1], NotFound) and results[1].field == "cluster"
        assert _counts(sessions) == {"c0": 4}


@contextmanager
def _failing_cluster_updates(url: str) -> Iterator[None]:
    """A trigger that makes the database refuse every UPDATE of a cluster (a real error from
    the real database), dropped afterwards."""
    engine = make_engine(url)
    sqlite = engine.dialect.name == "sqlite"
    with engine.begin() as conn:
        if sqlite:
            conn.execute(
                text(
                    "CREATE TRIGGER fail_beats BEFORE UPDATE ON clusters "
                    "BEGIN SELECT RAISE(ABORT, 'injected failure'); END"
                )
            )
        else:
            conn.execute(
                text(
                    "CREATE FUNCTION fail_beats() RETURNS trigger AS $$ BEGIN "
                    "RAISE EXCEPTION 'injected failure'; END $$ LANGUAGE plpgsql"
                )
            )
            conn.execute(
                text(
                    "CREATE TRIGGER fail_beats BEFORE UPDATE ON clusters "
                    "FOR EACH ROW EXECUTE FUNCTION fail_beats()"
                )
            )
    try:
        yield
    finally:
        with engine.begin() as conn:
            if sqlite:
                conn.execute(text("DROP TRIGGER fail_beats"))
            else:
                conn.execute(text("DROP TRIGGER fail_beats ON clusters"))
                conn.execute(text("DROP FUNCTION fail_beats()"))
        engine.dispose()


def test_a_database_error_fails_every_beat_of_the_batch_with_503(db_url: str) -> None:
    with _sessions(db_url, 3) as sessions:
        batcher = HeartbeatBatcher(sessions, POLICY, PeerTable(), workers=1, window_s=0)
        with _failing_cluster_updates(db_url):
            results = anyio.run(_one_batch, batcher, [_beat(f"c{i}", 4) for i in range(3)])
        assert all(isinstance(r, BatchFailed) for r in results), results
        assert all(r.status == 503 and r.retry_after_s == 1 for r in results)  # type: ignore[union-attr]
        assert _counts(sessions) == {}  # rolled back: nothing of the batch stored
        assert set(_states(sessions).values()) == {"PENDING"}
        # The batcher goes on: the next batch is written.
        results = anyio.run(_one_batch, batcher, [_beat("c1", 2)])
        assert isinstance(results[0], HeartbeatResult)
        assert _counts(sessions) == {"c1": 2}


def test_a_failed_batch_answers_503_problems_over_http(live_server: LiveServer) -> None:
    """Through a real server: concurrent beats whose batch the database refuses get 503s
    with Retry-After (never a 500), and beats succeed again once it accepts them."""
    agents = []
    with live_server.client() as admin:
        for i in range(4):
            admin.create_cluster(f"h{i}", "r1")
            agents.append((f"h{i}", admin.create_api_key("agent", f"h{i}")["token"]))

    async def beat_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=live_server.url, timeout=30) as client:
            calls = [
                client.post(
                    "/v1/agent/heartbeat",
                    json={"cluster": name, "gpus": []},
                    headers={"Authorization": f"Bearer {token}"},
                )
                for name, token in agents
            ]
            return list(await asyncio.gather(*calls))

    with _failing_cluster_updates(live_server.database_url):
        refused = anyio.run(beat_all)
    for r in refused:
        assert r.status_code == 503, r.text
        assert r.headers["Retry-After"] == "1"
        assert r.headers["content-type"].startswith("application/problem+json")
        assert r.json()["status"] == 503
    assert [r.status_code for r in anyio.run(beat_all)] == [200] * len(agents)


@pytest.mark.parametrize("window_s", [0.0, 0.002])
def test_beats_of_many_clusters_in_one_batch_all_land(db_url: str, window_s: float) -> None:
    with _sessions(db_url, 50) as sessions:
        batcher = HeartbeatBatcher(sessions, POLICY, PeerTable(), workers=1, window_s=window_s)
        results = anyio.run(_one_batch, batcher, [_beat(f"c{i}", i + 1) for i in range(50)])
        assert all(isinstance(r, HeartbeatResult) for r in results)
        assert batcher.batches == 1
        assert _counts(sessions) == {f"c{i}": i + 1 for i in range(50)}


def _statements_of_a_batch(sessions: sessionmaker[Session], bodies: list[Heartbeat]) -> int:
    """How many statements the database ran for one batch of `bodies` (counted on the real
    engine by SQLAlchemy's cursor event)."""
    engine = sessions.kw["bind"]
    seen: list[str] = []

    def count(*args: object) -> None:
        seen.append(str(args[2]))

    batcher = HeartbeatBatcher(sessions, POLICY, PeerTable(), workers=1, window_s=0)
    event.listen(engine, "before_cursor_execute", count)
    try:
        anyio.run(_one_batch, batcher, bodies)
    finally:
        event.remove(engine, "before_cursor_execute", count)
    return len(seen)


def test_renewing_a_batch_costs_the_same_statements_for_2_or_40_clusters(db_url: str) -> None:
    """The steady state (READY, inventory unchanged) is a few statements a batch, not a few a
    beat: on PostgreSQL each statement is a round trip, which was a batch's whole price."""
    with _sessions(db_url, 40) as sessions:
        first = [_beat(f"c{i}", 4) for i in range(40)]
        batcher = HeartbeatBatcher(sessions, POLICY, PeerTable(), workers=1, window_s=0)
        anyio.run(_one_batch, batcher, first)  # first beats: PENDING -> READY, one by one
        assert set(_states(sessions).values()) == {"READY"}
        small = _statements_of_a_batch(sessions, first[:2])
        large = _statements_of_a_batch(sessions, first)
        assert large == small, (small, large)
        assert _counts(sessions) == {f"c{i}": 4 for i in range(40)}


def test_a_mixed_batch_takes_each_report_its_own_way(db_url: str) -> None:
    """Renewed unchanged, renewed with a new GPU count, a first beat, a new probe URL and an
    unknown cluster in one batch: each gets its own outcome and only theirs is stored."""
    with _sessions(db_url, 4) as sessions:
        batcher = HeartbeatBatcher(sessions, POLICY, PeerTable(), workers=1, window_s=0)
        anyio.run(_one_batch, batcher, [_beat(f"c{i}", 4) for i in range(3)])  # c3: no beat
        moved = _beat("c2", 4).model_copy(update={"probe_url": "http://10.0.0.2:7070"})
        bodies = [_beat("c0", 4), _beat("c1", 6), moved, _beat("c3", 2), _beat("nope", 1)]
        results = anyio.run(_one_batch, batcher, bodies)
        assert [type(r).__name__ for r in results] == ["HeartbeatResult"] * 4 + ["NotFound"]
        changed = {r.cluster: r.changed_state for r in results if isinstance(r, HeartbeatResult)}
        assert changed == {"c0": False, "c1": False, "c2": True, "c3": True}
        assert _counts(sessions) == {"c0": 4, "c1": 6, "c2": 4, "c3": 2}
        assert set(_states(sessions).values()) == {"READY"}
        with sessions() as session:
            url = session.scalar(select(Cluster.probe_url).where(Cluster.name == "c2"))
        assert url == "http://10.0.0.2:7070"


def test_a_batch_past_one_renewal_statement_renews_every_cluster(db_url: str) -> None:
    """More beats than one renewal statement takes (`RENEW_CHUNK`), padded shapes included:
    every cluster's report is stored, none twice, none lost at a chunk's edge."""
    n = RENEW_CHUNK + 45
    with _sessions(db_url, n) as sessions:
        batcher = HeartbeatBatcher(sessions, POLICY, PeerTable(), workers=1, window_s=0)
        anyio.run(_one_batch, batcher, [_beat(f"c{i}", 2) for i in range(n)])  # -> READY
        again = [_beat(f"c{i}", 2).model_copy(update={"agent_version": f"v{i}"}) for i in range(n)]
        results = anyio.run(_one_batch, batcher, again)
        assert all(isinstance(r, HeartbeatResult) and not r.changed_state for r in results)
        with sessions() as session:
            versions = dict(session.execute(select(Cluster.name, Cluster.agent_version)).all())
        assert versions == {f"c{i}": f"v{i}" for i in range(n)}


def test_the_renewal_is_compiled_once_per_shape(db_url: str) -> None:
    """Batches of 5 and 7 beats share one padded shape: the second runs SQLAlchemy's cached
    compilation (a `values()` list with data has no cache key: compiled at every batch)."""
    with _sessions(db_url, 7) as sessions:
        batcher = HeartbeatBatcher(sessions, POLICY, PeerTable(), workers=1, window_s=0)
        bodies = [_beat(f"c{i}", 2) for i in range(7)]
        anyio.run(_one_batch, batcher, bodies)  # -> READY
        engine = sessions.kw["bind"]
        hits: list[object] = []

        def seen(*args: Any) -> None:
            if str(args[2]).lstrip().upper().startswith("WITH"):  # the renewal's CTE
                hits.append(args[4].cache_hit)

        event.listen(engine, "before_cursor_execute", seen)
        try:
            anyio.run(_one_batch, batcher, bodies[:5])
            anyio.run(_one_batch, batcher, bodies)
        finally:
            event.remove(engine, "before_cursor_execute", seen)
        assert len(hits) == 2
        assert hits[1] == CacheStats.CACHE_HIT, hits
        assert _counts(sessions) == {f"c{i}": 2 for i in range(7)}
