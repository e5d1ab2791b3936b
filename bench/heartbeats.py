"""Heartbeat ingestion: thousands of simulated agents beating at one `cpn serve`.

For each target -- cpn on SQLite, cpn on PostgreSQL, and the bare FastAPI endpoint of
`bench.bare_app` (the ceiling: same body, same answer, same uvicorn, no work) -- it measures

1. closed loop: every agent beats again as soon as its last beat is answered, all at once;
   reports/s is the most the server takes;
2. open loop: beats sent on a fixed schedule (default 1,000/s, each agent every
   agents/rate seconds) whether or not earlier ones were answered; latency counts from the
   scheduled send time, so a stalled server cannot hide its queue (no coordinated omission).

The servers are real processes (`cpn db upgrade` + `cpn serve`, via api.processes); the load
generator is another process (asyncio + aiohttp). Agents, clusters and keys are written to a
throwaway database (a temp SQLite file; a `cpn_bench_<random>` PostgreSQL database, dropped
at the end) before the server starts.

Run: `.venv/bin/python -m bench.heartbeats [--agents 2000] [--rates 200,1000] [--targets ...]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import signal
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

from bench.bare_app import peer_name

ADMIN_TOKEN = "cpn_admin_bench-" + uuid.uuid4().hex
PG_SERVER = os.environ.get(
    "CPN_BENCH_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)
RESULTS = Path(__file__).resolve().parent / "results"
PERCENTILES = (50, 90, 99, 99.9)
SERVER_SETTINGS = {
    "CPN_HEARTBEAT_INTERVAL_S": "30",
    "CPN_LEASE_GRACE_S": "120",
    "CPN_AGENT_RATE_LIMIT": "0",
}
"""A lease long enough that the load's own queueing (seconds, in the closed loop) never counts
as a missed beat: otherwise the lease monitor marks clusters SUSPECT and each of their next
beats takes the slower state-change path, which measures the monitor, not ingestion. The
per-agent rate limit is off: a closed loop over a few agents beats far faster than a real one."""


@dataclass(frozen=True)
class Agent:
    cluster: str
    token: str
    body: bytes


def make_agents(n: int, peers: int) -> list[Agent]:
    """n agents with one GPU model each; the first `peers` serve probes (so acks list them)."""
    agents = []
    for i in range(n):
        name = peer_name(i)
        hb: dict[str, Any] = {
            "cluster": name,
            "agent_version": "bench",
            "discovery": "inventory",
            "gpus": [{"model": "A100-80GB", "memory_gib": 80, "count": 8, "allocatable": 8}],
        }
        if i < peers:
            hb["probe_url"] = f"http://10.0.{i // 250}.{i % 250}:7070"
        agents.append(Agent(name, f"cpn_agent_bench-{uuid.uuid4().hex}", json.dumps(hb).encode()))
    return agents


# ---- load generator (its own process) ------------------------------------------------------


@dataclass
class Run:
    """One measurement: latencies in seconds of the beats answered 200, and the rest."""

    name: str
    seconds: float
    latencies: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return len(self.latencies) / self.seconds if self.seconds > 0 else 0.0

    def pct(self, p: float) -> float:
        return float(np.percentile(self.latencies, p)) * 1000 if self.latencies else float("nan")


async def _beat(session: Any, url: str, agent: Agent) -> str | None:
    """POST one heartbeat; None when answered 200, else what went wrong."""
    try:
        async with session.post(
            url,
            data=agent.body,
            headers={"Authorization": f"Bearer {agent.token}", "Content-Type": "application/json"},
        ) as resp:
            await resp.read()
            return None if resp.status == 200 else f"HTTP {resp.status}"
    except Exception as exc:
        return exc.__class__.__name__


async def _load(
    url: str, agents: list[Agent], closed_s: float, rates: list[float], open_s: float
) -> tuple[Run, list[Run]]:
    import aiohttp

    target = f"{url}/v1/agent/heartbeat"
    # Idle connections are dropped before uvicorn does (its keep-alive is 5 s), so none is
    # reused just as the server closes it.
    connector = aiohttp.TCPConnector(limit=len(agents), ttl_dns_cache=None, keepalive_timeout=3)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        # Warm-up: every agent beats once (its cluster goes PENDING -> READY), in batches.
        closed = Run("closed", closed_s)
        for i in range(0, len(agents), 200):
            batch = agents[i : i + 200]
            for err in await asyncio.gather(*(_beat(session, target, a) for a in batch)):
                if err:
                    closed.errors[f"warm-up {err}"] = closed.errors.get(f"warm-up {err}", 0) + 1

        # Closed loop: all agents at once, each beating again as soon as it is answered.
        loop = asyncio.get_running_loop()
        start = loop.time()
        stop = start + closed_s

        async def agent_loop(agent: Agent) -> None:
            while (t0 := loop.time()) < stop:
                err = await _beat(session, target, agent)
                t1 = loop.time()
                if t1 > stop:
                    return  # answered after the window: not counted
                if err:
                    closed.errors[err] = closed.errors.get(err, 0) + 1
                else:
                    closed.latencies.append(t1 - t0)

        await asyncio.gather(*(agent_loop(a) for a in agents))
        await asyncio.sleep(1.0)  # let the server drain what the window cut off

        opened_runs = []
        for rate in rates:
            # Open loop: beat i is due at start + i/rate, sent then whatever came before.
            total = int(rate * open_s)
            opened = Run("open", open_s)
            tasks: list[asyncio.Task[None]] = []
            start = loop.time() + 0.1

            async def scheduled(i: int, due: float, run: Run = opened) -> None:
                err = await _beat(session, target, agents[i % len(agents)])
                if err:
                    run.errors[err] = run.errors.get(err, 0) + 1
                else:
                    run.latencies.append(loop.time() - due)

            i = 0
            while i < total:
                now = loop.time()
                due = start + i / rate
                if due > now:
                    await asyncio.sleep(due - now)
                    continue
                while i < total and start + i / rate <= now:
                    tasks.append(loop.create_task(scheduled(i, start + i / rate)))
                    i += 1
            await asyncio.gather(*tasks)
            opened.seconds = max(open_s, loop.time() - start)
            opened_runs.append(opened)
            await asyncio.sleep(1.0)
        return closed, opened_runs


def _loadgen_main(
    url: str, agents: list[Agent], closed_s: float, rates: list[float], open_s: float, out: Any
) -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    try:
        out.put(("ok", asyncio.run(_load(url, agents, closed_s, rates, open_s))))
    except Exception as exc:
        out.put(("error", f"{exc.__class__.__name__}: {exc}"))


def run_load(
    url: str, agents: list[Agent], closed_s: float, rates: list[float], open_s: float
) -> tuple[Run, list[Run]]:
    """Drive `url` from a separate process (the server must not share our interpreter)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_loadgen_main, args=(url, agents, closed_s, rates, open_s, out))
    proc.start()
    try:
        status, value = out.get(timeout=closed_s + len(rates) * (open_s + 60) + 180)
        proc.join(timeout=30)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=10)
    if status != "ok":
        raise RuntimeError(f"load generator failed: {value}")
    return value


