"""Start a local control plane and its agents as real processes.

Used by `cpn demo`, the end-to-end tests and the benchmarks: the same commands an operator
runs (`cpn db upgrade`, `cpn serve`, `cpn agent`), each in its own process.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Literal, TypeVar

import httpx
import yaml

CPN = [sys.executable, "-m", "api.cli"]
LISTENING = re.compile(r"Uvicorn running on (http://\S+)")
"""What uvicorn prints once it listens; group 1 is the URL."""


T = TypeVar("T")


def wait_until(
    predicate: Callable[[], T | Literal[False] | None],
    timeout: float,
    what: str,
    every: float = 0.1,
) -> T:
    """Poll `predicate` until it returns something truthy, and return that; TimeoutError naming
    `what` and the last value otherwise. How the demo, benchmarks and tests wait on the real
    processes they start."""
    deadline = time.monotonic() + timeout
    while True:
        last = predicate()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what} (last: {last!r})")
        time.sleep(every)


class ProcessError(RuntimeError):
    """A child process failed to start; the message carries its last output lines."""


@dataclass
class Proc:
    """A child process with its output kept in memory (the last lines) for error messages."""

    name: str
    popen: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)

    def tail(self, n: int = 20) -> str:
        return "\n".join(self.lines[-n:])

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.alive():
            self.popen.send_signal(sig)

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM, then SIGKILL if it does not exit within `timeout`."""
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        return self.popen.returncode


def _pump(
    proc: Proc,
    stream: IO[str],
    found: threading.Event,
    pattern: re.Pattern[str] | None,
    match: list[str],
) -> None:
    for line in stream:
        proc.lines.append(line.rstrip())
        if len(proc.lines) > 500:
            del proc.lines[:250]
        if pattern and not found.is_set() and (m := pattern.search(line)):
            match.append(m.group(1))
            found.set()


def spawn(
    name: str,
    args: list[str],
    env: Mapping[str, str],
    *,
    wait_for: re.Pattern[str] | None = None,
    timeout: float = 60.0,
    module: str = "api.cli",
    prefix: Sequence[str] = (),
) -> tuple[Proc, str | None]:
    """Start `python -m MODULE ARGS` (`cpn ARGS` by default); optionally wait until its output
    matches `wait_for` (group 1 returned). `prefix` wraps the command (`ip netns exec NS`:
    the WAN testbed runs each cluster's processes inside its datacenter's namespace)."""
    popen = subprocess.Popen(
        [*prefix, sys.executable, "-m", module, *args],
        env={**os.environ, **env},
        stdin=subprocess.DEVNULL,  # never the caller's (under pytest-xdist: its channel)
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    proc = Proc(name, popen)
    found, match = threading.Event(), []  # type: ignore[var-annotated]
    assert popen.stdout is not None
    threading.Thread(
        target=_pump, args=(proc, popen.stdout, found, wait_for, match), daemon=True
    ).start()
    if wait_for is None:
        return proc, None
    deadline = time.monotonic() + timeout
    while not found.wait(0.05):
        if not proc.alive() or time.monotonic() > deadline:
            proc.stop()
            raise ProcessError(f"{name} did not start:\n{proc.tail()}")
    return proc, match[0]


@dataclass
class ControlPlane:
    """A running `cpn serve` with its URL and admin token."""

    proc: Proc
    url: str
    admin_token: str
    env: dict[str, str]


def start_control_plane(
    database_url: str,
    admin_token: str,
    *,
    settings: Mapping[str, str] | None = None,
    migrate: bool = True,
    timeout: float = 60.0,
    port: int = 0,
    host: str = "127.0.0.1",
    prefix: Sequence[str] = (),
    workers: int = 1,
) -> ControlPlane:
    """`cpn db upgrade` then `cpn serve` (on a free port unless given, with `workers` API
    processes); returns once ready."""
    env = {"CPN_DATABASE_URL": database_url, "CPN_ADMIN_TOKEN": admin_token, **(settings or {})}
    if migrate:
        done = subprocess.run(
            [*CPN, "db", "upgrade"],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if done.returncode != 0:
            raise ProcessError(f"cpn db upgrade failed:\n{done.stderr[-2000:]}")
    proc, url = spawn(
        "cpn serve",
        [
            "serve",
            *("--host", host, "--port", str(port), "--log-level", "info"),
            *("--workers", str(workers)),
        ],
        env,
        wait_for=LISTENING,
        timeout=timeout,
        prefix=prefix,
    )
    assert url is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return ControlPlane(proc, url, admin_token, env)
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    proc.stop()
    raise ProcessError(f"cpn serve never became ready:\n{proc.tail()}")


def write_inventory(path: Path, gpus: list[dict[str, object]]) -> Path:
    path.write_text(yaml.safe_dump({"gpus": gpus}))
    return path


def start_agent(
    cluster: str,
    controller: str,
    token: str,
    inventory: Path,
    extra: list[str] | None = None,
    *,
    probe_host: str = "127.0.0.1",
    prefix: Sequence[str] = (),
) -> Proc:
    """A `cpn agent` with a declared inventory and a probe endpoint on a free port of
    `probe_host` (loopback unless given)."""
    args = [
        "agent",
        "--cluster",
        cluster,
        "--controller",
        controller,
        "--inventory",
        str(inventory),
        "--discovery",
        "inventory",
        "--probe-host",
        probe_host,
        "--probe-port",
        "0",
        "--backoff-base",
        "0.2",
        "--backoff-cap",
        "2",
        *(extra or []),
    ]
    proc, _ = spawn(f"cpn agent {cluster}", args, {"CPN_AGENT_TOKEN": token}, prefix=prefix)
    return proc
