"""Heartbeat latency while tenants hold event streams open (issue 14, item 1).

For each backend it starts a real `cpn serve` (via api.processes, on a throwaway database: a
temp SQLite file, or a `cpn_bench_<random>` PostgreSQL database dropped at the end), makes a
cluster, a tenant with several keys and one PENDING job, opens N event streams of that job
(`GET /v1/jobs/{id}/events?stream=true`, what `cpn submit --wait` follows) spread over the
keys, and, with them open, sends one agent's heartbeats on a fixed schedule (open loop:
latency counts from the scheduled send time, so a stalled server cannot hide its queue).

N defaults to twice the API's pool (pool size + overflow: 20 + 20 on PostgreSQL, 5 + 10 on
SQLite), spread over N/4 keys (the default `CPN_MAX_STREAMS_PER_KEY`), so every stream is
admitted. The same script measures code from before the change: run it with `PYTHONPATH`
pointing at a checkout of that code, from inside it (`python -m` puts the working folder
first on the path):

    git worktree add /tmp/before <commit>
    cp bench/streams.py /tmp/before/bench/
    (cd /tmp/before && PYTHONPATH=/tmp/before /work/main/.venv/bin/python -m bench.streams)

Run: `.venv/bin/python -m bench.streams [--backends sqlite,postgres] [--beats 100] [--rate 5]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

ADMIN_TOKEN = "cpn_admin_bench-" + uuid.uuid4().hex
PG_SERVER = os.environ.get(
    "CPN_BENCH_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)
POOL = {"sqlite": 5 + 10, "postgres": 20 + 20}
"""Connections the API's pool may hold at once (pool size + overflow), per backend."""
PER_KEY = 4
SERVER_SETTINGS = {
    "CPN_RUN_CONTROLLER": "false",  # the job stays PENDING: its streams never end by themselves
    "CPN_HEARTBEAT_INTERVAL_S": "30",
    "CPN_LEASE_GRACE_S": "300",
    "CPN_KEY_RATE_LIMIT": "0",
    "CPN_AGENT_RATE_LIMIT": "0",
    "CPN_MAX_STREAMS_PER_KEY": str(PER_KEY),
}
BEAT = {
    "cluster": "bench-dc",
    "agent_version": "bench",
    "discovery": "inventory",
    "gpus": [{"model": "A100", "memory_gib": 80, "count": 8, "allocatable": 8}],
}
JOB = {"name": "streamed", "task": "builtin:mnist1d-mlp", "gpus": 8, "steps": 2000}


@dataclass
class Result:
    backend: str
    streams: int
    keys: int
    admitted: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    latencies_ms: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    def pct(self, p: float) -> float:
        return float(np.percentile(self.latencies_ms, p)) if self.latencies_ms else float("nan")


def _setup(url: str, n_keys: int) -> tuple[str, str, list[str]]:
    """A cluster and its agent key, a tenant with `n_keys` keys and a PENDING job."""
    from api.client import Client

    with Client(url, ADMIN_TOKEN, timeout=60) as admin:
        admin.create_cluster("bench-dc", "r1")
        agent = admin.create_api_key("agent", "bench-dc")["token"]
        tenant = admin.post("/v1/tenants", {"name": "bench"})
        tokens = [admin.create_api_key("tenant", tenant["id"])["token"] for _ in range(n_keys)]
    with Client(url, agent) as a:
        a.post("/v1/agent/heartbeat", BEAT)
    with Client(url, tokens[0], timeout=60) as t:
        job = t.submit(JOB)
    return agent, job.id, tokens


async def _hold(
    http: httpx.AsyncClient, path: str, token: str, result: Result, opened: asyncio.Event
) -> None:
    """Open one stream and read it until cancelled."""
    headers = {"Authorization": f"Bearer {token}", "Accept": "text/event-stream"}
    try:
        async with http.stream("GET", path, headers=headers) as response:
            if response.status_code != 200:
                result.refused[str(response.status_code)] = (
                    result.refused.get(str(response.status_code), 0) + 1
                )
                return
            result.admitted += 1
            opened.set()
            async for _line in response.aiter_lines():
                pass
    except httpx.HTTPError as exc:
        name = exc.__class__.__name__
        result.refused[name] = result.refused.get(name, 0) + 1


