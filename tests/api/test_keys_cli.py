"""`cpn admin keys create|list|revoke` against a real server (SQLite; the key endpoints under
it are tested on both backends in tests/security)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import httpx
import pytest

from tests.api.test_apply import CliRun, one_line
from tests.conftest import LiveServer, start_server

pytestmark = pytest.mark.parametrize("migrated_url", ["sqlite"], indirect=True)


@pytest.fixture(scope="module")
def server(migrated_url: str) -> Iterator[LiveServer]:
    live = start_server(database_url=migrated_url, run_controller=False)
    yield live
    live.stop()


@pytest.fixture
def cpn(
    server: LiveServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> CliRun:
    monkeypatch.setenv("CPN_URL", server.url)
    monkeypatch.setenv("CPN_TOKEN", server.admin_token)
    monkeypatch.setenv("COLUMNS", "250")
    return CliRun(capsys)


def status_with(server: LiveServer, token: str) -> int:
    r = httpx.get(f"{server.url}/v1/jobs", headers={"Authorization": f"Bearer {token}"})
    return r.status_code


def test_create_shows_the_token_once_list_hides_it_revoke_stops_it(
    cpn: CliRun, server: LiveServer
) -> None:
    name = f"acme-{uuid.uuid4().hex[:6]}"
    with server.client() as admin:
        tenant = admin.post("/v1/tenants", {"name": name})
    made = cpn("admin", "keys", "create", "--role", "tenant", "--scope", name, "--name", "ci")
    assert made.code == 0, made.err
    token = next(
        line.removeprefix("token: ") for line in made.out.splitlines() if line.startswith("token:")
    )
    assert token.startswith("cpn_tenant_") and "shown once" in made.out
    assert status_with(server, token) == 200  # the tenant's name was resolved to its id

    listed = cpn("admin", "keys", "list", "--role", "tenant", "--json")
    assert listed.code == 0, listed.err
    keys = json.loads(listed.out)
    mine = [k for k in keys if k["scope"] == tenant["id"]]
    assert len(mine) == 1 and mine[0]["name"] == "ci" and mine[0]["revoked_at"] is None
    assert token not in listed.out and "token" not in mine[0]
    table = cpn("admin", "keys", "list")
    assert table.code == 0 and mine[0]["id"] in table.out and token not in table.out

    revoked = cpn("admin", "keys", "revoke", mine[0]["id"])
    assert revoked.code == 0, revoked.err
    assert f"revoked {mine[0]['id']}" in revoked.out
    assert status_with(server, token) == 401
    after = json.loads(cpn("admin", "keys", "list", "--json").out)
    assert next(k for k in after if k["id"] == mine[0]["id"])["revoked_at"] is not None


def test_quiet_prints_only_the_token_and_json_all_of_it(cpn: CliRun, server: LiveServer) -> None:
    quiet = cpn("admin", "keys", "create", "--role", "admin", "-q")
    assert quiet.code == 0, quiet.err
    token = quiet.out.strip()
    assert token.startswith("cpn_admin_") and "\n" not in token
    assert status_with(server, token) == 200
    as_json = cpn("admin", "keys", "create", "--role", "admin", "--json")
    body = json.loads(as_json.out)
    assert body["token"].startswith("cpn_admin_") and body["role"] == "admin"


def test_refusals_are_one_line(cpn: CliRun) -> None:
    role = cpn("admin", "keys", "create", "--role", "root")
    assert role.code == 2
    assert one_line(role.err) == (
        "cpn admin keys create: error: --role: 'root': use admin, tenant, agent or provider"
    )
    scope = cpn("admin", "keys", "create", "--role", "tenant", "--scope", "nobody")
    assert scope.code == 1
    line = one_line(scope.err)
    assert line.startswith("cpn admin keys create: error: 422 ") and "scope" in line, line
    gone = cpn("admin", "keys", "revoke", "no-such-key")
    assert gone.code == 2 and one_line(gone.err) == (
        "cpn admin keys revoke: error: KEY: no live key with id, name or prefix 'no-such-key' "
        "(cpn admin keys list)"
    )


def test_revoke_takes_a_name_or_the_start_of_an_id(cpn: CliRun, server: LiveServer) -> None:
    """Issue 51: a key is named as a user reads it in the table; two keys of one name are an
    error listing both, and nothing is revoked."""
    label = f"bot-{uuid.uuid4().hex[:6]}"
    with server.client() as admin:
        one = admin.create_api_key("admin", None, label)
        two = admin.create_api_key("admin", None, label)
    both = cpn("admin", "keys", "revoke", label)
    assert both.code == 2
    assert f"names 2 keys ({one['id'][:8]} ({label}), {two['id'][:8]} ({label}))" in both.err
    assert status_with(server, one["token"]) == status_with(server, two["token"]) == 200
    by_start = cpn("admin", "keys", "revoke", one["id"][:8])
    assert by_start.code == 0 and f"revoked {one['id']}" in by_start.out
    by_name = cpn("admin", "keys", "revoke", label)  # the one left alive of that name
    assert by_name.code == 0 and f"revoked {two['id']}" in by_name.out
    assert status_with(server, one["token"]) == status_with(server, two["token"]) == 401