# ---- targets -------------------------------------------------------------------------------


def seed(url: str, agents: list[Agent]) -> None:
    """Migrate, then write one cluster and one agent key per agent, in one transaction."""
    from controller.access import keys
    from controller.store.db import make_engine, make_sessionmaker
    from controller.store.migrate import upgrade
    from controller.store.models import Cluster

    upgrade(url)
    engine = make_engine(url)
    with make_sessionmaker(engine)() as session, session.begin():
        session.add_all(Cluster(name=a.cluster, region=f"r{i % 8}") for i, a in enumerate(agents))
        for a in agents:
            keys.create_key(session, "agent", a.cluster, f"agent {a.cluster}", a.token)
    engine.dispose()


def postgres_database() -> AbstractContextManager[str]:
    from controller.store.db import scratch_database

    return scratch_database(PG_SERVER, "cpn_bench")


@contextmanager
def cpn_server(url: str, workers: int = 1) -> Iterator[str]:
    from api.processes import start_control_plane

    plane = start_control_plane(
        url, ADMIN_TOKEN, migrate=False, settings=SERVER_SETTINGS, workers=workers
    )
    try:
        yield plane.url
    finally:
        plane.proc.stop()


@contextmanager
def bare_server(peers: int) -> Iterator[str]:
    from api.processes import LISTENING, spawn

    args = ["--port", "0", "--peers", str(peers)]
    proc, url = spawn("bare app", args, {}, wait_for=LISTENING, module="bench.bare_app")
    assert url is not None
    try:
        yield url
    finally:
        proc.stop()


@dataclass
class Result:
    target: str
    closed: Run
    opened: list[Run]


@contextmanager
def serving(target: str, agents: list[Agent], peers: int, workers: int = 1) -> Iterator[str]:
    """A server for `target` on a free port, over a freshly seeded database; yields its URL."""
    if target == "bare":
        with bare_server(peers) as url:
            yield url
    elif target == "sqlite":
        with tempfile.TemporaryDirectory(prefix="cpn-bench-") as tmp:
            db = f"sqlite:///{tmp}/cpn.db"
            seed(db, agents)
            with cpn_server(db, workers) as url:
                yield url
    elif target == "postgres":
        with postgres_database() as db:
            seed(db, agents)
            with cpn_server(db, workers) as url:
                yield url
    else:
        raise ValueError(f"unknown target {target!r}: use bare, sqlite or postgres")


def measure(target: str, agents: list[Agent], args: argparse.Namespace) -> Result:
    print(f"-- {target}: {len(agents)} agents", file=sys.stderr, flush=True)
    t = time.monotonic()
    with serving(target, agents, args.peers, args.workers) as url:
        closed, opened = run_load(url, agents, args.closed_seconds, args.rates, args.open_seconds)
    print(f"   done in {time.monotonic() - t:.0f}s", file=sys.stderr, flush=True)
    return Result(target, closed, opened)


# ---- report --------------------------------------------------------------------------------


