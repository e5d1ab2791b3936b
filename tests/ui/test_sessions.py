"""Console sessions without a browser: the pure store, and the cookie path over real HTTP."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from api.ui.sessions import CSRF_HEADER, SESSION_COOKIE, ConsoleSessions, csrf_ok
from tests.conftest import LiveServer, start_server


def test_sessions_expire_and_the_oldest_go_first() -> None:
    store = ConsoleSessions(ttl_s=10, max_entries=2)
    a, first = store.open("cpn_a", now=0)
    assert store.get(a, now=9.9) == first
    assert store.get(a, now=10) is None  # expired, and forgotten
    b, _ = store.open("cpn_b", now=0)
    c, _ = store.open("cpn_c", now=0)
    d, _ = store.open("cpn_d", now=0)
    assert store.get(b, now=1) is None and store.get(c, now=1) and store.get(d, now=1)
    store.close(c)
    assert store.get(c, now=1) is None
    assert store.get(None, now=1) is None and store.get("", now=1) is None


def test_only_reads_pass_without_the_csrf_token() -> None:
    _, session = ConsoleSessions().open("cpn_a", now=0)
    assert csrf_ok(session, "GET", None) and csrf_ok(session, "head", None)
    for method in ("POST", "PATCH", "DELETE", "PUT"):
        assert not csrf_ok(session, method, None)
        assert not csrf_ok(session, method, session.csrf[:-1])
        assert csrf_ok(session, method, session.csrf)


@pytest.fixture
def live(tmp_path: Path) -> Iterator[LiveServer]:
    from controller.migrate import upgrade

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
