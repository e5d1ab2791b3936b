"""The light client (issue 51, item 5): `pip install cpn` into a clean virtual environment
gives the CLI and the Python client without torch, Ray or the server's packages, and a tenant
quotes and submits with it against a live server; server commands name the extra they need."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import LiveServer, start_server
from tests.service.conftest import build_network

pytestmark = [pytest.mark.slow, pytest.mark.parametrize("migrated_url", ["sqlite"], indirect=True)]

HEAVY = ("torch", "ray", "numpy", "fastapi", "sqlalchemy", "uvicorn", "alembic", "psycopg")


@pytest.fixture
def api_only(db_url: str) -> Iterator[LiveServer]:
    """A server without its control loop: a submitted job stays PENDING, so nothing starts a
    Ray inside this test's process (a driver here would die with that Ray, and the worker
    with it, long after the test)."""
    live = start_server(database_url=db_url, run_controller=False)
    yield live
    live.stop()


def test_the_light_install_serves_a_tenant(
    api_only: LiveServer, tmp_path: Path, repo_root: Path
) -> None:
    live_server = api_only
    # The package's own files, copied: pip builds in the tree it installs from (build/).
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(repo_root / name, source / name)
    found = tomllib.loads((repo_root / "pyproject.toml").read_text())["tool"]["setuptools"]
    for package in (p.rstrip("*") for p in found["packages"]["find"]["include"]):
        shutil.copytree(
            repo_root / package, source / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    venv = tmp_path / "light"
    subprocess.run(
        [sys.executable, "-m", "venv", str(venv)],
        check=True, timeout=120, stdin=subprocess.DEVNULL, capture_output=True,
    )  # fmt: skip
    installed = subprocess.run(
        [venv / "bin" / "pip", "install", "--quiet", "--no-input",
         "-c", repo_root / "constraints.txt", str(source)],
        capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert installed.returncode == 0, installed.stderr[-3000:]
    listed = subprocess.run(
        [venv / "bin" / "pip", "list", "--format=json"],
        capture_output=True,
        text=True,
        check=True,
        stdin=subprocess.DEVNULL,
    )
    names = {p["name"].lower() for p in json.loads(listed.stdout)}
    assert "cpn" in names
    assert not names & set(HEAVY), names & set(HEAVY)

    net = build_network(live_server)
    tenant_key = net.admin.create_api_key("tenant", net.tenant_id)["token"]
    job = tmp_path / "job.yaml"
    job.write_text("name: light\ntask: builtin:mnist1d-mlp\ngpus: 2\nsteps: 100\n")
    env = {
        "PATH": f"{venv / 'bin'}:/usr/bin:/bin",
        "CPN_URL": live_server.url,
        "CPN_TOKEN": tenant_key,
        "CPN_CONFIG": str(tmp_path / "config.yaml"),
        "COLUMNS": "200",
    }

    def cpn(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(venv / "bin" / "cpn"), *args],
            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip

    assert cpn("--help").returncode == 0
    quoted = cpn("quote", str(job))
    assert quoted.returncode == 0, quoted.stderr
    submitted = cpn("submit", str(job), "--json")
    assert submitted.returncode == 0, submitted.stderr
    job_id = json.loads(submitted.stdout)["id"]
    listed_jobs = cpn("jobs", "-o", "json")
    assert listed_jobs.returncode == 0 and job_id in listed_jobs.stdout
    shown = cpn("job", job_id[:8], "-o", "json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["job"]["id"] == job_id  # a short id resolves
    served = cpn("serve")
    assert served.returncode == 1
    assert served.stderr.strip().splitlines() == [
        "cpn serve: error: this command needs cpn's server extra (no module 'uvicorn' here): "
        "pip install 'cpn[server]'"
    ]
    for c in (net.admin, net.tenant, net.other):
        c.close()
