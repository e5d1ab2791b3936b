"""Console sessions without a browser: the pure store, and the cookie path over real HTTP."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest

from api.sessions import (
    CSRF_HEADER,
    SESSION_COOKIE,
    SESSION_TTL_S,
    ConsoleSession,
    ConsoleSessions,
    csrf_ok,
)
from controller.access.keys import hash_key
from tests.conftest import LiveServer, start_server


def _store(url: str, **kwargs: float) -> ConsoleSessions:
    from controller.store.db import make_engine, make_sessionmaker

    return ConsoleSessions(make_sessionmaker(make_engine(url)), **kwargs)  # type: ignore[arg-type]


T0 = datetime(2026, 1, 1, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def test_sessions_expire_and_a_keys_oldest_go_first(db_url: str) -> None:
    store = _store(db_url, ttl_s=10, max_per_key=2)
    a, first = store.open("h" * 64, now=at(0))
    assert store.get(a, now=at(9.9)) == first
    assert store.get(a, now=at(10)) is None  # expired
    b, _ = store.open("k" * 64, now=at(1))
    c, _ = store.open("k" * 64, now=at(2))
    d, _ = store.open("k" * 64, now=at(3))  # a third sign-in of one key ends its oldest
    assert store.get(b, now=at(4)) is None
    assert store.get(c, now=at(4)) and store.get(d, now=at(4))
    other, _ = store.open("o" * 64, now=at(4))  # and only that key's
    assert store.get(c, now=at(5)) and store.get(other, now=at(5))
    store.close(c)
    assert store.get(c, now=at(5)) is None and store.get(d, now=at(5))
    assert store.get(None, now=at(1)) is None and store.get("", now=at(1)) is None
    assert store.get("x" * 500, now=at(1)) is None


def test_the_table_holds_neither_the_cookie_nor_the_key(db_url: str) -> None:
    from sqlalchemy import select

    from controller.store.models import ConsoleSignIn

    store = _store(db_url)
    key_hash = hash_key("cpn_tenant_secret")
    sid, session = store.open(key_hash, now=at(0))
    with store.sessions() as db:
        rows = db.scalars(select(ConsoleSignIn)).all()
    assert [(r.key_hash, r.csrf) for r in rows] == [(key_hash, session.csrf)]
    assert rows[0].id != sid and sid not in rows[0].id
    # Expired sign-ins go when the next one opens: the table does not grow with old ones.
    store.open(key_hash, now=at(SESSION_TTL_S + 1))
    with store.sessions() as db:
        assert len(db.scalars(select(ConsoleSignIn)).all()) == 1


def test_only_reads_pass_without_the_csrf_token() -> None:
    session = ConsoleSession("h" * 64, "the-csrf-token", at(10))
    assert csrf_ok(session, "GET", None) and csrf_ok(session, "head", None)
    for method in ("POST", "PATCH", "DELETE", "PUT"):
        assert not csrf_ok(session, method, None)
        assert not csrf_ok(session, method, session.csrf[:-1])
        assert csrf_ok(session, method, session.csrf)


@pytest.fixture
def live(tmp_path: Path) -> Iterator[LiveServer]:
    from controller.store.migrate import upgrade

    url = f"sqlite:///{tmp_path / 'cpn.db'}"
    upgrade(url)
    server = start_server(database_url=url, run_controller=False, key_rate_limit=1)
    yield server
    server.stop()


@pytest.mark.slow
def test_a_console_session_over_http(live: LiveServer) -> None:
    with httpx.Client(base_url=live.url) as http:
        plain = http.post("/ui/session", json={"key": live.admin_token})
        assert plain.status_code == 401  # no page header: another site's form or fetch
        assert SESSION_COOKIE not in http.cookies
        bad = http.post("/ui/session", json={"key": "cpn_nope"}, headers={CSRF_HEADER: "x"})
        assert bad.status_code == 401 and bad.json()["errors"][0]["field"] == "key"
        ok = http.post("/ui/session", json={"key": live.admin_token}, headers={CSRF_HEADER: "x"})
        assert ok.status_code == 204
        cookie = ok.headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=strict" in cookie and "path=/" in cookie
        # The cookie spends the key's own rate limit (1 a second here, burst 2).
        codes = [http.get("/v1/tenants").status_code for _ in range(4)]
        assert 429 in codes and set(codes) <= {200, 429}
        # Signing out needs the page's token too, once signed in.
        assert http.post("/ui/session/end").status_code == 403


def test_a_refused_sign_in_says_when_to_retry_and_the_cookie_can_be_forced_secure(
    tmp_path: Path,
) -> None:
    """Issue 48: the console's 429 carries Retry-After like every 429 of the API, and behind
    a TLS-terminating proxy (requests arrive as http) CPN_COOKIE_SECURE marks the cookie."""
    from controller.store.migrate import upgrade

    url = f"sqlite:///{tmp_path / 'cpn.db'}"
    upgrade(url)
    server = start_server(
        database_url=url, run_controller=False, key_rate_limit=1, cookie_secure=True
    )
    try:
        with httpx.Client(base_url=server.url) as http:
            body, page = {"key": server.admin_token}, {CSRF_HEADER: "x"}
            ok = http.post("/ui/session", json=body, headers=page)
            assert ok.status_code == 204 and "secure" in ok.headers["set-cookie"].lower()
            answers = [http.post("/ui/session", json=body, headers=page) for _ in range(4)]
            limited = [a for a in answers if a.status_code == 429]
            assert limited, [a.status_code for a in answers]
            assert int(limited[0].headers["retry-after"]) >= 1
            assert limited[0].json()["errors"][0]["field"] == "key"
    finally:
        server.stop()


@pytest.mark.slow
def test_a_sign_in_holds_on_every_replica_and_a_sign_out_ends_it_everywhere(
    tmp_path: Path,
) -> None:
    """Two servers on one database stand for two workers of `cpn serve --workers` (or two
    replicas behind a balancer): a browser's requests may land on either."""
    import re

    from controller.store.migrate import upgrade

    url = f"sqlite:///{tmp_path / 'cpn.db'}"
    upgrade(url)
    one = start_server(database_url=url, run_controller=False)
    two = start_server(database_url=url, run_controller=False)
    try:
        with httpx.Client(base_url=one.url) as http:
            ok = http.post("/ui/session", json={"key": one.admin_token}, headers={CSRF_HEADER: "x"})
            assert ok.status_code == 204
            sid = http.cookies[SESSION_COOKIE]
        with httpx.Client(base_url=two.url, cookies={SESSION_COOKIE: sid}) as other:
            assert other.get("/v1/tenants").status_code == 200
            page = other.get("/ui/admin/tenants")
            assert page.status_code == 200
            found = re.search(r'<meta name="cpn-csrf" content="([^"]+)">', page.text)
            assert found is not None
            csrf = found.group(1)
            assert other.post("/v1/tenants", json={"name": "t1"}).status_code == 403  # no CSRF
            ended = other.post("/ui/session/end", headers={CSRF_HEADER: csrf})
            assert ended.status_code == 204
        with httpx.Client(base_url=one.url, cookies={SESSION_COOKIE: sid}) as http:
            assert http.get("/v1/tenants").status_code == 401
            assert http.get("/ui/jobs", follow_redirects=False).status_code == 303
    finally:
        one.stop()
        two.stop()
