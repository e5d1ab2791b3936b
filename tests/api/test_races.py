"""Races and load answer with problems, never a 500: a real server on SQLite and PostgreSQL.

Two creates of one tenant name (threads released by a barrier) give one 201 and one 409
naming the field; a write that loses a race inside the database (PostgreSQL, made certain by
holding a row lock until the server waits on it) gives 409, or 412 when the caller sent
If-Match; a server whose connection pool is exhausted answers 503 with Retry-After; cluster
labels the planner cannot read are refused when written, with a 422 naming the label.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import Connection, Engine, insert, text
from sqlalchemy.exc import IntegrityError

from api.problems import violation
from controller.store.db import is_sqlite, make_engine
from controller.store.models import Job, Tenant, utcnow
from tests.conftest import LiveServer, start_server

SPEC = {"name": "j", "task": "builtin:mnist1d-mlp", "gpus": 1, "steps": 100}


def _auth(live: LiveServer) -> dict[str, str]:
    return {"Authorization": f"Bearer {live.admin_token}"}


@pytest.fixture
def quiet_server(db_url: str) -> Iterator[LiveServer]:
    """A server without the controller's loops: only requests touch the database."""
    live = start_server(database_url=db_url, run_controller=False)
    yield live
    live.stop()


def _in_parallel(n: int, call: Callable[[httpx.Client], httpx.Response]) -> list[httpx.Response]:
    """`n` threads, each with its own connection, released together by a barrier."""
    barrier = threading.Barrier(n)
    out: list[httpx.Response] = []
    lock = threading.Lock()

    def one() -> None:
        with httpx.Client(timeout=60) as http:
            barrier.wait()
            r = call(http)
            with lock:
                out.append(r)

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_two_creates_of_one_tenant_name_give_one_201_and_one_409(quiet_server: LiveServer) -> None:
    live = quiet_server
    httpx.get(f"{live.url}/v1/tenants", headers=_auth(live)).raise_for_status()  # key cached
    for round_ in range(5):
        name = f"same-name-{round_}"
        responses = _in_parallel(
            2,
            lambda http, name=name: http.post(  # type: ignore[misc]
                f"{live.url}/v1/tenants", json={"name": name}, headers=_auth(live)
            ),
        )
        statuses = sorted(r.status_code for r in responses)
        assert statuses == [201, 409], [r.text for r in responses]
        conflict = next(r for r in responses if r.status_code == 409)
        assert conflict.headers["content-type"].startswith("application/problem+json")
        assert [e["field"] for e in conflict.json()["errors"]] == ["name"]
    listed = httpx.get(f"{live.url}/v1/tenants", headers=_auth(live)).json()
    assert sorted(t["name"] for t in listed["items"]) == [f"same-name-{i}" for i in range(5)]


# ---- losing a race inside the database (PostgreSQL: row locks make the order certain) -----


def _waits_on_a_lock(engine: Engine, table: str) -> None:
    """Return once another session of this database waits on a row lock in `table`."""
    done = threading.Event()
    for _ in range(3000):
        with engine.connect() as conn:
            waiting = conn.execute(
                text(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND wait_event_type = 'Lock' AND query ILIKE :q"
                ),
                {"q": f"%{table}%"},
            ).scalar_one()
        if waiting:
            return
        done.wait(0.01)
    raise AssertionError(f"no request came to wait on a lock in {table}")


def _request_in_thread(call: Callable[[], httpx.Response]) -> Callable[[], httpx.Response]:
    box: list[httpx.Response | BaseException] = []

    def run() -> None:
        try:
            box.append(call())
        except BaseException as exc:  # re-raised by the caller
            box.append(exc)

    thread = threading.Thread(target=run)
    thread.start()

    def result() -> httpx.Response:
        thread.join()
        got = box[0]
        if isinstance(got, BaseException):
            raise got
        return got

    return result


@pytest.fixture
def pg(quiet_server: LiveServer) -> Iterator[tuple[LiveServer, Engine]]:
    if is_sqlite(quiet_server.database_url):
        pytest.skip("row-lock choreography needs PostgreSQL; the barrier race runs on both")
    engine = make_engine(quiet_server.database_url)
    yield quiet_server, engine
    engine.dispose()


def test_a_unique_name_lost_inside_the_database_is_a_409_naming_the_field(
    pg: tuple[LiveServer, Engine],
) -> None:
    live, engine = pg
    httpx.get(f"{live.url}/v1/tenants", headers=_auth(live)).raise_for_status()
    with engine.connect() as holder:
        tx = holder.begin()
        holder.execute(insert(Tenant).values(id="held", name="contested"))
        result = _request_in_thread(
            lambda: httpx.post(
                f"{live.url}/v1/tenants", json={"name": "contested"}, headers=_auth(live)
            )
        )
        _waits_on_a_lock(engine, "tenants")  # passed the name check, waits on the unique key
        tx.commit()
    r = result()
    assert r.status_code == 409, r.text
    body = r.json()
    assert body["type"].endswith("/conflict") and [e["field"] for e in body["errors"]] == ["name"]
    assert "pick another name" in body["detail"]


