"""Jobs API throughput: `POST /v1/jobs` and `GET /v1/jobs` of `cpn serve`, beside a bare endpoint.

For each target -- cpn on SQLite, cpn on PostgreSQL, and `bench.bare_api` (the ceiling: the
same bodies and answers, same uvicorn, no auth, no database) -- a closed loop of C concurrent
clients (default 32) runs for a fixed time:

1. submissions: `POST /v1/jobs` with a tenant key, each with a unique Idempotency-Key;
2. reads: `GET /v1/jobs?limit=50` (the tenant's newest page, over every job submitted in 1.).

It reports requests/s, p50/p99 latency and each target's share of the bare endpoint's rate.
The servers are real processes (`cpn db upgrade` + `cpn serve` via api.processes, with the
background loops off so only the API is measured); clusters, prices, links and the tenant are
set up through the API as an admin would. The load generator is its own process (asyncio +
aiohttp). PostgreSQL gets a throwaway `cpn_bench_<random>` database, dropped at the end.

Run: `.venv/bin/python -m bench.api [--seconds 10] [--concurrency 32] [--targets ...]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ADMIN_TOKEN = "cpn_admin_bench-" + uuid.uuid4().hex
PG_SERVER = os.environ.get(
    "CPN_BENCH_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)
RESULTS = Path(__file__).resolve().parent / "results"
PAGE = 50
SPEC = {"name": "bench-mlp", "task": "builtin:mnist1d-mlp", "gpus": 8, "steps": 2000}
CLUSTERS = {
    "us-east": ("A100", 64, 2.50),
    "eu-west": ("H100", 64, 4.00),
    "ap-south": ("L4", 128, 0.80),
}
LABELS = {
    "bare": "bare FastAPI (ceiling)",
    "sqlite": "cpn serve, SQLite",
    "postgres": "cpn serve, PostgreSQL",
}


@dataclass
class Run:
    """One closed-loop measurement: latencies (s) of the requests answered 2xx, and the rest."""

    name: str
    seconds: float
    latencies: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return len(self.latencies) / self.seconds if self.seconds > 0 else 0.0

    def pct(self, p: float) -> float:
        return float(np.percentile(self.latencies, p)) * 1000 if self.latencies else float("nan")


# ---- load generator (its own process) ------------------------------------------------------


async def _closed_loop(name: str, seconds: float, concurrency: int, send: Any) -> Run:
    """`concurrency` clients, each sending again as soon as it is answered, for `seconds`."""
    loop = asyncio.get_running_loop()
    run = Run(name, seconds)
    stop = loop.time() + seconds

    async def client() -> None:
        while (t0 := loop.time()) < stop:
            err = await send()
            t1 = loop.time()
            if t1 > stop:
                return  # answered after the window: not counted
            if err:
                run.errors[err] = run.errors.get(err, 0) + 1
            else:
                run.latencies.append(t1 - t0)

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return run


async def _load(url: str, token: str | None, seconds: float, concurrency: int) -> tuple[Run, Run]:
    import aiohttp

    auth = {"Authorization": f"Bearer {token}"} if token else {}
    body = json.dumps(SPEC).encode()
    connector = aiohttp.TCPConnector(limit=concurrency, ttl_dns_cache=None)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def call(method: str, path: str, **kwargs: Any) -> str | None:
            try:
                async with session.request(method, f"{url}{path}", **kwargs) as resp:
                    await resp.read()
                    return None if resp.status < 300 else f"HTTP {resp.status}"
            except Exception as exc:
                return exc.__class__.__name__

        def submit() -> Any:
            headers = {
                **auth,
                "Content-Type": "application/json",
                "Idempotency-Key": f"bench-{uuid.uuid4()}",
            }
            return call("POST", "/v1/jobs", data=body, headers=headers)

        def read() -> Any:
            return call("GET", f"/v1/jobs?limit={PAGE}", headers=auth)

        for _ in range(2 * concurrency):  # warm-up: connections, caches, the page exists
            await submit()
        writes = await _closed_loop("POST /v1/jobs", seconds, concurrency, submit)
        await asyncio.sleep(1.0)  # let the server drain what the window cut off
        reads = await _closed_loop("GET /v1/jobs", seconds, concurrency, read)
        return writes, reads


def _loadgen_main(url: str, token: str | None, seconds: float, concurrency: int, out: Any) -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    try:
        out.put(("ok", asyncio.run(_load(url, token, seconds, concurrency))))
    except Exception as exc:
        out.put(("error", f"{exc.__class__.__name__}: {exc}"))


def run_load(url: str, token: str | None, seconds: float, concurrency: int) -> tuple[Run, Run]:
    """Drive `url` from a separate process (the server must not share our interpreter)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_loadgen_main, args=(url, token, seconds, concurrency, out))
    proc.start()
    try:
        status, value = out.get(timeout=2 * seconds + 240)
        proc.join(timeout=30)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=10)
    if status != "ok":
        raise RuntimeError(f"load generator failed: {value}")
    return value


