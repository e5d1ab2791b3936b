"""The quickstart's manual path runs as written (issue 51, item 6): from `cpn db upgrade` to
the bill, real processes (`cpn serve`, two agents, a job on local Ray), in a fresh directory.
Step 1 (the install) is the suite's own .venv; the port is a free one instead of 8000."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def block(repo_root: Path) -> str:
    text = (repo_root / "docs" / "quickstart.md").read_text()
    fenced = [part.split("\n```\n", 1)[0] for part in text.split("```bash\n")[1:]]
    [manual] = [b for b in fenced if "# 2." in b]
    return "# 2." + manual.split("# 2.", 1)[1]


def test_the_manual_path_runs_as_written(repo_root: Path, tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = block(repo_root).replace("8000", str(port))
    # On any exit, stop what the block started and wait for it: a `cpn serve` still taking its
    # local Ray down when the test returns would be found by the next test's `ray.init()`.
    harness = "set -euo pipefail\ntrap 'kill $(jobs -p) 2>/dev/null || true; wait' EXIT\n"
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "CPN_CONFIG": str(tmp_path / "config.yaml"),
    }
    for name in ("CPN_URL", "CPN_TOKEN", "CPN_DATABASE_URL", "CPN_ADMIN_TOKEN"):
        env.pop(name, None)
    # A session of its own, as an operator's shell would be: the local Ray that `cpn serve`
    # starts reaps its own process group, which must not be this test's worker; whatever is
    # left of the group afterwards is killed with it.
    block_run = subprocess.Popen(
        ["bash", "-c", harness + script], cwd=tmp_path, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = block_run.communicate(timeout=420)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(block_run.pid, signal.SIGKILL)
    ran = subprocess.CompletedProcess(block_run.args, block_run.returncode, stdout, stderr)
    logs = "".join(
        f"\n--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted((tmp_path / "var").glob("*.log"))
    )
    assert ran.returncode == 0, ran.stdout[-4000:] + ran.stderr[-3000:] + logs
    assert "6 created" in ran.stdout
    assert ran.stdout.count("READY") >= 2
    assert "SUCCEEDED" in ran.stdout and "logged in to" in ran.stdout
    assert "step 200/200 loss" in ran.stdout  # `cpn logs`: what the workers said
    assert "Ledger: 1 entries" in ran.stdout