def _job(conn: Connection) -> str:
    conn.execute(insert(Tenant).values(id="t1", name="acme"))
    conn.execute(
        insert(Job).values(
            id="j1",
            tenant_id="t1",
            name="j",
            spec=SPEC,
            state="PENDING",
            reason="",
            priority=0,
            qos_class="standard",
            preemptible=False,
            gpus_min=1,
            gpus_max=1,
            request_hash="",
            attempts=0,
            version=1,
        )
    )
    return "j1"


@pytest.mark.parametrize("if_match", [None, '"1"'], ids=["plain", "if-match"])
def test_a_cancel_that_loses_to_a_concurrent_write_is_409_or_412(
    pg: tuple[LiveServer, Engine], if_match: str | None
) -> None:
    live, engine = pg
    httpx.get(f"{live.url}/v1/tenants", headers=_auth(live)).raise_for_status()
    with engine.begin() as conn:
        job_id = _job(conn)
    headers = _auth(live) | ({"If-Match": if_match} if if_match else {})
    with engine.connect() as holder:
        tx = holder.begin()  # the controller flushing progress: it bumps the job's version
        holder.execute(text("UPDATE jobs SET version = version + 1 WHERE id = :id"), {"id": job_id})
        result = _request_in_thread(
            lambda: httpx.post(f"{live.url}/v1/jobs/{job_id}/cancel", headers=headers)
        )
        _waits_on_a_lock(engine, "jobs")  # read version 1, now writes against it
        tx.commit()
    r = result()
    expected = 412 if if_match else 409
    assert r.status_code == expected, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    assert "GET it again and retry" in r.json()["detail"]
    with engine.connect() as conn:
        state = conn.execute(text("SELECT state FROM jobs WHERE id = :id"), {"id": job_id})
        assert state.scalar_one() == "PENDING"  # nothing half-done


# ---- load -----------------------------------------------------------------------------------


def test_an_exhausted_pool_answers_503_with_retry_after(db_url: str) -> None:
    live = start_server(
        database_url=db_url,
        run_controller=False,
        db_pool_size=1,
        db_max_overflow=0,
        db_pool_timeout_s=0.2,
    )
    try:
        ok = httpx.get(f"{live.url}/v1/tenants", headers=_auth(live))
        assert ok.status_code == 200  # the admin key is now cached: auth needs no connection
        app = live.server.config.app
        assert isinstance(app, FastAPI)
        engine: Engine = app.state.cpn.engine
        with engine.connect():  # a slow request holds the only connection
            r = httpx.get(f"{live.url}/v1/tenants", headers=_auth(live))
        assert r.status_code == 503, r.text
        assert r.headers["Retry-After"] == "1"
        assert r.headers["content-type"].startswith("application/problem+json")
        assert "retry" in r.json()["detail"]
        again = httpx.get(f"{live.url}/v1/tenants", headers=_auth(live))
        assert again.status_code == 200
    finally:
        live.stop()


def test_a_crowd_of_concurrent_requests_is_answered_not_stalled(db_url: str) -> None:
    """80 list requests at once against a pool of 2: each waits for a database slot on the
    event loop, so none waits out the pool timeout. Before the slots, worker threads waited
    for a connection while the requests holding the connections waited for a thread to
    validate their answers: nothing moved until the pool timeout, then 503s."""
    live = start_server(
        database_url=db_url,
        run_controller=False,
        db_pool_size=2,
        db_max_overflow=0,
        db_pool_timeout_s=10,
    )

    async def crowd(n: int) -> list[int]:
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
        async with httpx.AsyncClient(timeout=60, limits=limits) as http:
            answers = await asyncio.gather(
                *(http.get(f"{live.url}/v1/tenants", headers=_auth(live)) for _ in range(n))
            )
        return [r.status_code for r in answers]

    try:
        assert httpx.get(f"{live.url}/v1/tenants", headers=_auth(live)).status_code == 200
        statuses = asyncio.run(crowd(80))
        assert statuses == [200] * 80, sorted(set(statuses))
    finally:
        live.stop()


# ---- labels ---------------------------------------------------------------------------------


def test_labels_the_planner_reads_are_checked_when_written(quiet_server: LiveServer) -> None:
    live = quiet_server
    url = f"{live.url}/v1/clusters"
    bad = httpx.post(
        url,
        json={"name": "east", "region": "us", "labels": {"intra_bandwidth_gbps": "fast"}},
        headers=_auth(live),
    )
    assert bad.status_code == 422, bad.text
    assert [e["field"] for e in bad.json()["errors"]] == ["labels.intra_bandwidth_gbps"]
    assert "'fast'" in bad.json()["detail"]
    good = httpx.post(
        url,
        json={"name": "east", "region": "us", "labels": {"intra_bandwidth_gbps": "400"}},
        headers=_auth(live),
    )
    assert good.status_code == 201, good.text
    patch = httpx.patch(f"{url}/east", json={"labels": {"gpu_tflops": "-5"}}, headers=_auth(live))
    assert patch.status_code == 422
    assert [e["field"] for e in patch.json()["errors"]] == ["labels.gpu_tflops"]
    kept = httpx.get(f"{url}/east", headers=_auth(live)).json()
    assert kept["labels"] == {"intra_bandwidth_gbps": "400"}