LABELS = {
    "bare": "bare FastAPI (ceiling)",
    "sqlite": "cpn serve, SQLite",
    "postgres": "cpn serve, PostgreSQL",
}


def table(results: list[Result], rates: list[float], n_agents: int, workers: int = 1) -> None:
    from rich.console import Console
    from rich.table import Table

    bare = next((r for r in results if r.target == "bare"), None)
    t = Table(title=f"Heartbeat ingestion, {n_agents:,} agents, cpn serve --workers {workers}")
    cols = ["target", "closed: reports/s", "of bare", "p50 ms", "p99 ms"]
    for rate in rates:
        cols += [f"open {rate:g}/s: got/s", "p50 ms", "p99 ms"]
    for col in [*cols, "errors"]:
        t.add_column(col, justify="left" if col == "target" else "right")
    for r in results:
        share = f"{r.closed.rate / bare.closed.rate:.0%}" if bare and bare.closed.rate else "-"
        errors = sum(sum(run.errors.values()) for run in (r.closed, *r.opened))
        row = [
            LABELS[r.target],
            f"{r.closed.rate:,.0f}",
            share,
            f"{r.closed.pct(50):.0f}",
            f"{r.closed.pct(99):.0f}",
        ]
        for run in r.opened:
            row += [f"{run.rate:,.0f}", f"{run.pct(50):.1f}", f"{run.pct(99):.1f}"]
        t.add_row(*row, str(errors))
    Console(width=180).print(t)
    for r in results:
        for run in (r.closed, *r.opened):
            if run.errors:
                print(f"{LABELS[r.target]} {run.name} loop errors: {run.errors}")
    if bare:
        top = max(rates)
        for r in results:
            if r.target == "bare":
                continue
            last = r.opened[rates.index(top)]
            ok_rate = r.closed.rate >= bare.closed.rate / 2
            ok_p99 = last.pct(99) < 100 and last.rate >= top * 0.95
            print(
                f"target {LABELS[r.target]}: >= half the bare throughput: "
                f"{'yes' if ok_rate else 'NO'}; p99 < 100 ms at {top:g}/s: "
                f"{'yes' if ok_p99 else 'NO'}"
            )


def plot(results: list[Result], rates: list[float], n_agents: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rates) + 1, figsize=(5.5 * (len(rates) + 1), 4.2))
    width = 0.8 / max(1, len(results))
    xs = np.arange(len(PERCENTILES))
    for j, rate in enumerate(rates):
        ax = axes[j]
        for k, r in enumerate(results):
            ax.bar(
                xs + k * width,
                [r.opened[j].pct(p) for p in PERCENTILES],
                width,
                label=LABELS[r.target],
            )
        ax.set_xticks(xs + width * (len(results) - 1) / 2, [f"p{p:g}" for p in PERCENTILES])
        ax.set_yscale("log")
        ax.axhline(100, color="red", linestyle="--", linewidth=1, label="100 ms target")
        ax.set_ylabel("latency from scheduled send, ms (log)")
        ax.set_title(f"open loop, {rate:g} heartbeats/s")
        ax.legend(fontsize=8)
    names = [LABELS[r.target] for r in results]
    axes[-1].barh(names, [r.closed.rate for r in results], color="tab:gray")
    for y, r in enumerate(results):
        axes[-1].text(r.closed.rate, y, f" {r.closed.rate:,.0f}", va="center", fontsize=8)
    axes[-1].set_xlabel("reports/s")
    axes[-1].set_title(f"closed loop, {n_agents:,} agents at once")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def _exit_on_term(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=2000, help="simulated agents (clusters)")
    parser.add_argument(
        "--peers",
        type=int,
        default=16,
        help="agents that serve probes, so every ack lists them as peers",
    )
    parser.add_argument(
        "--rates",
        default="200,1000",
        help="open-loop reports/s, comma-separated (200/s is 2,000 agents "
        "at the default 10 s interval)",
    )
    parser.add_argument("--open-seconds", type=float, default=10.0)
    parser.add_argument("--closed-seconds", type=float, default=8.0)
    parser.add_argument(
        "--targets", default="bare,sqlite,postgres", help="comma-separated: bare, sqlite, postgres"
    )
    parser.add_argument(
        "--workers", type=int, default=1, help="cpn serve --workers (the bare app keeps one)"
    )
    parser.add_argument("--plot", type=Path, default=RESULTS / "heartbeats.png")
    args = parser.parse_args()
    try:
        args.rates = sorted(float(r) for r in args.rates.split(",") if r.strip())
    except ValueError:
        parser.error("--rates: give numbers separated by commas, e.g. 200,1000")
    if args.agents < 1 or not args.rates or min(args.rates) <= 0 or args.workers < 1:
        parser.error("--agents, --rates and --workers must be positive")
    signal.signal(signal.SIGTERM, _exit_on_term)  # so servers and databases are cleaned up
    agents = make_agents(args.agents, min(args.peers, args.agents))
    results = [measure(t.strip(), agents, args) for t in args.targets.split(",") if t.strip()]
    table(results, args.rates, len(agents), args.workers)
    plot(results, args.rates, len(agents), args.plot)


if __name__ == "__main__":
    main()
