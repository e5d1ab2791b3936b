"""`cpn agent` as a real process: flags, heartbeats, probe endpoint, clean SIGTERM/SIGINT."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from api.cli import main
from tests.agents.conftest import Reply, problem

ROOT = Path(__file__).resolve().parents[2]


def agent_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("CPN_AGENT_TOKEN", "KUBERNETES_SERVICE_HOST")
    }
    env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.fixture
def inventory(tmp_path: Path) -> Path:
    path = tmp_path / "inv.yaml"
    path.write_text("gpus:\n  - {model: H100-80GB, memory_gib: 80, count: 4}\n")
    return path


def start_agent(log, *args: str, env: dict[str, str]):
    # Output to a file, so a chatty agent can never block on a full pipe.
    return subprocess.Popen(
        [sys.executable, "-m", "api.cli", "agent", *args],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def read(log) -> str:
    log.flush()
    log.seek(0)
    return log.read()


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_agent_process_heartbeats_serves_probes_and_stops_cleanly(
    make_controller, inventory, tmp_path, sig
):
    controller = make_controller(
        [
            problem(401, "unknown API key"),
            Reply(200, b"not json"),
            problem(502, "bad gateway"),
        ]
    )
    env = agent_env()
    env["CPN_AGENT_TOKEN"] = "tok-from-env"
    with open(tmp_path / "agent.log", "w+") as log:
        proc = start_agent(
            log,
            "--cluster",
            "east",
            "--controller",
            controller.url,
            "--inventory",
            str(inventory),
            "--probe-host",
            "127.0.0.1",
            "--probe-port",
            "0",
            "--backoff-base",
            "0.01",
            "--backoff-cap",
            "0.05",
            env=env,
        )
        out, rc, probe_url = drive(controller, proc, log, sig)
    assert rc == 0, out
    assert "Traceback" not in out
    assert "unknown API key" in out  # the problem's detail, for the operator
    assert "agent stopped" in out
    with pytest.raises(httpx.TransportError):  # the probe endpoint went with it
        httpx.get(probe_url + "/probe/ping", timeout=2)


def drive(controller, proc, log, sig):
    try:
        # 3 refused/garbage answers, then at least 2 acked beats (interval 0.05 s).
        assert controller.wait_for(lambda: controller.count("/v1/agent/heartbeat") >= 5, 30), read(
            log
        )
        beat = controller.heartbeats()[-1]
        assert beat.cluster == "east" and beat.gpus[0].model == "H100-80GB"
        assert controller.received[0].headers["Authorization"] == "Bearer tok-from-env"
        assert beat.probe_url is not None and beat.probe_url.startswith("http://127.0.0.1:")
        assert httpx.get(beat.probe_url + "/probe/ping").status_code == 204
        proc.send_signal(sig)
        rc = proc.wait(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return read(log), rc, beat.probe_url


@pytest.mark.slow
def test_once_prints_the_ack(make_controller, inventory, tmp_path):
    controller = make_controller()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "api.cli",
            "agent",
            "--once",
            "--cluster",
            "east",
            "--controller",
            controller.url,
            "--token",
            "t",
            "--inventory",
            str(inventory),
        ],
        cwd=ROOT,
        env=agent_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    ack = json.loads(result.stdout)
    assert ack["cluster"] == "east" and ack["state"] == "READY"
    assert controller.heartbeats()[0].probe_url is None


def test_once_with_a_refused_token_is_one_line_and_exit_1(make_controller, inventory, capsys):
    controller = make_controller([problem(403, "token bound to cluster 'west'")])
    with pytest.raises(SystemExit) as exit_:
        main(
            [
                "agent",
                "--once",
                "--cluster",
                "east",
                "--controller",
                controller.url,
                "--token",
                "t",
                "--inventory",
                str(inventory),
            ]
        )
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 1
    assert len(err.splitlines()) == 1
    assert err.startswith("cpn agent: error: controller refused the agent token (HTTP 403)")
    assert "bound to cluster 'west'" in err


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--controller", "ftp://x"], "--controller"),
        (["--controller", "http://"], "--controller"),
        (["--controller", "localhost:8000"], "--controller"),
        (["--token", "  "], "--token"),
        (["--probe-port", "70000"], "--probe-port"),
        (["--cluster", "x" * 64], "--cluster"),
        (["--discovery", "magic"], "--discovery"),
        (["--advertise-url", "10.0.0.1:9100"], "--advertise-url"),
        (["--inventory", "/nonexistent/inv.yaml"], "--inventory"),
        (["--inventory", "BAD"], "gpus[0].count"),
        (["--discovery", "inventory", "--inventory", None], "--inventory: required"),
    ],
)
def test_bad_flags_give_one_line_and_exit_2(args, expected, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("CPN_AGENT_TOKEN", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    bad = tmp_path / "bad.yaml"
    bad.write_text("gpus: [{model: A100, memory_gib: 80, count: -2}]")
    flags = {"--cluster": "east", "--controller": "http://127.0.0.1:9", "--token": "t"}
    flags.update(dict(zip(args[::2], args[1::2], strict=True)))
    argv = ["agent"]
    for k, v in flags.items():
        if v is not None:
            argv += [k, str(bad) if v == "BAD" else v]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2, err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("cpn agent: error:")
    assert expected in err


def test_missing_token_names_the_env_var(capsys, monkeypatch):
    monkeypatch.delenv("CPN_AGENT_TOKEN", raising=False)
    with pytest.raises(SystemExit) as exit_:
        main(["agent", "--cluster", "east", "--controller", "http://127.0.0.1:9"])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2
    assert "--token" in err and "CPN_AGENT_TOKEN" in err and len(err.splitlines()) == 1


def test_busy_probe_port_is_one_line_and_exit_2(tmp_path, inventory, capsys):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(SystemExit) as exit_:
            main(
                [
                    "agent",
                    "--cluster",
                    "east",
                    "--controller",
                    "http://127.0.0.1:9",
                    "--token",
                    "t",
                    "--inventory",
                    str(inventory),
                    "--probe-host",
                    "127.0.0.1",
                    "--probe-port",
                    str(port),
                ]
            )
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1
    assert err.startswith("cpn agent: error: --probe-port: cannot listen on 127.0.0.1:")
