"""Horizontal scale-out: 1, 2 and 4 `cpn serve` replicas on one PostgreSQL behind HAProxy.

Each replica is a real `cpn serve` (API only, background loops off, as `bench.api` runs it) on
the same throwaway PostgreSQL database; HAProxy (Debian's package; the benchmark installs it
with apt-get when it is missing, which needs root) balances them least-connections on one port.
The load is `bench.api`'s: a closed loop of C clients (own process, aiohttp) sending
`POST /v1/jobs`, then `GET /v1/jobs?limit=50`, for a fixed time. Reported: requests/s and
p50/p99 per replica count, and the speed-up over one replica. The replicas share the machine
with PostgreSQL, HAProxy and the load generator: on a machine with fewer cores than replicas
the curve shows the cores, not cpn.

Run: `.venv/bin/python -m bench.replicas [--replicas 1,2,4] [--seconds 10] [--concurrency 32]`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from api.processes import wait_until
from bench.api import ADMIN_TOKEN, RESULTS, Run, build_network, postgres_database, run_load

HAPROXY_CFG = """global
    maxconn 8192
defaults
    mode http
    timeout connect 5s
    timeout client 120s
    timeout server 120s
frontend cpn
    bind 127.0.0.1:{port}
    default_backend replicas
backend replicas
    balance leastconn
{servers}
"""


def haproxy_binary() -> str:
    """HAProxy from Debian's package, installed now when missing (root only)."""
    found = shutil.which("haproxy")
    if found:
        return found
    print("-- haproxy not found: apt-get install -y haproxy", flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "install", "-y", "-qq", "haproxy"], check=True, env=env)
    found = shutil.which("haproxy") or (
        "/usr/sbin/haproxy" if Path("/usr/sbin/haproxy").exists() else None
    )
    if not found:
        raise RuntimeError("haproxy is still missing after apt-get install haproxy")
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def balancer(backends: list[str], workdir: Path) -> Iterator[str]:
    port = _free_port()
    servers = "\n".join(
        f"    server r{i} {url.removeprefix('http://')} check" for i, url in enumerate(backends)
    )
    cfg = workdir / "haproxy.cfg"
    cfg.write_text(HAPROXY_CFG.format(port=port, servers=servers))
    proc = subprocess.Popen([haproxy_binary(), "-db", "-f", str(cfg)], stderr=subprocess.PIPE)
    try:

        def listening() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"haproxy exited: {proc.stderr.read().decode() if proc.stderr else ''}"
                )
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", port)) == 0

        wait_until(listening, 30, "haproxy listening", every=0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


@contextmanager
def replicas(database_url: str, n: int) -> Iterator[list[str]]:
    from api.processes import start_control_plane

    settings = {
        "CPN_RUN_CONTROLLER": "false",
        "CPN_LEASE_GRACE_S": "86400",
        "CPN_KEY_RATE_LIMIT": "0",
        # ...and it may queue more than the default cap of 10,000 PENDING jobs (a fast
        # machine submits that many in 8 s): the cap's check still runs, far from it.
        "CPN_MAX_QUEUED_JOBS": "1000000",
    }
    with ExitStack() as stack:
        urls = []
        for i in range(n):
            plane = start_control_plane(
                database_url, ADMIN_TOKEN, settings=settings, migrate=i == 0
            )
            stack.callback(plane.proc.stop)
            urls.append(plane.url)
        yield urls


@dataclass
class Point:
    replicas: int
    writes: Run
    reads: Run


def measure(n: int, seconds: float, concurrency: int) -> Point:
    with (
        tempfile.TemporaryDirectory(prefix="cpn-bench-replicas-") as tmp,
        postgres_database() as db,
        replicas(db, n) as urls,
        balancer(urls, Path(tmp)) as url,
    ):
        token = build_network(url)
        writes, reads = run_load(url, token, seconds, concurrency)
    return Point(n, writes, reads)


def table(points: list[Point], args: argparse.Namespace) -> str:
    base = points[0]
    rows = [
        f"Command: `python -m bench.replicas --replicas {args.replicas} --seconds {args.seconds} "
        f"--concurrency {args.concurrency}` on {os.cpu_count()} cores (PostgreSQL, HAProxy and the "
        f"load generator on the same machine; 1-minute load average {os.getloadavg()[0]:.1f} at "
        "the end: on a machine shared with other work, more replica processes also take a "
        "larger share of its CPU).",
        "",
        "| replicas | POST /v1/jobs /s | p50 ms | p99 ms | x1 "
        "| GET /v1/jobs /s | p50 ms | p99 ms | x1 |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for p in points:
        rows.append(
            f"| {p.replicas} | {p.writes.rate:.0f} | {p.writes.pct(50):.0f} "
            f"| {p.writes.pct(99):.0f} "
            f"| {p.writes.rate / max(base.writes.rate, 1e-9):.2f} | {p.reads.rate:.0f} "
            f"| {p.reads.pct(50):.0f} | {p.reads.pct(99):.0f} "
            f"| {p.reads.rate / max(base.reads.rate, 1e-9):.2f} |"
        )
    errors = {
        f"{p.replicas}: {r.name}": r.errors for p in points for r in (p.writes, p.reads) if r.errors
    }
    if errors:
        rows += ["", f"Errors: {json.dumps(errors)}"]
    return "\n".join(rows) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--replicas", default="1,2,4")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--no-save", action="store_true")
    args = p.parse_args()
    try:
        counts = [int(x) for x in args.replicas.split(",") if x.strip()]
    except ValueError:
        p.error("--replicas: whole numbers separated by commas, e.g. 1,2,4")
    if not counts or min(counts) < 1:
        p.error("--replicas: each count must be >= 1")
    haproxy_binary()
    points = []
    for n in counts:
        print(f"-- {n} replica(s)", flush=True)
        t0 = time.monotonic()
        points.append(measure(n, args.seconds, args.concurrency))
        print(f"   took {time.monotonic() - t0:.0f} s", flush=True)
    out = table(points, args)
    print(out)
    if not args.no_save:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "replicas.md").write_text("# Horizontal replicas\n\n" + out)


if __name__ == "__main__":
    main()
