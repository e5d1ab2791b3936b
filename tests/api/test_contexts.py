"""Contexts (issue 51, item 3): `cpn login` checks a key against a live server and remembers
it, every command then finds its URL and key there, and a keyless 401 says how to give one."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from api.cli import app
from api.cli.contexts import config_path, load, resolve
from api.client import DEFAULT_URL
from tests.conftest import LiveServer

pytestmark = pytest.mark.parametrize("migrated_url", ["sqlite"], indirect=True)


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "home" / "cpn" / "config.yaml"
    monkeypatch.setenv("CPN_CONFIG", str(path))
    monkeypatch.delenv("CPN_URL", raising=False)
    monkeypatch.delenv("CPN_TOKEN", raising=False)
    monkeypatch.chdir(tmp_path)  # no var/admin-token here
    return path


def cpn(*args: str, stdin: str | None = None) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args), input=stdin, env={"COLUMNS": "200"})
    return result.exit_code, result.output


def test_login_then_every_command_uses_the_context(
    live_server: LiveServer, config: Path, tmp_path: Path
) -> None:
    key_file = tmp_path / "admin.key"
    key_file.write_text(live_server.admin_token + "\n")
    with live_server.client() as admin:
        admin.create_cluster("eu-west", "eu-west-1")
        tenant = admin.post("/v1/tenants", {"name": "acme"})
        tenant_key = admin.create_api_key("tenant", tenant["id"])["token"]

    code, out = cpn("clusters")  # nothing configured: the default URL, nobody there
    assert code == 1 and "cannot reach" in out

    code, out = cpn("login", "--url", live_server.url, "--token-file", str(key_file),
                    "--context", "ops")  # fmt: skip
    assert code == 0, out
    code, out = cpn("clusters")
    assert code == 0 and "eu-west" in out, out

    code, out = cpn("login", "--url", live_server.url, "--token-stdin", "--context", "acme",
                    stdin=tenant_key + "\n")  # fmt: skip
    assert code == 0, out
    text = config.read_text()
    assert tenant_key not in text and live_server.admin_token not in text  # paths, not keys
    kept = config.parent / "keys" / "acme"
    assert kept.read_text().strip() == tenant_key
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600
    code, out = cpn("clusters")  # a tenant key now: the admin table is refused
    assert code == 1 and "403" in out, out
    code, out = cpn("jobs")
    assert code == 0, out

    code, out = cpn("config", "get-contexts", "-o", "json")
    assert code == 0
    assert '"name": "acme"' in out and '"current": true' in out
    code, out = cpn("config", "use-context", "ops")
    assert code == 0 and load().current == "ops"
    code, out = cpn("config", "current-context")
    assert out.strip() == f"ops {live_server.url}"
    assert cpn("clusters")[0] == 0
    code, out = cpn("config", "use-context", "nope")
    assert code == 2 and "no context 'nope'" in out and "acme, ops" in out
    code, out = cpn("config", "delete-context", "acme")
    assert code == 0 and not kept.exists()
    assert set(load().contexts) == {"ops"}


def test_login_refuses_a_key_the_server_refuses(live_server: LiveServer, config: Path) -> None:
    code, out = cpn("login", "--url", live_server.url, "--token-stdin",
                    stdin="cpn_not-a-real-key-0123456789\n")  # fmt: skip
    assert code == 1 and "refused the key" in out and "401" in out
    assert not config.exists()
    code, out = cpn("login", "--url", "ftp://x", "--token-stdin", stdin="k\n")
    assert code == 2 and out.startswith("cpn login: error: --url:")


def test_a_keyless_401_says_how_to_give_a_key(live_server: LiveServer, config: Path) -> None:
    code, out = cpn("clusters", "--url", live_server.url)
    assert code == 1 and "401" in out
    assert "--token" in out and "CPN_TOKEN" in out and "cpn login" in out


def test_resolution_order(
    live_server: LiveServer, config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Flags win; a context's key goes only to its own URL; the local admin key only to a
    server on this machine."""
    assert resolve(None, None) == (DEFAULT_URL, None)
    (tmp_path / "var").mkdir()
    (tmp_path / "var" / "admin-token").write_text("cpn_local\n")
    assert resolve(None, None) == (DEFAULT_URL, "cpn_local")
    assert resolve("http://elsewhere:8000", None) == ("http://elsewhere:8000", None)
    assert resolve("http://localhost:9", None) == ("http://localhost:9", "cpn_local")
    key_file = tmp_path / "admin.key"
    key_file.write_text(live_server.admin_token)
    assert cpn("login", "--url", live_server.url, "--token-file", str(key_file))[0] == 0
    assert resolve(None, None) == (live_server.url, live_server.admin_token)
    assert resolve(None, "cpn_flag") == (live_server.url, "cpn_flag")
    assert resolve("http://elsewhere:8000", None) == ("http://elsewhere:8000", None)
    assert resolve(DEFAULT_URL, None) == (DEFAULT_URL, "cpn_local")
    assert config_path() == config and os.environ["CPN_CONFIG"] == str(config)