# ---- what a refused write broke, read from each driver ---------------------------------------

GPU_ROW = (
    "INSERT INTO gpu_inventory (cluster_id, model, memory_gib, count, allocatable, in_use, "
    "missing, updated_at) VALUES (:cluster, 'A100', 80, 8, 8, :in_use, false, :now)"
)


def test_violations_name_what_was_broken(db_url: str) -> None:
    engine = make_engine(db_url)
    now = {"now": utcnow()}
    try:
        with engine.begin() as conn:
            conn.execute(
                text("INSERT INTO tenants (id, name, created_at) VALUES ('a', 'a', :now)"), now
            )
            conn.execute(
                text(
                    "INSERT INTO clusters (id, name, region, labels, state, cordoned, draining, "
                    "created_at, updated_at, version) "
                    "VALUES ('c', 'c', 'r', '{}', 'READY', false, false, :now, :now, 1)"
                ),
                now,
            )
        cases: list[
            tuple[str, dict[str, Any], tuple[str, str | None, tuple[str, ...] | None, str | None]]
        ] = [
            (
                "INSERT INTO tenants (id, name, created_at) VALUES ('b', 'a', :now)",
                {},
                ("unique", "tenants", ("name",), None),
            ),
            (
                GPU_ROW,
                {"cluster": "c", "in_use": -1},
                ("check", None, (), "ck_gpu_in_use_nonnegative"),
            ),
            (GPU_ROW, {"cluster": "gone", "in_use": 0}, ("foreign-key", None, None, None)),
        ]
        for sql, params, (kind, table, columns, constraint) in cases:
            with pytest.raises(IntegrityError) as exc, engine.begin() as conn:
                conn.execute(text(sql), {**now, **params})
            v = violation(exc.value)
            assert v.kind == kind, v
            if columns is not None:  # PostgreSQL names a foreign key's column, SQLite not
                assert v.columns == columns, v
            if table:
                assert v.table == table
            if constraint:
                assert v.constraint == constraint
    finally:
        engine.dispose()


def test_only_a_submission_near_the_queue_cap_waits_for_the_tenants_lock(db_url: str) -> None:
    """Far below CPN_MAX_QUEUED_JOBS a submission counts without the tenant's row lock (it
    would serialise all of a tenant's submissions); within CAP_SLACK of it, it takes the lock,
    so concurrent submissions there cannot overshoot the cap together."""
    from controller.jobs.service import CAP_SLACK
    from tests.service.conftest import build_network

    if is_sqlite(db_url):
        pytest.skip("row-lock choreography needs PostgreSQL")
    live = start_server(database_url=db_url, run_controller=False, max_queued_jobs=CAP_SLACK + 1)
    net = build_network(live)
    engine = make_engine(db_url)
    http = net.tenant._http
    try:
        with engine.connect() as holder:
            tx = holder.begin()
            holder.execute(
                text("SELECT id FROM tenants WHERE id = :id FOR NO KEY UPDATE"),
                {"id": net.tenant_id},
            )
            # 0 queued, CAP_SLACK + 1 allowed: answered while the lock is held.
            first = _request_in_thread(lambda: http.post("/v1/jobs", json=SPEC))()
            assert first.status_code == 201, first.text
            # 1 queued is within CAP_SLACK of the cap: this one waits for the lock.
            second = _request_in_thread(lambda: http.post("/v1/jobs", json=SPEC))
            _waits_on_a_lock(engine, "tenants")
            tx.commit()
        assert second().status_code == 201
    finally:
        engine.dispose()
        for c in (net.admin, net.tenant, net.other):
            c.close()
        live.stop()


def test_concurrent_submissions_at_the_cap_never_overshoot_it(db_url: str) -> None:
    from tests.service.conftest import build_network

    live = start_server(database_url=db_url, run_controller=False, max_queued_jobs=3)
    net = build_network(live)
    token = net.admin.create_api_key("tenant", net.tenant_id)["token"]
    try:
        responses = _in_parallel(
            10,
            lambda http: http.post(
                f"{live.url}/v1/jobs", json=SPEC, headers={"Authorization": f"Bearer {token}"}
            ),
        )
        assert sorted(r.status_code for r in responses) == [201] * 3 + [429] * 7
        listed = net.tenant.get("/v1/jobs", params={"state": "PENDING"})
        assert listed["total"] == 3
    finally:
        for c in (net.admin, net.tenant, net.other):
            c.close()
        live.stop()
