"""Horizontal scale-out: 1, 2 and 4 `cpn serve` replicas on one PostgreSQL behind HAProxy.

Each replica is a real `cpn serve` (API only, background loops off, as `bench.api` runs it) on
the same throwaway PostgreSQL database; HAProxy (Debian's package; the benchmark installs it
with apt-get when it is missing, which needs root) balances them least-connections on one port.
The load is `bench.api`'s: a closed loop of C clients (own process, aiohttp) sending
`POST /v1/jobs`, then `GET /v1/jobs?limit=50`, for a fixed time. Reported: requests/s and
p50/p99 per replica count, and the speed-up over one replica. The replicas share the machine
with PostgreSQL, HAProxy and the load generator: on a machine with fewer cores than replicas
the curve shows the cores, not cpn.

CPU budgets (`--replica-cores Q --postgres-cores P`, root): each replica gets at most Q cores
and PostgreSQL (a throwaway server of the benchmark's own) at most P (`bench.cpu_caps`), so a
replica adds CPU as a machine of its own would and PostgreSQL saturates at its budget, not
when the machine does: the curve "until PostgreSQL saturates" scaled down to 2 cores. Each row
then says in what share of its CFS periods PostgreSQL and the replicas were throttled (near
100 %: saturated).

Run: `.venv/bin/python -m bench.replicas [--replicas 1,2,4] [--seconds 10] [--concurrency 32]
[--replica-cores 0.25 --postgres-cores 0.5]`.
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
from bench.cpu_caps import CpuCap, cpu_cap, total_throttle
from bench.pg_server import free_port, throwaway_postgres

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


@contextmanager
def balancer(backends: list[str], workdir: Path) -> Iterator[str]:
    port = free_port()
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
def replicas(
    database_url: str, n: int, cores: float | None = None
) -> Iterator[tuple[list[str], list[CpuCap]]]:
    """`n` replicas' URLs, and with `cores` the CPU budget each one runs in."""
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
        urls: list[str] = []
        caps: list[CpuCap] = []
        for i in range(n):
            plane = start_control_plane(
                database_url, ADMIN_TOKEN, settings=settings, migrate=i == 0
            )
            stack.callback(plane.proc.stop)
            if cores is not None:
                # entered after the stop callback, so left first: back to the root cgroup
                cap = stack.enter_context(cpu_cap(f"replica{i}", cores))
                cap.add(plane.proc.popen.pid)
                caps.append(cap)
            urls.append(plane.url)
        yield urls, caps


@dataclass
class Point:
    replicas: int
    writes: Run
    reads: Run
    postgres_throttled: float | None = None
    replicas_throttled: float | None = None


def measure(
    n: int,
    seconds: float,
    concurrency: int,
    server: str | None = None,
    replica_cores: float | None = None,
    postgres: CpuCap | None = None,
) -> Point:
    """One row: `n` replicas on a new database of `server` (None: `bench.api`'s server)."""
    from controller.store.db import scratch_database

    database = postgres_database() if server is None else scratch_database(server, "cpn_bench")
    with (
        tempfile.TemporaryDirectory(prefix="cpn-bench-replicas-") as tmp,
        database as db,
        replicas(db, n, replica_cores) as (urls, caps),
        balancer(urls, Path(tmp)) as url,
    ):
        token = build_network(url)
        pg_caps = [postgres] if postgres else []
        pg_before, caps_before = total_throttle(pg_caps), total_throttle(caps)
        writes, reads = run_load(url, token, seconds, concurrency)
        pg = (total_throttle(pg_caps) - pg_before).share if pg_caps else None
        rep = (total_throttle(caps) - caps_before).share if caps else None
    return Point(n, writes, reads, pg, rep)


def _pct(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.0f} %"


def table(points: list[Point], args: argparse.Namespace) -> str:
    base = points[0]
    budgets = ""
    if args.replica_cores is not None or args.postgres_cores is not None:
        budgets = f" --replica-cores {args.replica_cores} --postgres-cores {args.postgres_cores}"
    rows = [
        f"Command: `python -m bench.replicas --replicas {args.replicas} --seconds {args.seconds} "
        f"--concurrency {args.concurrency}{budgets}` on {os.cpu_count()} cores (PostgreSQL, "
        "HAProxy and the load generator on the same machine; 1-minute load average "
        f"{os.getloadavg()[0]:.1f} at the end: on a machine shared with other work, more replica "
        "processes also take a larger share of its CPU).",
        "",
        "| replicas | POST /v1/jobs /s | p50 ms | p99 ms | x1 "
        "| GET /v1/jobs /s | p50 ms | p99 ms | x1 | PostgreSQL throttled | replicas throttled |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for p in points:
        rows.append(
            f"| {p.replicas} | {p.writes.rate:.0f} | {p.writes.pct(50):.0f} "
            f"| {p.writes.pct(99):.0f} "
            f"| {p.writes.rate / max(base.writes.rate, 1e-9):.2f} | {p.reads.rate:.0f} "
            f"| {p.reads.pct(50):.0f} | {p.reads.pct(99):.0f} "
            f"| {p.reads.rate / max(base.reads.rate, 1e-9):.2f} "
            f"| {_pct(p.postgres_throttled)} | {_pct(p.replicas_throttled)} |"
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
    p.add_argument(
        "--replica-cores", type=float, default=None, help="CPU budget of each replica (root)"
    )
    p.add_argument(
        "--postgres-cores",
        type=float,
        default=None,
        help="run a throwaway PostgreSQL server of its own with this CPU budget (root)",
    )
    p.add_argument("--no-save", action="store_true")
    args = p.parse_args()
    for flag in ("replica_cores", "postgres_cores"):
        value = getattr(args, flag)
        if value is not None and not 0 < value <= (os.cpu_count() or 1):
            p.error(
                f"--{flag.replace('_', '-')}: a share of the cores, > 0 and <= {os.cpu_count()}"
            )
    try:
        counts = [int(x) for x in args.replicas.split(",") if x.strip()]
    except ValueError:
        p.error("--replicas: whole numbers separated by commas, e.g. 1,2,4")
    if not counts or min(counts) < 1:
        p.error("--replicas: each count must be >= 1")
    haproxy_binary()
    points = []
    with ExitStack() as stack:
        server, pg_cap = None, None
        if args.postgres_cores is not None:
            pg = stack.enter_context(throwaway_postgres(fsync=True))
            pg_cap = stack.enter_context(cpu_cap("postgres", args.postgres_cores))
            for pid in pg.pids():  # backends forked later start in the postmaster's cgroup
                pg_cap.add(pid)
            server = pg.url
        for n in counts:
            print(f"-- {n} replica(s)", flush=True)
            t0 = time.monotonic()
            points.append(
                measure(n, args.seconds, args.concurrency, server, args.replica_cores, pg_cap)
            )
            print(f"   took {time.monotonic() - t0:.0f} s", flush=True)
    out = table(points, args)
    print(out)
    if not args.no_save:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "replicas.md").write_text("# Horizontal replicas\n\n" + out)


if __name__ == "__main__":
    main()