# ---- targets -------------------------------------------------------------------------------


def build_network(url: str) -> str:
    """Clusters with GPUs (one agent heartbeat each), prices, links and a tenant; its key."""
    from api.client import Client

    with Client(url, ADMIN_TOKEN) as admin:
        for name, (model, count, price) in CLUSTERS.items():
            admin.create_cluster(name, name)
            token = admin.create_api_key("agent", name)["token"]
            with Client(url, token) as agent:
                agent.post(
                    "/v1/agent/heartbeat",
                    {
                        "cluster": name,
                        "gpus": [
                            {"model": model, "memory_gib": 80, "count": count, "allocatable": count}
                        ],
                    },
                )
            for qos_class, factor in (("guaranteed", 1.5), ("standard", 1.0), ("spot", 0.4)):
                admin.post(
                    "/v1/pricing/gpu",
                    {
                        "cluster": name,
                        "gpu_model": model,
                        "qos_class": qos_class,
                        "price_per_gpu_hour": price * factor,
                    },
                )
        admin.declare_link(
            "us-east", "eu-west", bandwidth_gbps=10, rtt_ms=70, egress_price_per_gb=0.02
        )
        admin.declare_link(
            "us-east", "ap-south", bandwidth_gbps=1, rtt_ms=200, egress_price_per_gb=0.08
        )
        admin.declare_link(
            "eu-west", "ap-south", bandwidth_gbps=2, rtt_ms=120, egress_price_per_gb=0.05
        )
        tenant = admin.post("/v1/tenants", {"name": "bench", "gpu_quota": 64, "budget": 1e9})
        return str(admin.create_api_key("tenant", tenant["id"])["token"])


def postgres_database() -> AbstractContextManager[str]:
    from controller.store.db import scratch_database

    return scratch_database(PG_SERVER, "cpn_bench")


@contextmanager
def cpn_server(database_url: str, workers: int = 1) -> Iterator[tuple[str, int]]:
    """`cpn serve` (API only; leases long enough not to expire mid-run); (URL, pid: with
    several workers, the supervisor's)."""
    from api.processes import start_control_plane

    plane = start_control_plane(
        database_url,
        ADMIN_TOKEN,
        # One tenant key drives the whole load: the per-key rate limit is off (0).
        settings={
            "CPN_RUN_CONTROLLER": "false",
            "CPN_LEASE_GRACE_S": "86400",
            "CPN_KEY_RATE_LIMIT": "0",
            # ...and it may queue more than the default cap of 10,000 PENDING jobs (a fast
            # machine submits that many in 8 s): the cap's check still runs, far from it.
            "CPN_MAX_QUEUED_JOBS": "1000000",
        },
        workers=workers,
    )
    try:
        yield plane.url, plane.proc.popen.pid
    finally:
        plane.proc.stop()


@contextmanager
def bare_server() -> Iterator[tuple[str, int]]:
    from api.processes import LISTENING, spawn

    proc, url = spawn("bare app", ["--port", "0"], {}, wait_for=LISTENING, module="bench.bare_api")
    assert url is not None
    try:
        yield url, proc.popen.pid
    finally:
        proc.stop()


