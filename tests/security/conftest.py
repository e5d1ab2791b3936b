"""The security suite's world: one live control plane per backend, two tenants and their objects.

One server per backend serves the whole folder (package scope): the checks only read, or are
refused, so they share it. Tests that must break something get a `fresh` server of their own.
Every request goes through `call`, which never reads an event stream it did not expect (a
stream of a job that never ends would hang the test) and closes its connection (a 500 makes
uvicorn drop a kept-alive one, which would fail the next request for the wrong reason).
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Collection, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy.orm import Session

from controller.store.db import make_engine, scratch_database
from controller.store.migrate import upgrade
from controller.store.models import JobEvent, JobMetric, LedgerEntry, Usage
from tests.conftest import LiveServer, start_server
from tests.service.conftest import build_network, spec

PROBLEM = "application/problem+json"
BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
A_MARK = "acme-only-5f1c"
"""Text in tenant A's seeded rows: it must never reach tenant B."""
B_MARK = "globex-only-9d2e"


# ---- talking to the server ------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    """One response, read (or, for an event stream, only its head)."""

    method: str
    path: str
    status: int
    headers: httpx.Headers
    content_type: str
    body: Any
    text: str

    def __str__(self) -> str:
        return f"{self.method} {self.path} -> {self.status} {self.content_type} {self.text[:300]}"


def call(
    http: httpx.Client,
    method: str,
    path: str,
    token: str | None = None,
    *,
    json: Any = None,
    content: Any = None,
    headers: Mapping[str, str] | None = None,
    params: Mapping[str, Any] | None = None,
) -> Answer:
    """Send one request; `token` becomes a bearer header unless `headers` has Authorization.

    `json` is the body (None: no body); `content` sends raw bytes instead."""
    sent = {"Connection": "close", **(headers or {})}
    if token is not None and "Authorization" not in sent:
        sent["Authorization"] = f"Bearer {token}"
    kwargs: dict[str, Any] = {"headers": sent, "params": params}
    if json is not None:
        kwargs["json"] = json
    elif content is not None:
        kwargs["content"] = content
    with http.stream(method, path, **kwargs) as r:
        ctype = r.headers.get("content-type", "").split(";")[0].strip()
        if ctype == "text/event-stream":
            return Answer(method, path, r.status_code, r.headers, ctype, None, "<event stream>")
        r.read()
        try:
            body = r.json()
        except ValueError:
            body = None
        return Answer(method, path, r.status_code, r.headers, ctype, body, r.text)


def names_field(answer: Answer, name: str) -> bool:
    """Whether the problem's `errors` name `name`: a dotted path, its last parts, or a place
    inside it (`args.task.x` names `args.task`)."""
    body = answer.body if isinstance(answer.body, dict) else {}
    wanted = name.lower()
    for error in body.get("errors") or []:
        got = str(error.get("field", "")).lower()
        if got == wanted or got.endswith("." + wanted) or got.startswith(wanted + "."):
            return True
    return False


def problem_issues(
    answer: Answer, statuses: Collection[int], field: str | None = None
) -> list[str]:
    """What makes `answer` not an RFC 9457 problem with one of `statuses` (empty: it is one)."""
    issues = []
    if answer.status not in statuses:
        issues.append(f"status {answer.status}, wanted {sorted(statuses)}")
    if answer.content_type != PROBLEM:
        issues.append(f"content-type {answer.content_type!r}, wanted {PROBLEM}")
    body = answer.body if isinstance(answer.body, dict) else {}
    for key, kind in (("type", str), ("title", str), ("status", int), ("detail", str)):
        if not isinstance(body.get(key), kind) or body.get(key) in ("", None):
            issues.append(f"no {key!r} member")
    if isinstance(body.get("status"), int) and body["status"] != answer.status:
        issues.append(f"body status {body['status']} != HTTP {answer.status}")
    if field is not None and not names_field(answer, field):
        issues.append(f"errors do not name {field!r}")
    return issues


def assert_problem(answer: Answer, *statuses: int, field: str | None = None) -> None:
    issues = problem_issues(answer, statuses, field)
    assert not issues, f"{answer}: {'; '.join(issues)}"


# ---- server logs ----------------------------------------------------------------------------


