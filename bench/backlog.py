"""One tenant's backlog beside another's single job: does the bystander wait (issue 48)?

Tenant A (budget 1e9) has `--backlog` pending 1-GPU jobs; tenant B (budget 1e9) submits one
1-GPU job once half of A's backlog is placed. A real `Controller` (its reconcile loop in its
own thread, jobs placed but not launched: no Ray) places the queue on `--clusters` clusters of
`--per-cluster` GPUs, enough for every job. Measured from the jobs' SCHEDULED events (the
control plane's clock):

- B's wait: its submission to its SCHEDULED event;
- A's placement rate (jobs a second) in each tenth of the backlog, so a rate that falls as
  A's placed jobs pile up shows.

Everything is written through the control plane's own code (`create_cluster`,
`ingest_heartbeat`, `submit_many`) on a real SQLite file or PostgreSQL database; nothing is
faked but the absence of Ray (the loop runs with `launch=False`, as `CPN_LAUNCH_JOBS=false`).

Run: `.venv/bin/python -m bench.backlog [--backend sqlite|postgres] [--backlog 10000]
[--budget-s 300] [--json PATH]`. Run nothing beside it (2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

BATCH = 500
"""Submissions written per transaction while seeding."""


@dataclass(frozen=True)
class Result:
    backend: str
    backlog: int
    clusters: int
    placed: int
    seconds: float
    bystander_wait_s: float | None
    """B's job: submission to SCHEDULED; None if it was not placed within the budget."""
    bystander_at_placed: int
    """How many of A's jobs were placed when B submitted."""
    rate_by_tenth: list[float | None]
    """A's jobs placed a second in each tenth of the backlog (None: not reached)."""
    rate_first_last: tuple[float | None, float | None]
    """A's jobs placed a second over its first and its last 200 placed."""
    load_avg: float


@contextmanager
def _database(backend: str) -> Iterator[str]:
    if backend == "postgres":
        from controller.store.db import scratch_database

        server = os.environ.get(
            "CPN_BENCH_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
        )
        with scratch_database(server, "cpn_bench") as url:
            yield url
        return
    with tempfile.TemporaryDirectory(prefix="cpn-bench-backlog-") as tmp:
        yield f"sqlite:///{Path(tmp) / 'cpn.db'}"


def _spec(name: str) -> Any:
    from wire.spec import JobSpec

    return JobSpec.model_validate(
        {"name": name, "task": "builtin:mnist1d-mlp", "gpus": 1, "steps": 100}
    )


def seed(url: str, clusters: int, per_cluster: int, backlog: int) -> tuple[str, str]:
    """The network, the two tenants and A's backlog; returns (A's id, B's id)."""
    from agents.protocol import GpuInventory, Heartbeat
    from controller.jobs.service import Submission, submit_many
    from controller.network.leases import LeasePolicy
    from controller.network.resources import create_cluster, ingest_heartbeat
    from controller.store.db import make_engine, make_sessionmaker
    from controller.store.migrate import upgrade
    from controller.store.models import GpuPrice, Tenant, utcnow

    upgrade(url)
    engine = make_engine(url)
    factory = make_sessionmaker(engine)
    leases = LeasePolicy(heartbeat_interval_s=3600.0, grace_s=3600.0)
    with factory() as s, s.begin():
        for i in range(clusters):
            cluster = create_cluster(s, f"dc-{i:03d}", f"region-{i // 10}", {})
            s.add(
                GpuPrice(
                    cluster_id=cluster.id,
                    gpu_model="A100-80GB",
                    qos_class="standard",
                    price_per_gpu_hour=Decimal("2.0") + Decimal(i % 7) / 10,
                    effective_from=utcnow() - timedelta(hours=1),
                )
            )
    with factory() as s, s.begin():
        for i in range(clusters):
            gpus = GpuInventory(
                model="A100-80GB", memory_gib=80, count=per_cluster, allocatable=per_cluster
            )
            ingest_heartbeat(s, Heartbeat(cluster=f"dc-{i:03d}", gpus=[gpus]), leases)
    with factory() as s, s.begin():
        a, b = Tenant(name="backlog", budget=1e9), Tenant(name="bystander", budget=1e9)
        s.add_all([a, b])
        s.flush()
        ids = a.id, b.id
    for start in range(0, backlog, BATCH):
        names = range(start, min(start + BATCH, backlog))
        items = [Submission(_spec(f"a-{n}"), ids[0]) for n in names]
        with factory() as s, s.begin():
            submit_many(s, items)
    engine.dispose()
    return ids