async def _measure(
    url: str, agent: str, job_id: str, tokens: list[str], result: Result, beats: int, rate: float
) -> None:
    limits = httpx.Limits(max_connections=result.streams + 50, max_keepalive_connections=0)
    timeout = httpx.Timeout(120.0)
    async with (
        httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as streams,
        httpx.AsyncClient(base_url=url, timeout=timeout) as beater,
    ):
        path = f"/v1/jobs/{job_id}/events?stream=true"
        opened = asyncio.Event()
        holders = [
            asyncio.create_task(_hold(streams, path, tokens[i % len(tokens)], result, opened))
            for i in range(result.streams)
        ]
        # Every stream asked for; give the server a moment to take them all in (those it
        # holds a connection for, and those queued for one).
        if holders:
            await asyncio.wait_for(opened.wait(), 120)
            await asyncio.sleep(3.0)

        loop = asyncio.get_running_loop()
        body = json.dumps(BEAT).encode()
        headers = {"Authorization": f"Bearer {agent}", "Content-Type": "application/json"}

        async def beat(due: float) -> None:
            try:
                r = await beater.post("/v1/agent/heartbeat", content=body, headers=headers)
                if r.status_code == 200:
                    result.latencies_ms.append((loop.time() - due) * 1000)
                else:
                    result.errors[f"HTTP {r.status_code}"] = (
                        result.errors.get(f"HTTP {r.status_code}", 0) + 1
                    )
            except httpx.HTTPError as exc:
                name = exc.__class__.__name__
                result.errors[name] = result.errors.get(name, 0) + 1

        start = loop.time() + 0.1
        sent = []
        for i in range(beats):
            due = start + i / rate
            await asyncio.sleep(max(0.0, due - loop.time()))
            sent.append(asyncio.create_task(beat(due)))
        await asyncio.gather(*sent)
        result.seconds = loop.time() - start
        for h in holders:
            h.cancel()
        await asyncio.gather(*holders, return_exceptions=True)


@contextmanager
def database(backend: str) -> Iterator[str]:
    if backend == "sqlite":
        with tempfile.TemporaryDirectory(prefix="cpn-bench-") as tmp:
            yield f"sqlite:///{tmp}/cpn.db"
    elif backend == "postgres":
        from controller.store.db import scratch_database

        with scratch_database(PG_SERVER, "cpn_bench") as url:
            yield url
    else:
        raise ValueError(f"unknown backend {backend!r}: use sqlite or postgres")


def run(backend: str, streams: int | None, beats: int, rate: float) -> Result:
    from api.processes import start_control_plane

    n = 2 * POOL[backend] if streams is None else streams
    result = Result(backend, n, max(1, -(-n // PER_KEY)))
    print(f"-- {backend}: {n} streams over {result.keys} keys", file=sys.stderr, flush=True)
    with database(backend) as url:
        plane = start_control_plane(url, ADMIN_TOKEN, settings=SERVER_SETTINGS)
        try:
            agent, job_id, tokens = _setup(plane.url, result.keys)
            asyncio.run(_measure(plane.url, agent, job_id, tokens, result, beats, rate))
        finally:
            plane.proc.stop()
    return result


def report(results: list[Result]) -> None:
    print(
        f"{'backend':<9} {'streams':>7} {'keys':>4} {'admitted':>8} {'beats ok':>8} "
        f"{'p50 ms':>9} {'p99 ms':>9} {'max ms':>9}  errors / refused streams"
    )
    for r in results:
        print(
            f"{r.backend:<9} {r.streams:>7} {r.keys:>4} {r.admitted:>8} "
            f"{len(r.latencies_ms):>8} {r.pct(50):>9.1f} {r.pct(99):>9.1f} "
            f"{max(r.latencies_ms, default=float('nan')):>9.1f}  {r.errors} / {r.refused}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="sqlite,postgres")
    parser.add_argument(
        "--streams",
        type=int,
        default=None,
        help="open streams (default 2x the API's pool; 0: heartbeats alone, for reference)",
    )
    parser.add_argument("--beats", type=int, default=100, help="heartbeats to time")
    parser.add_argument("--rate", type=float, default=5.0, help="heartbeats a second")
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    args = parser.parse_args()
    t = time.monotonic()
    results = [
        run(b.strip(), args.streams, args.beats, args.rate) for b in args.backends.split(",")
    ]
    report(results)
    print(f"({time.monotonic() - t:.0f} s)", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=1))


if __name__ == "__main__":
    main()
