"""API keys (issue 14, item 6): the admin token's length, short prefixes, the generated admin
key's file, rotation, a deleted cluster's agent keys, expiry, failed authentications.

Live servers are the real app under uvicorn on each backend (in this process when the check
reads the app, as `cpn serve` subprocesses when it reads the process's output or exit).
"""

from __future__ import annotations

import os
import re
import socket
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from sqlalchemy import select, text
from sqlalchemy.orm import Session

from api.app import create_app
from api.config import MIN_ADMIN_TOKEN_CHARS, Settings
from api.deps import FailureAudit
from api.processes import start_control_plane, wait_until
from controller.access import keys
from controller.store.db import make_engine, scratch_database
from controller.store.migrate import upgrade
from controller.store.models import ApiKey, AuditLog
from tests.conftest import ADMIN_TOKEN
from tests.security.conftest import assert_problem, call

NEW_TOKEN = "cpn_admin_rotated-" + "r" * 32
BEAT = {"cluster": "phoenix", "gpus": []}


@contextmanager
def serving(database_url: str, token: str | None = ADMIN_TOKEN, **kw: Any) -> Iterator[str]:
    """The app under uvicorn in a thread, with `token` as CPN_ADMIN_TOKEN; yields its URL."""
    settings = Settings(database_url=database_url, admin_token=token, run_controller=False, **kw)
    server = uvicorn.Server(uvicorn.Config(create_app(settings), log_level="warning"))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started or not thread.is_alive(), 30, "uvicorn to start")
        assert server.started, "uvicorn did not start"
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)


def _rows(database_url: str) -> list[ApiKey]:
    engine = make_engine(database_url)
    try:
        with Session(engine) as session:
            return list(session.scalars(select(ApiKey).order_by(ApiKey.created_at)))
    finally:
        engine.dispose()


def _audit(database_url: str, action: str) -> list[AuditLog]:
    engine = make_engine(database_url)
    try:
        with Session(engine) as session:
            return list(
                session.scalars(
                    select(AuditLog).where(AuditLog.action == action).order_by(AuditLog.id)
                )
            )
    finally:
        engine.dispose()


# ---- the admin token ------------------------------------------------------------------------


