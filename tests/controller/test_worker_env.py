"""Tenant code never sees the control plane's secrets (issue 14, item 3): a real Ray actor,
started the way `cpn serve` starts its embedded Ray, looks at its environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from controller.store.migrate import upgrade

pytestmark = pytest.mark.slow

SECRETS = {
    "CPN_ADMIN_TOKEN": "cpn_admin_probe-0123456789abcdef-secret",
    "CPN_DATABASE_URL": "postgresql+psycopg://cpn:db-pass-0123456789@db.internal:5432/cpn",
    "CPN_AGENT_TOKEN": "cpn_agent_probe-0123456789abcdef-secret",
    "CPN_TOKEN": "cpn_tenant_probe-0123456789abcdef-secret",
    "PGPASSWORD": "pg-pass-0123456789",
}


def test_a_ray_worker_sees_no_control_plane_secret(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'cpn.db'}"
    upgrade(url)
    cache = str(tmp_path / "cache")
    env = {**os.environ, **SECRETS, "CPN_CACHE_DIR": cache, "CPN_HEARTBEAT_INTERVAL_S": "2"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.controller.ray_env_probe", url],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    worker = seen["worker"]
    # What workers need stays; every other CPN_* variable and PGPASSWORD are gone or blank.
    assert worker["environ"].get("CPN_CACHE_DIR") == cache
    for name in (*SECRETS, "CPN_HEARTBEAT_INTERVAL_S"):
        assert not worker["environ"].get(name), name
    # Not in the worker's initial environment nor in the raylet's that started it (/proc).
    values = [*SECRETS.values(), "db-pass-0123456789"]
    for where in ("own_initial", "parent_initial"):
        assert worker[where], f"{where} unreadable"
        for value in values:
            assert value not in worker[where], (where, value)
    for value in values:
        assert value not in json.dumps(worker["environ"])
    # The control plane itself keeps its settings once Ray has started.
    assert seen["driver"]["CPN_ADMIN_TOKEN"] == SECRETS["CPN_ADMIN_TOKEN"]
    assert seen["driver"]["CPN_DATABASE_URL"] == SECRETS["CPN_DATABASE_URL"]