@pytest.fixture(scope="package", autouse=True)
def _one_line_server_errors() -> Iterator[None]:
    """Server threads log an error as one line (its exception's type and message) here, not
    with a traceback.

    CPython 3.11 keeps one AST-converter recursion counter for all threads (python/cpython
    #106905), and its traceback formatting parses source lines for the ^^^ marks. The xfail
    checks make the server (threads of the test process) log 500s while pytest renders those
    failures in the main thread: the two parses race, and pytest stops with
    `INTERNALERROR SystemError: AST constructor recursion depth mismatch`."""
    make_record = logging.getLogRecordFactory()

    def one_line(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = make_record(*args, **kwargs)
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None and threading.current_thread() is not threading.main_thread():
            record.msg = f"{record.getMessage().strip()}: {type(exc).__name__}: {exc}"
            record.args = None
            record.exc_info = None
        return record

    logging.setLogRecordFactory(one_line)
    yield
    logging.setLogRecordFactory(make_record)


# ---- the world ------------------------------------------------------------------------------


@dataclass(frozen=True)
class World:
    """A live server on one backend and the objects the checks point at (ids and keys)."""

    backend: str
    url: str
    database_url: str
    max_body_bytes: int
    openapi: dict[str, Any]
    app: FastAPI
    admin: str
    tenant_a: str
    tenant_b: str
    agent_x: str
    agent_y: str
    revoked: Mapping[str, str]
    expiring: Mapping[str, str]
    expiry: datetime | None
    tenant_a_id: str
    tenant_b_id: str
    tenant_a_key_id: str
    job_a: str
    job_a_ended: str
    job_b: str
    quote_a: str
    quote_b: str
    victim_cluster: str
    victim_link: str
    victim_tenant: str
    victim_key: str
    provider_p: str
    provider_q: str
    provider_p_id: str
    provider_q_id: str
    cluster_x: str = "us-east"
    cluster_y: str = "eu-west"

    def token(self, role: str) -> str:
        """A live key of `role`: tenant A's for tenant, cluster X's for agent, provider P's
        for provider."""
        return {
            "admin": self.admin,
            "tenant": self.tenant_a,
            "agent": self.agent_x,
            "provider": self.provider_p,
        }[role]

    def path_values(self) -> dict[str, str]:
        """Real objects for every path parameter, so a check reaches auth and not a 404."""
        return {
            "name": self.victim_cluster,
            "link_id": self.victim_link,
            "tenant_id": self.tenant_a_id,
            "key_id": self.victim_key,
            "job_id": self.job_a,
            "quote_id": self.quote_a,
            "provider_id": self.provider_p_id,
        }


UNLIMITED = {
    "key_rate_limit": 0,
    "agent_rate_limit": 0,
    "auth_fail_limit": 0,
    "quote_rate_limit": 0,
    "max_streams_per_key": 10_000,
}
"""Rate limits and stream caps off: the sweeps send hundreds of requests a second with one key
and many bad keys from one address, which is what the limits are for. They have their own
checks (test_rate_limits.py, test_streams.py)."""
TASK_PREFIX = "cpnsec"
"""The one module prefix the world admits for `module:function` tasks (CPN_TASK_MODULES): the
control plane never imports them, and only such tasks take free-form arguments."""


def module_job(**overrides: Any) -> dict[str, Any]:
    """A job of a `module:function` task under TASK_PREFIX, with its own `work`."""
    body: dict[str, Any] = spec(
        task=f"{TASK_PREFIX}.tasks:main", work={"params": 1_000_000, "flops_per_step": 1e12}
    )
    body.update(overrides)
    return body


def _serve(database_url: str) -> LiveServer:
    settings: dict[str, Any] = {**UNLIMITED, "task_modules": TASK_PREFIX}
    return start_server(database_url=database_url, run_controller=False, **settings)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _pg_server(backend: str, request: pytest.FixtureRequest) -> str | None:
    """The PostgreSQL server for `backend` (None for SQLite); skips, or fails in CI, without one."""
    return str(request.getfixturevalue("pg_server_url")) if backend == "postgres" else None


@contextmanager
def _database(pg_server: str | None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A migrated database of its own (so no other test's clean-up touches it): a SQLite file,
    or a scratch database on `pg_server`."""
    if pg_server is None:
        url = f"sqlite:///{tmp_path_factory.mktemp('security') / 'cpn.db'}"
        upgrade(url)
        yield url
        return
    with scratch_database(pg_server, "cpn_security") as url:
        upgrade(url)
        yield url


def _ok(answer: Answer, *statuses: int) -> Any:
    assert answer.status in statuses, str(answer)
    return answer.body


def _seed_accounts(database_url: str, rows: list[tuple[str, str, str, int]]) -> None:
    """Progress, metrics, usage and a ledger entry per (tenant, job, mark, quantity): what a
    finished run leaves, written to the real database (no run is needed to check who sees it)."""
    engine = make_engine(database_url)
    start = datetime.now(UTC) - timedelta(hours=1)
    end = start + timedelta(minutes=30)
    try:
        with Session(engine) as session, session.begin():
            for tenant_id, job_id, mark, qty in rows:
                session.add(
                    JobEvent(
                        job_id=job_id, kind="progress", message=f"{mark} step 1", data={"m": mark}
                    )
                )
                session.add(JobMetric(job_id=job_id, step=1, loss=qty / 1000, wan_bytes=qty))
                usage = Usage(
                    tenant_id=tenant_id,
                    job_id=job_id,
                    kind="gpu_seconds",
                    cluster="us-east",
                    gpu_model="A100",
                    qos_class="standard",
                    quantity=Decimal(qty),
                    period_start=start,
                    period_end=end,
                    priced=True,
                )
                session.add(usage)
                session.flush()
                session.add(
                    LedgerEntry(
                        tenant_id=tenant_id,
                        job_id=job_id,
                        usage_id=usage.id,
                        kind="gpu",
                        description=mark,
                        quantity=Decimal(qty) / 3600,
                        unit_price=Decimal("2.5"),
                        amount=Decimal(qty) / 1000,
                        period_start=start,
                        period_end=end,
                    )
                )
    finally:
        engine.dispose()


def _expiring_keys(
    http: httpx.Client, admin: str, tenant_id: str, provider_id: str
) -> tuple[dict[str, str], datetime | None]:
    """A key per role that expires a few seconds from now (used once, so it is cached as live),
    where keys can carry an expiry (issue 14, item 6); none where they cannot yet."""
    schema = call(http, "GET", "/openapi.json").body["components"]["schemas"]["ApiKeyIn"]
    if "expires_at" not in schema.get("properties", {}):
        return {}, None
    expiry = datetime.now(UTC) + timedelta(seconds=3)
    keys = {}
    for role, scope, probe in (
        ("admin", None, ("GET", "/v1/clusters")),
        ("tenant", tenant_id, ("GET", "/v1/jobs")),
        ("agent", "us-east", ("GET", "/v1/pricing")),
        ("provider", provider_id, ("GET", "/v1/pricing")),
    ):
        body = {"role": role, "scope": scope, "expires_at": expiry.isoformat()}
        keys[role] = _ok(call(http, "POST", "/v1/api-keys", admin, json=body), 201)["token"]
        _ok(call(http, *probe, keys[role]), 200)
    return keys, expiry


def _build(live: LiveServer, backend: str, http: httpx.Client) -> World:
    net = build_network(live)  # three priced clusters with agents' GPUs, tenants acme and globex
    admin = live.admin_token
    for client in (net.admin, net.tenant, net.other):
        client.close()

    def mint(role: str, scope: str | None) -> dict[str, Any]:
        body = {"role": role, "scope": scope, "name": f"security {role}"}
        return dict(_ok(call(http, "POST", "/v1/api-keys", admin, json=body), 201))

    a_key = mint("tenant", net.tenant_id)
    tenant_a, tenant_b = a_key["token"], mint("tenant", net.other_tenant_id)["token"]
    agent_x, agent_y = mint("agent", "us-east")["token"], mint("agent", "eu-west")["token"]

    _ok(
        call(http, "POST", "/v1/clusters", admin, json={"name": "victim", "region": "nowhere"}), 201
    )
    link = {"src": "us-east", "dst": "victim", "bandwidth_gbps": 1, "rtt_ms": 10}
    victim_link = _ok(
        call(http, "POST", "/v1/links", admin, json={**link, "symmetric": False}), 201
    )
    victim_tenant = _ok(call(http, "POST", "/v1/tenants", admin, json={"name": "victim"}), 201)
    victim_key = mint("agent", "victim")
    providers = {}
    for name in ("prov-p", "prov-q"):
        _ok(call(http, "POST", "/v1/clusters", admin, json={"name": name, "region": "r"}), 201)
        body = {"name": name, "clusters": [name]}
        providers[name] = _ok(call(http, "POST", "/v1/providers", admin, json=body), 201)["id"]
    provider_p = mint("provider", providers["prov-p"])["token"]
    provider_q = mint("provider", providers["prov-q"])["token"]

    revoked = {}
    for role, scope, probe in (
        ("admin", None, ("GET", "/v1/clusters")),
        ("tenant", net.tenant_id, ("GET", "/v1/jobs")),
        ("agent", "us-east", ("GET", "/v1/pricing")),
        ("provider", providers["prov-p"], ("GET", "/v1/pricing")),
    ):
        key = mint(role, scope)
        _ok(call(http, *probe, key["token"]), 200)  # cached as live before it is revoked
        _ok(call(http, "DELETE", f"/v1/api-keys/{key['id']}", admin), 200)
        revoked[role] = key["token"]

    expiring, expiry = _expiring_keys(http, admin, net.tenant_id, providers["prov-p"])
    quote_a = _ok(call(http, "POST", "/v1/quotes", tenant_a, json=spec()), 201)["id"]
    job_a = _ok(call(http, "POST", "/v1/jobs", tenant_a, json=spec(name="acme-run")), 201)["id"]
    ended = _ok(call(http, "POST", "/v1/jobs", tenant_a, json=spec(name="acme-ended")), 201)["id"]
    _ok(call(http, "POST", f"/v1/jobs/{ended}/cancel", tenant_a), 200)
    job_b = _ok(call(http, "POST", "/v1/jobs", tenant_b, json=spec(name="globex-run")), 201)["id"]
    quote_b = _ok(call(http, "POST", "/v1/quotes", tenant_b, json=spec()), 201)["id"]
    _seed_accounts(
        live.database_url,
        [(net.tenant_id, job_a, A_MARK, 111), (net.other_tenant_id, job_b, B_MARK, 222)],
    )
    app: FastAPI = live.server.config.app  # type: ignore[assignment]  # what start_server served
    return World(
        backend=backend,
        url=live.url,
        database_url=live.database_url,
        max_body_bytes=app.state.cpn.settings.max_body_bytes,
        openapi=_ok(call(http, "GET", "/openapi.json"), 200),
        app=app,
        admin=admin,
        tenant_a=tenant_a,
        tenant_b=tenant_b,
        agent_x=agent_x,
        agent_y=agent_y,
        revoked=revoked,
        expiring=expiring,
        expiry=expiry,
        tenant_a_id=net.tenant_id,
        tenant_b_id=net.other_tenant_id,
        tenant_a_key_id=a_key["id"],
        job_a=job_a,
        job_a_ended=ended,
        job_b=job_b,
        quote_a=quote_a,
        quote_b=quote_b,
        victim_cluster="victim",
        victim_link=victim_link[0]["id"],
        victim_tenant=victim_tenant["id"],
        victim_key=victim_key["id"],
        provider_p=provider_p,
        provider_q=provider_q,
        provider_p_id=providers["prov-p"],
        provider_q_id=providers["prov-q"],
    )


class _Worlds:
    """One world per backend, built on first use and kept for the whole folder: tests of other
    files here switch backends in between (their own fixtures' order), and a world is the
    slow part (a priced network, keys, jobs)."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self._tmp = tmp_path_factory
        self._stack = ExitStack()
        self._built: dict[str, World] = {}

    def get(self, backend: str, pg_server: str | None) -> World:
        if backend not in self._built:
            url = self._stack.enter_context(_database(pg_server, self._tmp))
            live = _serve(url)
            self._stack.callback(live.stop)
            http = self._stack.enter_context(httpx.Client(base_url=live.url, timeout=30))
            self._built[backend] = _build(live, backend, http)
        return self._built[backend]

    def close(self) -> None:
        self._stack.close()


@pytest.fixture(scope="package")
def _worlds(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Worlds]:
    worlds = _Worlds(tmp_path_factory)
    try:
        yield worlds
    finally:
        worlds.close()


@pytest.fixture
def world(backend: str, request: pytest.FixtureRequest, _worlds: _Worlds) -> World:
    return _worlds.get(backend, _pg_server(backend, request))


@pytest.fixture
def http(world: World) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=world.url, timeout=30) as client:
        yield client


@dataclass(frozen=True)
class Fresh:
    """A server of one test's own (the same priced network, tenant acme), for checks that leave
    the database broken or changed."""

    url: str
    admin: str
    tenant: str
    tenant_id: str


@pytest.fixture
def fresh(
    backend: str, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Fresh]:
    with _database(_pg_server(backend, request), tmp_path_factory) as url:
        live = _serve(url)
        try:
            net = build_network(live)
            for client in (net.admin, net.tenant, net.other):
                client.close()
            with httpx.Client(base_url=live.url, timeout=30) as http:
                body = {"role": "tenant", "scope": net.tenant_id}
                key = _ok(call(http, "POST", "/v1/api-keys", live.admin_token, json=body), 201)
            yield Fresh(live.url, live.admin_token, key["token"], net.tenant_id)
        finally:
            live.stop()


def unknown_id() -> str:
    return str(uuid.uuid4())