def test_a_short_admin_token_is_refused_at_start_in_one_line(tmp_path: Path) -> None:
    short = "short-but-secret-" + "x" * 10  # 27 characters
    env = {
        **os.environ,
        "CPN_ADMIN_TOKEN": short,
        "CPN_DATABASE_URL": f"sqlite:///{tmp_path / 'cpn.db'}",
    }
    done = subprocess.run(
        [sys.executable, "-m", "api.cli", "serve", "--port", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "CPN_ADMIN_TOKEN" in lines[0] and str(MIN_ADMIN_TOKEN_CHARS) in lines[0]
    assert short not in done.stderr + done.stdout
    with pytest.raises(ValueError, match="CPN_ADMIN_TOKEN"):
        create_app(Settings(database_url=env["CPN_DATABASE_URL"], admin_token=short))
    assert len(ADMIN_TOKEN) >= MIN_ADMIN_TOKEN_CHARS  # the suite's own key passes


def test_a_generated_admin_key_is_written_to_an_owner_only_file_not_the_log(
    db_url: str, tmp_path: Path
) -> None:
    path = tmp_path / "secrets" / "admin-token"  # no admin key in the database yet
    plane = start_control_plane(
        db_url,
        "",  # unset: generate one
        settings={"CPN_ADMIN_TOKEN_FILE": str(path), "CPN_RUN_CONTROLLER": "false"},
        migrate=False,
    )
    try:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        token = path.read_text().strip()
        assert token.startswith("cpn_admin_")
        answer = httpx.get(f"{plane.url}/v1/clusters", headers={"Authorization": f"Bearer {token}"})
        assert answer.status_code == 200
        log = "\n".join(plane.proc.lines)
        assert token not in log
        assert token[10:30] not in log
        assert str(path) in log
        (row,) = _rows(db_url)
        assert row.prefix == token[len("cpn_admin_") :][:8]
    finally:
        plane.proc.stop()


# ---- prefixes ------------------------------------------------------------------------------


def test_stored_prefixes_are_at_most_8_characters_and_none_of_the_env_token(db_url: str) -> None:
    with serving(db_url) as url, httpx.Client(base_url=url, timeout=30) as http:
        tenant = call(http, "POST", "/v1/tenants", ADMIN_TOKEN, json={"name": "p"}).body
        call(http, "POST", "/v1/clusters", ADMIN_TOKEN, json={"name": "px", "region": "r"})
        minted = {}
        for role, scope in (("admin", None), ("tenant", tenant["id"]), ("agent", "px")):
            body = {"role": role, "scope": scope}
            created = call(http, "POST", "/v1/api-keys", ADMIN_TOKEN, json=body).body
            minted[created["id"]] = (role, created["token"])
            assert created["prefix"] == created["token"][len(f"cpn_{role}_") :][:8]
        listed = call(http, "GET", "/v1/api-keys", ADMIN_TOKEN).body["items"]
    assert {k["id"] for k in listed} >= set(minted)
    for key in listed:
        assert len(key["prefix"]) <= 8
        if key["id"] in minted:
            role, token = minted[key["id"]]
            assert len(key["prefix"]) == 8 and key["prefix"] in token
        else:  # the CPN_ADMIN_TOKEN key: nothing of it is kept
            assert key["name"] == keys.ENV_KEY_NAME and key["prefix"] == ""
    assert all(len(row.prefix) <= 8 for row in _rows(db_url))


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_the_migration_cuts_stored_prefixes(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Rows written before 0007 (12 characters of every token) keep at most 8 characters of a
    minted key's random part, and nothing of the environment's key."""
    if kind == "sqlite":
        _cut_prefixes(f"sqlite:///{tmp_path / 'old.db'}")
        return
    server = request.getfixturevalue("pg_server_url")  # skips without PostgreSQL
    with scratch_database(server, "cpn_keys") as url:
        _cut_prefixes(url)


def _cut_prefixes(url: str) -> None:
    upgrade(url, "0006")
    rows = [
        ("env", "CPN_ADMIN_TOKEN", "admin", "short-secret"),  # a short env token, whole
        ("minted", "ops", "tenant", "cpn_tenant_A"),
        ("other", "bench", "agent", "cpn_agent_be"),
        ("foreign", "x", "agent", "somethingelse"),
    ]
    engine = make_engine(url)
    with engine.begin() as conn:
        for key_id, name, role, prefix in rows:
            conn.execute(
                text(
                    "INSERT INTO api_keys (id, name, key_hash, prefix, role, created_at) "
                    "VALUES (:id, :name, :hash, :prefix, :role, :at)"
                ),
                {
                    "id": key_id,
                    "name": name,
                    "hash": key_id.ljust(64, "0"),
                    "prefix": prefix,
                    "role": role,
                    "at": datetime.now(UTC),
                },
            )
    engine.dispose()
    upgrade(url)
    got = {r.id: (r.prefix, r.from_env) for r in _rows(url)}
    assert got == {
        "env": ("", True),
        "minted": ("A", False),
        "other": ("be", False),
        "foreign": ("", False),
    }


# ---- rotation -------------------------------------------------------------------------------


def test_rotating_the_env_token_revokes_the_key_it_replaced(db_url: str) -> None:
    with serving(db_url) as url, httpx.Client(base_url=url, timeout=30) as http:
        body = {"role": "admin", "name": "a person's key"}
        minted = call(http, "POST", "/v1/api-keys", ADMIN_TOKEN, json=body).body
    with serving(db_url, NEW_TOKEN) as url, httpx.Client(base_url=url, timeout=30) as http:
        assert_problem(call(http, "GET", "/v1/clusters", ADMIN_TOKEN), 401)
        assert call(http, "GET", "/v1/clusters", NEW_TOKEN).status == 200
        assert call(http, "GET", "/v1/clusters", minted["token"]).status == 200  # not env's
    by_hash = {r.key_hash: r for r in _rows(db_url)}
    old, new = by_hash[keys.hash_key(ADMIN_TOKEN)], by_hash[keys.hash_key(NEW_TOKEN)]
    assert old.revoked_at is not None and new.revoked_at is None
    assert new.from_env and new.prefix == ""
    assert [a.target_id for a in _audit(db_url, "key.revoke")] == [old.id]
    with serving(db_url, NEW_TOKEN) as url, httpx.Client(base_url=url, timeout=30) as http:
        assert call(http, "GET", "/v1/clusters", NEW_TOKEN).status == 200  # a restart keeps it
        assert_problem(call(http, "GET", "/v1/clusters", ADMIN_TOKEN), 401)


# ---- a deleted cluster's agent keys ---------------------------------------------------------


def test_deleting_a_cluster_revokes_its_agent_keys(db_url: str) -> None:
    cluster = {"name": "phoenix", "region": "r1"}
    with serving(db_url) as url, httpx.Client(base_url=url, timeout=30) as http:
        assert call(http, "POST", "/v1/clusters", ADMIN_TOKEN, json=cluster).status == 201
        body = {"role": "agent", "scope": "phoenix"}
        key = call(http, "POST", "/v1/api-keys", ADMIN_TOKEN, json=body).body
        assert call(http, "POST", "/v1/agent/heartbeat", key["token"], json=BEAT).status == 200
        assert call(http, "DELETE", "/v1/clusters/phoenix", ADMIN_TOKEN).status == 204
        assert call(http, "POST", "/v1/clusters", ADMIN_TOKEN, json=cluster).status == 201
        assert_problem(call(http, "POST", "/v1/agent/heartbeat", key["token"], json=BEAT), 401)
        listed = call(http, "GET", "/v1/api-keys", ADMIN_TOKEN, params={"role": "agent"})
        (row,) = [k for k in listed.body["items"] if k["id"] == key["id"]]
        assert row["revoked_at"] is not None
    (deleted,) = _audit(db_url, "cluster.delete")
    assert deleted.detail["revoked_keys"] == [key["id"]]


# ---- expiry ---------------------------------------------------------------------------------


def test_an_expired_key_is_a_401_like_a_revoked_one(db_url: str) -> None:
    with serving(db_url) as url, httpx.Client(base_url=url, timeout=30) as http:
        tenant = call(http, "POST", "/v1/tenants", ADMIN_TOKEN, json={"name": "t"}).body
        expires = datetime.now(UTC) + timedelta(seconds=2)
        body = {"role": "tenant", "scope": tenant["id"], "expires_at": expires.isoformat()}
        key = call(http, "POST", "/v1/api-keys", ADMIN_TOKEN, json=body).body
        assert datetime.fromisoformat(key["expires_at"]) == expires
        assert call(http, "GET", "/v1/jobs", key["token"]).status == 200  # live, and cached
        wait_until(lambda: datetime.now(UTC) > expires, 30, "the key's expiry")
        refused = call(http, "GET", "/v1/jobs", key["token"])
        assert_problem(refused, 401)
        assert refused.headers["www-authenticate"].startswith("Bearer")


@pytest.mark.parametrize(
    "expires_at",
    [
        (datetime.now(UTC) - timedelta(minutes=1)).isoformat(),  # in the past
        "2999-01-01T00:00:00",  # no UTC offset
        "tomorrow",
    ],
    ids=["past", "no-utc-offset", "not-a-date"],  # stable ids: xdist workers must agree
)
def test_a_bad_expiry_is_a_422_naming_expires_at(db_url: str, expires_at: str) -> None:
    with serving(db_url) as url, httpx.Client(base_url=url, timeout=30) as http:
        body = {"role": "admin", "expires_at": expires_at}
        assert_problem(
            call(http, "POST", "/v1/api-keys", ADMIN_TOKEN, json=body), 422, field="expires_at"
        )


# ---- failed authentications -----------------------------------------------------------------


def _failures(http: httpx.Client) -> float:
    text_ = http.get("/metrics").text
    match = re.search(r'^cpn_auth_failures_total\{reason="rejected"\} (\S+)$', text_, re.M)
    return float(match.group(1)) if match else 0.0


def test_failed_authentications_are_counted_and_audited_once_a_minute(db_url: str) -> None:
    with serving(db_url) as url, httpx.Client(base_url=url, timeout=30) as http:
        before = _failures(http)
        for i in range(5):
            junk = f"cpn_tenant_junk-{i}-" + "j" * 30
            assert_problem(call(http, "GET", "/v1/jobs", junk), 401)
        assert _failures(http) - before == 5
        audited = call(http, "GET", "/v1/audit", ADMIN_TOKEN).body["items"]
    fails = [a for a in audited if a["action"] == "auth.fail"]
    assert len(fails) == 1, fails
    assert fails[0]["target_type"] == "client" and fails[0]["target_id"] == "127.0.0.1"
    assert fails[0]["actor_key_id"] is None
    assert "junk" not in str(fails[0])  # no key text in the log


def test_the_failure_audit_writes_one_row_per_address_a_minute_with_the_count() -> None:
    audit = FailureAudit(period_s=60.0, max_entries=2)
    assert audit.record("10.0.0.1", 0.0) == 1
    assert [audit.record("10.0.0.1", t) for t in (1.0, 30.0, 59.9)] == [None] * 3
    assert audit.record("10.0.0.2", 10.0) == 1  # another address has its own minute
    assert audit.record("10.0.0.1", 60.0) == 4  # this one and the three held back
    assert audit.record("10.0.0.1", 61.0) is None
    audit.record("10.0.0.3", 62.0)  # a third address evicts the least recent one
    assert audit.record("10.0.0.2", 63.0) == 1