Measured = tuple[
    int, float, float | None, int, list[float | None], tuple[float | None, float | None]
]
"""A's jobs placed, seconds, B's wait, A's jobs placed when B submitted, rates by tenth."""


def measure(url: str, backlog: int, budget_s: float, bystander: str) -> Measured:
    """Run the loop until A's backlog is placed or `budget_s` passed; B submits when half of
    A's backlog is placed, or a third of `budget_s` passed, whichever is first."""
    from sqlalchemy import func, select

    from controller.jobs.service import Submission, submit_many
    from controller.loop.controller import Controller
    from controller.store.db import make_engine, make_sessionmaker
    from controller.store.models import Job, JobEvent

    engine = make_engine(url)
    factory = make_sessionmaker(engine)
    loop = Controller(factory, sqlite=url.startswith("sqlite"), interval_s=0.01, launch=False)

    def placed() -> int:
        with factory() as s:
            return int(
                s.scalar(select(func.count()).select_from(Job).where(Job.state != "PENDING")) or 0
            )

    t0 = time.monotonic()
    loop.start()
    b_job: str | None = None
    at_submit = 0
    done = 0
    try:
        while time.monotonic() - t0 < budget_s:
            done = placed()
            due = time.monotonic() - t0 >= budget_s / 3
            if b_job is None and (done >= backlog // 2 or due):
                at_submit = done
                with factory() as s, s.begin():
                    [made] = submit_many(s, [Submission(_spec("b-0"), bystander)])
                    b_job = made.job.id  # type: ignore[union-attr]
            if done >= backlog + (b_job is not None):
                break
            threading.Event().wait(0.2)
    finally:
        loop.stop()
    seconds = time.monotonic() - t0
    with factory() as s:
        events = s.execute(
            select(JobEvent.job_id, JobEvent.at)
            .where(JobEvent.kind == "state", JobEvent.to_state == "SCHEDULED")
            .order_by(JobEvent.at)
        ).all()
        wait = None
        if b_job is not None:
            job = s.get(Job, b_job)
            scheduled = [at for j, at in events if j == b_job]
            if job is not None and scheduled:
                wait = (scheduled[0] - job.created_at).total_seconds()
    engine.dispose()
    times = [at for j, at in events if j != b_job]
    tenth = max(backlog // 10, 1)
    rates: list[float | None] = []
    for k in range(10):
        lo, hi = k * tenth, (k + 1) * tenth - 1
        if hi < len(times) and hi > lo:
            span = (times[hi] - times[lo]).total_seconds()
            rates.append(round((hi - lo) / span, 1) if span > 0 else None)
        else:
            rates.append(None)

    def rate(lo: int, hi: int) -> float | None:
        if lo < 0 or hi >= len(times) or hi <= lo:
            return None
        span = (times[hi] - times[lo]).total_seconds()
        return round((hi - lo) / span, 1) if span > 0 else None

    ends = (rate(0, 199), rate(len(times) - 200, len(times) - 1))
    return len(times), seconds, wait, at_submit, rates, ends


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=("sqlite", "postgres"), default="sqlite")
    p.add_argument("--backlog", type=int, default=10_000)
    p.add_argument("--clusters", type=int, default=100)
    p.add_argument("--budget-s", type=float, default=300.0)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    per_cluster = -(-(args.backlog + 1) // args.clusters) + 1
    with _database(args.backend) as url:
        t = time.monotonic()
        _a, b = seed(url, args.clusters, per_cluster, args.backlog)
        print(f"seeded {args.backlog} jobs in {time.monotonic() - t:.1f} s", flush=True)
        load = os.getloadavg()[0]
        placed, seconds, wait, at_submit, rates, ends = measure(url, args.backlog, args.budget_s, b)
    result = Result(
        args.backend, args.backlog, args.clusters, placed, round(seconds, 1),
        None if wait is None else round(wait, 2), at_submit, rates, ends, round(load, 1),
    )  # fmt: skip
    print(json.dumps(asdict(result)))
    if args.json:
        args.json.write_text(json.dumps(asdict(result), indent=1) + "\n")


if __name__ == "__main__":
    main()
