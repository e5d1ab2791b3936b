"""The chart's containers start: their rendered command lines and environment, run as real
processes of the real `cpn` (no Kubernetes here).

Only what a pod provides and this machine does not is rewritten, each in one place below:
volume paths (/data, /etc/cpn) become temporary directories, Secrets become the values the
chart rendered into its own Secrets (or a key made through the API), and listening ports
become free local ports so parallel runs cannot collide.
"""

from __future__ import annotations

import base64
import copy
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helm import chartkit
from tests.helm.chartkit import Rendered, render

CPN = chartkit.REPO / ".venv" / "bin" / "cpn"
DEADLINE_S = 60.0

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _secret_value(rendered: Rendered, ref: dict[str, str]) -> str:
    secret = rendered.one("Secret", ref["name"])
    return base64.b64decode(secret["data"][ref["key"]]).decode()


def _process_env(
    rendered: Rendered,
    container: dict[str, Any],
    mounts: dict[str, Path],
    secrets: dict[str, str] | None = None,
) -> dict[str, str]:
    """The container's environment as the kubelet would build it, volumes mapped to `mounts`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CPN_", "RAY_"))}
    for name, entry in chartkit.env_of(container).items():
        if "value" in entry:
            # One pass, so a mapped path is never mapped again.
            pattern = "|".join(re.escape(m) + "(?=/|$)" for m in mounts)
            env[name] = re.sub(pattern, lambda m: str(mounts[m.group(0)]), entry["value"])
        else:
            ref = entry["valueFrom"]["secretKeyRef"]
            env[name] = (secrets or {}).get(ref["name"]) or _secret_value(rendered, ref)
    return env


def _with_flag(args: list[str], flag: str, value: str) -> list[str]:
    out = list(args)
    out[out.index(flag) + 1] = value
    return out


def _wait_http(url: str, proc: subprocess.Popen[str], expect: int = 200) -> httpx.Response:
    deadline = time.monotonic() + DEADLINE_S
    last: str = "no answer"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"process exited with {proc.returncode} before {url} answered")
        try:
            response = httpx.get(url, timeout=2.0)
            if response.status_code == expect:
                return response
            last = f"{response.status_code} {response.text[:200]}"
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(0.2)
    pytest.fail(f"{url} did not answer {expect} within {DEADLINE_S}s: {last}")


def _stop(proc: subprocess.Popen[str]) -> str:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    out, _ = proc.communicate(timeout=10)
    return out


@pytest.fixture()
def control_plane(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """The default release's migration Job, then its control-plane container: (URL, admin key)."""
    rendered = render()
    mounts = {"/data": tmp_path / "data", "/tmp": tmp_path / "tmp"}
    for local in mounts.values():
        local.mkdir()

    job = chartkit.pod_spec(rendered.one("Job", "migrate"))["containers"][0]
    deployment = chartkit.pod_spec(rendered.one("Deployment", "control-plane"))["containers"][0]
    serve_env = _process_env(rendered, deployment, mounts)

    # Before the hook has run, the server refuses to start and says what to do.
    early = subprocess.run(
        [str(CPN), *deployment["args"]],
        env=serve_env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert early.returncode != 0 and "cpn db upgrade" in early.stderr, early.stderr

    migrate = subprocess.run(
        [str(CPN), *job["args"]],
        env=_process_env(rendered, job, mounts),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert migrate.returncode == 0, migrate.stderr
    assert (mounts["/data"] / "cpn.db").is_file(), "the Job wrote the database the pod mounts"

    port = _free_port()
    args = _with_flag(_with_flag(deployment["args"], "--port", str(port)), "--host", "127.0.0.1")
    proc = subprocess.Popen(
        [str(CPN), *args],
        env=serve_env,
        cwd=tmp_path,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_http(base + deployment["livenessProbe"]["httpGet"]["path"], proc)
        _wait_http(base + deployment["readinessProbe"]["httpGet"]["path"], proc)
        yield base, serve_env["CPN_ADMIN_TOKEN"]
    finally:
        output = _stop(proc)
        assert "Traceback" not in output, output


def test_control_plane_starts_from_the_chart(control_plane: tuple[str, str]) -> None:
    base, admin_key = control_plane
    # The admin key the chart generated into its Secret is the server's first admin.
    listed = httpx.get(f"{base}/v1/clusters", headers={"Authorization": f"Bearer {admin_key}"})
    assert listed.status_code == 200, listed.text
    assert httpx.get(f"{base}/v1/clusters").status_code == 401
    metrics = httpx.get(f"{base}/metrics")  # what the ServiceMonitor scrapes
    assert metrics.status_code == 200 and "# TYPE" in metrics.text


def test_agent_reports_through_the_chart_command_line(
    control_plane: tuple[str, str],
    tmp_path: Path,
) -> None:
    base, admin_key = control_plane
    auth = {"Authorization": f"Bearer {admin_key}"}
    created = httpx.post(
        f"{base}/v1/clusters", json={"name": "dc-east", "region": "east"}, headers=auth
    )
    assert created.status_code == 201, created.text
    key = httpx.post(
        f"{base}/v1/api-keys", json={"role": "agent", "scope": "dc-east"}, headers=auth
    )
    assert key.status_code == 201, key.text

    # Outside a pod there are no nodes to read, so this agent declares its GPUs (the chart's
    # inventory option) instead of the default Kubernetes discovery.
    values = copy.deepcopy(chartkit.AGENT_VALUES)
    values["agent"].update(
        {
            "controllerURL": base,
            "discovery": "inventory",
            "inventory": "gpus:\n  - model: A100-80GB\n    memory_gib: 80\n    count: 8\n",
        }
    )
    rendered = render(values)
    deployment = rendered.one("Deployment")
    container = chartkit.pod_spec(deployment)["containers"][0]
    config = tmp_path / "etc-cpn"
    config.mkdir()
    (config / "inventory.yaml").write_text(rendered.one("ConfigMap")["data"]["inventory.yaml"])
    mounts = {"/etc/cpn": config, "/tmp": tmp_path}
    env = _process_env(
        rendered, container, mounts, secrets={"cpn-agent-token": key.json()["token"]}
    )
    probe_port = _free_port()
    args = [a.replace("/etc/cpn", str(config)) for a in container["args"]]
    args = _with_flag(
        _with_flag(args, "--probe-port", str(probe_port)), "--probe-host", "127.0.0.1"
    )
    proc = subprocess.Popen(
        [str(CPN), *args],
        env=env,
        cwd=tmp_path,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        probe_path = container["livenessProbe"]["httpGet"]["path"]
        _wait_http(f"http://127.0.0.1:{probe_port}{probe_path}", proc, expect=204)
        deadline = time.monotonic() + DEADLINE_S
        cluster: dict[str, Any] = {}
        while time.monotonic() < deadline:
            cluster = httpx.get(f"{base}/v1/clusters/dc-east", headers=auth).json()
            if cluster.get("state") == "READY":
                break
            assert proc.poll() is None, "agent exited"
            time.sleep(0.2)
        assert cluster.get("state") == "READY", cluster
        assert [(g["model"], g["count"]) for g in cluster["gpus"]] == [("A100-80GB", 8)]
        flags = dict(zip(args[1::2], args[2::2], strict=True))
        assert cluster["probe_url"] == flags["--advertise-url"]
        assert cluster["discovery"] == "inventory"
    finally:
        output = _stop(proc)
    assert "Traceback" not in output, output