@contextmanager
def serving(target: str, workers: int = 1) -> Iterator[tuple[str, str | None, int]]:
    """A server for `target` on a free port; yields (URL, tenant key or None, server pid)."""
    if target == "bare":
        with bare_server() as (url, pid):
            yield url, None, pid
    elif target == "sqlite":
        with (
            tempfile.TemporaryDirectory(prefix="cpn-bench-") as tmp,
            cpn_server(f"sqlite:///{tmp}/cpn.db", workers) as (url, pid),
        ):
            yield url, build_network(url), pid
    elif target == "postgres":
        with postgres_database() as db, cpn_server(db, workers) as (url, pid):
            yield url, build_network(url), pid
    else:
        raise ValueError(f"unknown target {target!r}: use bare, sqlite or postgres")


@dataclass
class Result:
    target: str
    writes: Run
    reads: Run


@contextmanager
def profiling(pid: int, path: Path | None, seconds: float, gil: bool = False) -> Iterator[None]:
    """py-spy records the server while the load runs, when asked to: every thread's stack
    (wall time: a thread waiting on the database shows as busy in its driver), or with `gil`
    only the thread holding the GIL (where the server's Python CPU time goes)."""
    if path is None:
        yield
        return
    spy = Path(sys.executable).parent / "py-spy"
    proc = subprocess.Popen(
        [
            str(spy),
            "record",
            "--pid",
            str(pid),
            "--duration",
            str(int(2 * seconds + 5)),
            "--format",
            "raw",
            "--output",
            str(path),
            "--nonblocking",
            *(["--gil"] if gil else []),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    try:
        yield
    finally:
        try:
            proc.wait(2 * seconds + 60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def measure(target: str, args: argparse.Namespace) -> Result:
    print(f"-- {target}", file=sys.stderr, flush=True)
    t = time.monotonic()
    with serving(target, args.workers) as (url, token, pid):
        spy = RESULTS / f"api-{target}.folded.txt" if args.profile else None
        with profiling(pid, spy, args.seconds, args.gil):
            writes, reads = run_load(url, token, args.seconds, args.concurrency)
    print(f"   done in {time.monotonic() - t:.0f}s", file=sys.stderr, flush=True)
    return Result(target, writes, reads)


# ---- report --------------------------------------------------------------------------------


def table(results: list[Result], args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    bare = next((r for r in results if r.target == "bare"), None)
    t = Table(
        title=f"Jobs API, {args.concurrency} concurrent clients, {args.seconds:g} s each, "
        f"cpn serve --workers {args.workers}"
    )
    for col in (
        "target",
        "POST /v1/jobs /s",
        "of bare",
        "p50 ms",
        "p99 ms",
        f"GET /v1/jobs?limit={PAGE} /s",
        "of bare",
        "p50 ms",
        "p99 ms",
        "errors",
    ):
        t.add_column(col, justify="left" if col == "target" else "right")
    for r in results:
        w_share = f"{r.writes.rate / bare.writes.rate:.0%}" if bare and bare.writes.rate else "-"
        r_share = f"{r.reads.rate / bare.reads.rate:.0%}" if bare and bare.reads.rate else "-"
        errors = sum(r.writes.errors.values()) + sum(r.reads.errors.values())
        t.add_row(
            LABELS[r.target],
            f"{r.writes.rate:,.0f}",
            w_share,
            f"{r.writes.pct(50):.1f}",
            f"{r.writes.pct(99):.1f}",
            f"{r.reads.rate:,.0f}",
            r_share,
            f"{r.reads.pct(50):.1f}",
            f"{r.reads.pct(99):.1f}",
            str(errors),
        )
    Console(width=160).print(t)
    for r in results:
        for run in (r.writes, r.reads):
            if run.errors:
                print(f"{LABELS[r.target]} {run.name} errors: {run.errors}")
    if bare:
        for r in results:
            if r.target != "bare":
                ok_w = r.writes.rate >= bare.writes.rate / 3
                ok_r = r.reads.rate >= bare.reads.rate / 2
                print(
                    f"target {LABELS[r.target]}: submissions >= 1/3 of bare: "
                    f"{'yes' if ok_w else 'NO'}; reads >= 1/2 of bare: {'yes' if ok_r else 'NO'}"
                )


def plot(results: list[Result], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    names = [LABELS[r.target] for r in results]
    for ax, which, title in (
        (axes[0], "writes", "POST /v1/jobs"),
        (axes[1], "reads", f"GET /v1/jobs?limit={PAGE}"),
    ):
        runs = [getattr(r, which) for r in results]
        rates = [run.rate for run in runs]
        ax.barh(names, rates, color="tab:gray")
        for y, run in enumerate(runs):
            ax.text(
                run.rate,
                y,
                f" {run.rate:,.0f}/s  p50 {run.pct(50):.0f} ms  p99 {run.pct(99):.0f} ms",
                va="center",
                fontsize=8,
            )
        bare = next((run for r, run in zip(results, runs, strict=True) if r.target == "bare"), None)
        if bare:
            share = 1 / 3 if which == "writes" else 1 / 2
            ax.axvline(
                bare.rate * share,
                color="red",
                linestyle="--",
                linewidth=1,
                label=f"target: {share:.2g} of bare",
            )
            ax.legend(fontsize=8, loc="lower right")
        ax.set_xlim(0, max(rates) * 1.9 if rates else 1)
        ax.set_xlabel("requests/s")
        ax.set_title(f"{title}, {args.concurrency} clients, cpn --workers {args.workers}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="per measurement")
    parser.add_argument("--concurrency", type=int, default=32, help="concurrent clients")
    parser.add_argument(
        "--targets",
        nargs="+",
        default=["bare", "sqlite", "postgres"],
        choices=["bare", "sqlite", "postgres"],
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="record each server with py-spy (bench/results/api-*.folded.txt)",
    )
    parser.add_argument(
        "--gil", action="store_true", help="with --profile: sample only the GIL's holder (CPU)"
    )
    parser.add_argument(
        "--workers", type=int, default=1, help="cpn serve --workers (the bare app keeps one)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure every target this many times in turn; each round's shares are of that "
        "round's bare run, summed up as medians (a shared machine's speed drifts in minutes)",
    )
    parser.add_argument("--plot", type=Path, default=RESULTS / "api.png")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    rounds = []
    for _ in range(args.rounds):
        rounds.append([measure(target, args) for target in args.targets])
        table(rounds[-1], args)
    if args.rounds > 1:
        medians(rounds)
    plot(rounds[-1], args, args.plot)


def medians(rounds: list[list[Result]]) -> None:
    """Each target's share of bare, round by round (of the same round's bare), and the
    median: what the targets are judged on when several rounds ran."""
    for target in rounds[0]:
        if target.target == "bare":
            continue
        shares: dict[str, list[float]] = {"writes": [], "reads": []}
        for results in rounds:
            bare = next((r for r in results if r.target == "bare"), None)
            mine = next(r for r in results if r.target == target.target)
            for which in shares:
                ceiling = getattr(bare, which).rate if bare else 0.0
                if ceiling:
                    shares[which].append(getattr(mine, which).rate / ceiling)
        if not shares["writes"]:
            return
        w, r = (float(np.median(shares[k])) for k in ("writes", "reads"))
        print(
            f"{LABELS[target.target]}, {len(rounds)} rounds: submissions "
            f"{', '.join(f'{x:.0%}' for x in shares['writes'])} of bare (median {w:.0%}: "
            f"{'>= 1/3' if w >= 1 / 3 else 'NOT >= 1/3'}); reads "
            f"{', '.join(f'{x:.0%}' for x in shares['reads'])} (median {r:.0%}: "
            f"{'>= 1/2' if r >= 1 / 2 else 'NOT >= 1/2'})"
        )


if __name__ == "__main__":
    main()
