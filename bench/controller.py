"""The control loop's costs: time to the first training step, placement throughput, overhead.

1. Submission -> first training step. The demo's network (three clusters with real
   `cpn agent` processes, prices, pinned WAN links) on a real `cpn serve` (SQLite, then
   PostgreSQL); the demo job (builtin:mnist1d-mlp, 6 GPUs, 300 steps, compression/sync auto)
   is submitted twice: the first launch starts the controller's local Ray (cold), the second
   finds it running (warm). Broken down from the job's state events (server clock):
   created -> SCHEDULED (the reconcile loop), SCHEDULED -> RUNNING (launch), RUNNING -> first
   progress event (Ray actors start, first steps, first batched flush).
2. Placement throughput. 100 clusters (registered, one heartbeat each with their agent key,
   no agent processes), prices, links inside each region of 10, and 1,000 pending jobs
   submitted over the API to a `cpn serve` with the controller off. Then the database is copied
   and placed two ways: (a) `controller.loop.placement.place_pending` called in-process until the
   queue is drained (the loop's placement code alone); (b) a `cpn serve` with
   CPN_LAUNCH_JOBS=false placing them in its own loop (timed from the first to the last
   SCHEDULED event).
3. Overhead. The demo job under cpn (RUNNING -> SUCCEEDED, and created -> SUCCEEDED) against
   the same training run standalone: `training.run(TrainSpec(...))` in a fresh process with
   the placement, compression, sync and links cpn chose and the job's outer_lr/outer_momentum
   (which `cpn train` has no flags for). Standalone training = the `run()` call after
   `ray.init`; standalone end-to-end = the whole process (Python start, imports, Ray start,
   run, exit).

Run: `.venv/bin/python -m bench.controller [--backends sqlite,postgres] [--jobs 1000]
[--clusters 100] [--skip-loop]`. Placement alone, before/after on the very same queue:
`--clusters C --jobs N --seed-only URL` once, then `--place-copy-of URL
[--placement-budget-s S]` with each version of the code. PostgreSQL: a throwaway
`cpn_bench_<random>` database on CPN_BENCH_PG_URL (default postgres@127.0.0.1:5432),
dropped at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from api.cli.demo import demo_job_spec
from api.processes import wait_until

ADMIN_TOKEN = "cpn_admin_bench-" + uuid.uuid4().hex
PG_SERVER = os.environ.get(
    "CPN_BENCH_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)
RESULTS = Path(__file__).resolve().parent / "results"
DEMO_SETTINGS = {  # as `cpn demo` runs its control plane
    "CPN_HEARTBEAT_INTERVAL_S": "1",
    "CPN_LEASE_GRACE_S": "4",
    "CPN_PROBE_INTERVAL_S": "5",
    "CPN_PROBE_BYTES": str(1 << 20),
    "CPN_RECONCILE_INTERVAL_S": "0.5",
    "CPN_RAY_NUM_CPUS": "2",
}
QUIET_LEASES = {"CPN_HEARTBEAT_INTERVAL_S": "60", "CPN_LEASE_GRACE_S": "3600"}
"""Placement bench: no agents beat after the first heartbeat, so leases must outlive it."""


def _ts(value: str) -> float:
    return datetime.fromisoformat(value).timestamp()


# ---- databases ------------------------------------------------------------------------------


def postgres_database(template: str | None = None) -> AbstractContextManager[str]:
    """A throwaway `cpn_bench_<random>` database (optionally a copy of `template`)."""
    from controller.store.db import scratch_database

    return scratch_database(PG_SERVER, "cpn_bench", template)


@contextmanager
def database(backend: str, workdir: Path, template: str | None = None) -> Iterator[str]:
    if backend == "postgres":
        with postgres_database(template) as url:
            yield url
        return
    path = workdir / f"cpn-{uuid.uuid4().hex[:6]}.db"
    if template:
        src = Path(template.removeprefix("sqlite:///"))
        for suffix in ("", "-wal", "-shm"):
            if Path(f"{src}{suffix}").exists():
                shutil.copy(f"{src}{suffix}", f"{path}{suffix}")
    yield f"sqlite:///{path}"


# ---- 1 + 3: the demo job under cpn -----------------------------------------------------------


@dataclass
class JobTiming:
    backend: str
    label: str  # "cold Ray" / "warm Ray"
    to_scheduled: float
    to_running: float
    to_first_progress: float
    running_to_succeeded: float
    total: float
    train_wall_s: float  # the run's own report (inside training.run)
    placement: dict[str, int]
    compression: str
    sync: str
    accuracy: float


def demo_jobs(backend: str, workdir: Path, steps: int, n_jobs: int) -> list[JobTiming]:
    from api.cli.demo import DEMO_CLUSTERS, DEMO_LINKS, price_cluster
    from api.client import Client
    from api.processes import start_agent, start_control_plane, write_inventory

    out: list[JobTiming] = []
    with database(backend, workdir) as url:
        settings = {**DEMO_SETTINGS, "CPN_CHECKPOINT_ROOT": str(workdir / f"ckpt-{backend}")}
        plane = start_control_plane(url, ADMIN_TOKEN, settings=settings)
        agents = []
        try:
            with Client(plane.url, ADMIN_TOKEN, timeout=60) as admin:
                for name, spec in DEMO_CLUSTERS.items():
                    admin.create_cluster(name, spec["region"])
                    token = admin.create_api_key("agent", name)["token"]
                    price_cluster(admin, name, spec)
                    inventory = write_inventory(
                        workdir / f"{backend}-{name}.yaml",
                        [
                            {
                                "model": spec["model"],
                                "memory_gib": spec["memory"],
                                "count": spec["count"],
                            }
                        ],
                    )
                    agents.append(start_agent(name, plane.url, token, inventory))
                for a, b, values in DEMO_LINKS:
                    admin.declare_link(a, b, pinned=True, **values)
                wait_until(
                    lambda: all(c["state"] == "READY" and c["gpus"] for c in admin.clusters()),
                    120,
                    "clusters READY",
                    every=0.2,
                )
                tenant_id = admin.post("/v1/tenants", {"name": "bench"})["id"]
                tenant_token = admin.create_api_key("tenant", tenant_id)["token"]
                with Client(plane.url, tenant_token, timeout=60) as tenant:
                    for i in range(n_jobs):
                        label = "cold Ray" if i == 0 else "warm Ray"
                        print(f"   {backend}: demo job {i + 1} ({label})", file=sys.stderr)
                        job = tenant.submit(demo_job_spec(f"bench-{i}", steps))
                        out.append(_follow(tenant, job.id, backend, label))
        finally:
            for agent in agents:
                agent.stop()
            plane.proc.stop(timeout=60)
    return out


def _follow(tenant: Any, job_id: str, backend: str, label: str) -> JobTiming:
    done = wait_until(
        lambda: (
            (j := tenant.job(job_id).model_dump(mode="json"))["state"]
            in ("SUCCEEDED", "FAILED", "CANCELLED")
            and j
        ),
        600,
        f"job {job_id} to finish",
        every=0.2,
    )
    events = list(tenant.paginate(f"/v1/jobs/{job_id}/events"))
    if done["state"] != "SUCCEEDED":
        raise RuntimeError(f"job {job_id} ended {done['state']}: {events[-3:]}")
    at: dict[str, float] = {}
    first_progress = None
    report: dict[str, Any] = {}
    for e in events:
        if e["kind"] == "state":
            at.setdefault(e["to_state"], _ts(e["at"]))
            if e["to_state"] == "SUCCEEDED":
                report = e["data"].get("report", {})
        elif e["kind"] == "progress" and first_progress is None:
            first_progress = _ts(e["at"])
    created = _ts(done["created_at"])
    placement = done["placement"]
    return JobTiming(
        backend=backend,
        label=label,
        to_scheduled=at["SCHEDULED"] - created,
        to_running=at["RUNNING"] - at["SCHEDULED"],
        to_first_progress=(first_progress or float("nan")) - at["RUNNING"],
        running_to_succeeded=at["SUCCEEDED"] - at["RUNNING"],
        total=at["SUCCEEDED"] - created,
        train_wall_s=float(report.get("wall_s", float("nan"))),
        placement={c["cluster"]: c["gpus"] for c in placement["clusters"]},
        compression=str(report.get("compression", placement["compression"])),
        sync=str(report.get("sync", placement["sync"])),
        accuracy=float(report.get("final_accuracy", float("nan"))),
    )


STANDALONE = """
import json, sys, time
t0 = time.time()
import ray
from training import LinkSpec, TrainSpec, cluster_resource, run
cfg = json.loads(sys.argv[1])
ray.init(num_cpus=cfg["cpus"], include_dashboard=False, log_to_driver=False,
         resources={cluster_resource(c): float(n) for c, n in cfg["clusters"].items()})
t1 = time.time()
report = run(TrainSpec(task="builtin:mnist1d-mlp", clusters=cfg["clusters"],
                       compression=cfg["compression"], sync=cfg["sync"], steps=cfg["steps"],
                       links=[LinkSpec(*link) for link in cfg["links"]],
                       outer_lr=1.0, outer_momentum=0.0))
t2 = time.time()
print(json.dumps({"ray_start": t1 - t0, "train": t2 - t1, "wall_s": report.wall_s,
                  "accuracy": report.final_accuracy}))
ray.shutdown()
"""


@dataclass
class Standalone:
    process_s: float  # python start -> exit
    ray_start_s: float
    train_s: float  # the run() call
    wall_s: float  # the run's own report
    accuracy: float


def standalone(job: JobTiming, steps: int) -> Standalone:
    """The same training run, no cpn: one process calling training.run."""
    from api.cli.demo import DEMO_LINKS

    links = [
        (a, b, v["bandwidth_gbps"] * 1000, v["rtt_ms"])
        for a, b, v in DEMO_LINKS
        if a in job.placement and b in job.placement
    ]
    cfg = {
        "clusters": job.placement,
        "compression": job.compression,
        "sync": job.sync,
        "steps": steps,
        "links": links,
        "cpus": int(DEMO_SETTINGS["CPN_RAY_NUM_CPUS"]),
    }
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", STANDALONE, json.dumps(cfg)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    elapsed = time.monotonic() - t0
    if done.returncode != 0:
        raise RuntimeError(f"standalone run failed:\n{done.stderr[-2000:]}")
    r = json.loads(done.stdout.strip().splitlines()[-1])
    return Standalone(elapsed, r["ray_start"], r["train"], r["wall_s"], r["accuracy"])


# ---- 2: placement throughput -----------------------------------------------------------------


@dataclass
class Throughput:
    backend: str
    how: str
    placed: int
    waiting: int
    seconds: float
    setup_s: float = 0.0
    submit_rate: float = 0.0
    passes: list[float] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.placed / self.seconds if self.seconds > 0 else 0.0


def _job_sizes(n: int, per_cluster: int, rng: random.Random) -> list[int]:
    """Mostly 1-GPU jobs, some 2-8, and 2% too big for one cluster (placed across a region)."""
    sizes = []
    for _ in range(n):
        r = rng.random()
        sizes.append(1 if r < 0.88 else rng.randint(2, 8) if r < 0.98 else per_cluster + 16)
    return sizes


def seed_network(url: str, n_clusters: int, n_jobs: int, per_cluster: int) -> tuple[float, float]:
    """Clusters, heartbeats, prices, links and pending jobs, all over the API of a real
    `cpn serve` whose controller is off. Returns (setup seconds, submissions per second)."""
    import httpx

    from api.client import Client
    from api.processes import start_control_plane

    t0 = time.monotonic()
    plane = start_control_plane(
        url,
        ADMIN_TOKEN,
        # One admin and one tenant key seed everything: the per-key rate limit is off (0).
        settings={**QUIET_LEASES, "CPN_RUN_CONTROLLER": "false", "CPN_KEY_RATE_LIMIT": "0"},
    )
    rng = random.Random(7)
    names = [f"dc-{i:03d}" for i in range(n_clusters)]
    try:
        with Client(plane.url, ADMIN_TOKEN, timeout=120) as admin, ThreadPoolExecutor(4) as pool:

            def cluster(i_name: tuple[int, str]) -> None:
                i, name = i_name
                admin.create_cluster(name, f"region-{i // 10}")
                token = admin.create_api_key("agent", name)["token"]
                beat = {
                    "cluster": name,
                    "agent_version": "bench",
                    "discovery": "inventory",
                    "gpus": [
                        {
                            "model": "A100-80GB",
                            "memory_gib": 80,
                            "count": per_cluster,
                            "allocatable": per_cluster,
                        }
                    ],
                }
                r = httpx.post(
                    f"{plane.url}/v1/agent/heartbeat",
                    json=beat,
                    headers={"Authorization": f"Bearer {token}"},
                    timeout=60,
                )
                r.raise_for_status()
                admin.post(
                    "/v1/pricing/gpu",
                    {
                        "cluster": name,
                        "gpu_model": "A100-80GB",
                        "qos_class": "standard",
                        "price_per_gpu_hour": round(1.5 + rng.random() * 2, 2),
                    },
                )

            list(pool.map(cluster, enumerate(names)))
            pairs = [
                (names[a], names[b])
                for a in range(n_clusters)
                for b in range(a + 1, n_clusters)
                if a // 10 == b // 10
            ]
            list(
                pool.map(
                    lambda p: admin.declare_link(
                        p[0],
                        p[1],
                        bandwidth_gbps=round(0.5 + rng.random() * 9.5, 2),
                        rtt_ms=round(5 + rng.random() * 60, 1),
                        egress_price_per_gb=0.02,
                    ),
                    pairs,
                )
            )
            tenant_id = admin.post("/v1/tenants", {"name": "bench"})["id"]
            token = admin.create_api_key("tenant", tenant_id)["token"]
            with Client(plane.url, token, timeout=120) as tenant:
                sizes = _job_sizes(n_jobs, per_cluster, rng)
                t1 = time.monotonic()
                list(
                    pool.map(
                        lambda ig: tenant.submit(
                            {
                                "name": f"p-{ig[0]}",
                                "task": "builtin:mnist1d-mlp",
                                "gpus": ig[1],
                                "steps": 100,
                            }
                        ),
                        enumerate(sizes),
                    )
                )
                submit_rate = n_jobs / (time.monotonic() - t1)
    finally:
        plane.proc.stop(timeout=60)
    return time.monotonic() - t0, submit_rate


def place_in_process(backend: str, url: str, budget_s: float = 120.0) -> Throughput:
    """Passes of place_pending until the queue drains or `budget_s` is spent (then the rate is
    over the passes done: the queue still held most of its jobs, as a busy loop's would)."""
    from sqlalchemy import func, select

    from controller.loop.placement import place_pending
    from controller.store.db import make_engine, make_sessionmaker
    from controller.store.models import Job

    engine = make_engine(url)
    factory = make_sessionmaker(engine)
    passes: list[float] = []
    placed = 0
    t0 = time.monotonic()
    for _ in range(1000):  # bounded: 64 jobs a pass at most
        t = time.monotonic()
        got = place_pending(factory, "bench-replica")
        passes.append(time.monotonic() - t)
        placed += len(got)
        if not got or time.monotonic() - t0 > budget_s:
            break
    seconds = time.monotonic() - t0
    with factory() as session:
        waiting = session.scalar(
            select(func.count()).select_from(Job).where(Job.state == "PENDING")
        )
    engine.dispose()
    return Throughput(
        backend, "place_pending in-process", placed, int(waiting or 0), seconds, passes=passes
    )


def place_copy(seeded: str, budget_s: float) -> dict[str, Any]:
    """`place_in_process` on a copy of the seeded database at `seeded` (kept as it is, so the
    very same queue can be placed again, e.g. by another version of the code)."""
    backend = "sqlite" if seeded.startswith("sqlite") else "postgres"
    with (
        tempfile.TemporaryDirectory(prefix="cpn-bench-place-") as tmp,
        database(backend, Path(tmp), seeded) as url,
    ):
        load = os.getloadavg()[0]
        cpu = time.process_time()
        got = place_in_process(backend, url, budget_s)
        cpu = time.process_time() - cpu
    return {
        "backend": backend,
        "placed": got.placed,
        "waiting": got.waiting,
        "seconds": round(got.seconds, 2),
        "jobs_per_s": round(got.rate, 1),
        "jobs_per_cpu_s": round(got.placed / cpu, 1) if cpu > 0 else None,
        "load_avg": round(load, 1),
        "passes": len(got.passes),
    }


def place_by_loop(backend: str, url: str, expect: int, interval: str) -> Throughput:
    """A real `cpn serve` (CPN_LAUNCH_JOBS=false) places the queue in its loop."""
    from sqlalchemy import func, select

    from api.processes import start_control_plane
    from controller.store.db import make_engine, make_sessionmaker
    from controller.store.models import Job, JobEvent

    plane = start_control_plane(
        url,
        ADMIN_TOKEN,
        migrate=False,
        settings={
            **QUIET_LEASES,
            "CPN_LAUNCH_JOBS": "false",
            "CPN_RECONCILE_INTERVAL_S": interval,
        },
    )
    engine = make_engine(url)
    factory = make_sessionmaker(engine)

    def scheduled() -> int:
        with factory() as session:
            return int(
                session.scalar(
                    select(func.count()).select_from(Job).where(Job.state == "SCHEDULED")
                )
                or 0
            )

    try:
        last, still = -1, 0.0
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            n = scheduled()
            if n >= expect:
                break
            if n == last:
                still += 0.5
                if still >= 10:  # no progress for 10 s: the rest waits
                    break
            else:
                last, still = n, 0.0
            time.sleep(0.5)
    finally:
        plane.proc.stop(timeout=60)
    with factory() as session:
        ats = session.scalars(
            select(JobEvent.at).where(JobEvent.kind == "state", JobEvent.to_state == "SCHEDULED")
        ).all()
        waiting = session.scalar(
            select(func.count()).select_from(Job).where(Job.state == "PENDING")
        )
    engine.dispose()
    times = sorted(a.timestamp() for a in ats)
    seconds = times[-1] - times[0] if len(times) > 1 else float("nan")
    return Throughput(
        backend, f"cpn serve loop ({interval} s)", len(times), int(waiting or 0), seconds
    )


def throughput(
    backend: str, workdir: Path, n_clusters: int, n_jobs: int, loop: bool, budget_s: float
) -> list[Throughput]:
    per_cluster = 32
    out = []
    with database(backend, workdir) as seeded:
        print(f"   {backend}: seeding {n_clusters} clusters, {n_jobs} jobs", file=sys.stderr)
        setup_s, submit_rate = seed_network(seeded, n_clusters, n_jobs, per_cluster)
        with database(backend, workdir, template=seeded) as url:
            print(f"   {backend}: place_pending in-process", file=sys.stderr)
            result = place_in_process(backend, url, budget_s)
            result.setup_s, result.submit_rate = setup_s, submit_rate
            out.append(result)
        if loop:
            with database(backend, workdir, template=seeded) as url:
                print(f"   {backend}: cpn serve loop", file=sys.stderr)
                out.append(place_by_loop(backend, url, result.placed, "0.05"))
    return out


# ---- report ----------------------------------------------------------------------------------


def report(
    jobs: list[JobTiming], alone: list[Standalone], placements: list[Throughput], steps: int
) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=160)
    t = Table(title=f"Submission -> first training step (demo job: 6 GPUs, {steps} steps)")
    for col in (
        "backend",
        "job",
        "placement",
        "created->SCHEDULED s",
        "SCHEDULED->RUNNING s",
        "RUNNING->1st progress s",
        "created->1st progress s",
        "RUNNING->SUCCEEDED s",
        "created->SUCCEEDED s",
    ):
        t.add_column(col, justify="left" if col in ("backend", "job", "placement") else "right")
    for j in jobs:
        t.add_row(
            j.backend,
            j.label,
            ",".join(f"{c}:{n}" for c, n in j.placement.items()) + f" {j.compression} {j.sync}",
            f"{j.to_scheduled:.2f}",
            f"{j.to_running:.2f}",
            f"{j.to_first_progress:.2f}",
            f"{j.to_scheduled + j.to_running + j.to_first_progress:.2f}",
            f"{j.running_to_succeeded:.2f}",
            f"{j.total:.2f}",
        )
    console.print(t)

    t = Table(title="Placement throughput")
    for col in ("backend", "how", "placed", "left waiting", "seconds", "jobs/s", "note"):
        t.add_column(col, justify="left" if col in ("backend", "how", "note") else "right")
    for p in placements:
        note = ""
        if p.passes:
            note = (
                f"{len(p.passes)} passes, {1000 * p.seconds / max(p.placed, 1):.1f} ms/job; "
                f"setup {p.setup_s:.0f} s, API submissions {p.submit_rate:.0f}/s"
            )
        t.add_row(
            p.backend,
            p.how,
            str(p.placed),
            str(p.waiting),
            f"{p.seconds:.2f}",
            f"{p.rate:.1f}",
            note,
        )
    console.print(t)

    if not alone or not jobs:
        return
    # The machine is shared: the standalone run is repeated (once after each backend's jobs,
    # interleaved with them) and the fastest taken, so noise can only favour it.
    best = min(alone, key=lambda a: a.train_s)
    t = Table(title="Overhead of cpn on the demo job (standalone: fastest of its runs)")
    for col in ("backend", "measure", "under cpn s", "standalone s", "overhead"):
        t.add_column(col, justify="left" if col in ("backend", "measure") else "right")
    for backend in dict.fromkeys(j.backend for j in jobs):
        mine = [j for j in jobs if j.backend == backend]
        cold, warm = mine[0], mine[-1]

        def row(name: str, cpn: float, base: float, backend: str = backend) -> None:
            t.add_row(backend, name, f"{cpn:.2f}", f"{base:.2f}", f"{(cpn - base) / base:+.1%}")

        row("training, cold: RUNNING->SUCCEEDED vs run()", cold.running_to_succeeded, best.train_s)
        if warm is not cold:
            row(
                "training, warm: RUNNING->SUCCEEDED vs run()",
                warm.running_to_succeeded,
                best.train_s,
            )
        row("training loop only: report.wall_s (cold)", cold.train_wall_s, best.wall_s)
        row("end-to-end, cold: created->SUCCEEDED vs process", cold.total, best.process_s)
        if warm is not cold:
            row("end-to-end, warm: created->SUCCEEDED vs run()", warm.total, best.train_s)
    console.print(t)
    runs = "; ".join(
        f"process {a.process_s:.1f} s = Ray start {a.ray_start_s:.1f} + run() {a.train_s:.1f} "
        f"(loop {a.wall_s:.1f}), accuracy {a.accuracy:.4f}"
        for a in alone
    )
    console.print(f"standalone runs: {runs}")
    console.print(
        "under cpn accuracy: " + ", ".join(f"{j.backend} {j.label} {j.accuracy:.4f}" for j in jobs)
    )


def plot(jobs: list[JobTiming], alone: list[Standalone], placements: list[Throughput]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = [f"{j.backend}\n{j.label}" for j in jobs]
    parts = [
        ("created->SCHEDULED", [j.to_scheduled for j in jobs]),
        ("SCHEDULED->RUNNING", [j.to_running for j in jobs]),
        ("RUNNING->1st progress", [j.to_first_progress for j in jobs]),
        (
            "rest of training",
            [j.total - j.to_scheduled - j.to_running - j.to_first_progress for j in jobs],
        ),
    ]
    if alone:
        labels.append("standalone\nprocess (best)")
        parts = [(name, [*vals, 0.0]) for name, vals in parts]
        best = min(alone, key=lambda a: a.train_s)
        parts.append(("standalone", [0.0] * len(jobs) + [best.process_s]))
    bottom = [0.0] * len(labels)
    for name, vals in parts:
        a1.bar(labels, vals, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    a1.set_ylabel("seconds")
    a1.set_title("demo job: submission to SUCCEEDED")
    a1.legend(fontsize=8)
    a2.bar([f"{p.backend}\n{p.how}" for p in placements], [p.rate for p in placements])
    a2.set_ylabel("jobs placed per second")
    a2.set_title("placement throughput (100 clusters, 1,000 pending)")
    a2.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "controller.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--backends", default="sqlite,postgres")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--demo-jobs", type=int, default=2, help="Demo jobs per backend (>= 1).")
    p.add_argument("--clusters", type=int, default=100)
    p.add_argument("--jobs", type=int, default=1000)
    p.add_argument("--skip-loop", action="store_true", help="Only place_pending in-process.")
    p.add_argument("--placement-budget-s", type=float, default=120.0)
    p.add_argument("--skip-demo", action="store_true")
    p.add_argument("--skip-placement", action="store_true")
    p.add_argument(
        "--seed-only",
        metavar="URL",
        help="Seed --clusters x --jobs into the database at URL (kept) and stop.",
    )
    p.add_argument(
        "--place-copy-of",
        metavar="URL",
        help="Place a copy of a database --seed-only made (in-process, --placement-budget-s) "
        "and print one JSON line: placed, seconds, jobs/s, jobs per CPU-s, load average.",
    )
    args = p.parse_args()
    if args.seed_only:
        setup_s, rate = seed_network(args.seed_only, args.clusters, args.jobs, 32)
        print(json.dumps({"setup_s": round(setup_s, 1), "submissions_per_s": round(rate, 1)}))
        return
    if args.place_copy_of:
        print(json.dumps(place_copy(args.place_copy_of, args.placement_budget_s)))
        return
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    for b in backends:
        if b not in ("sqlite", "postgres"):
            p.error(f"--backends: unknown {b!r}; use sqlite and/or postgres")
    t0 = time.monotonic()
    jobs: list[JobTiming] = []
    placements: list[Throughput] = []
    alone: list[Standalone] = []
    with tempfile.TemporaryDirectory(prefix="cpn-bench-ctl-") as tmp:
        workdir = Path(tmp)
        for backend in backends:
            if not args.skip_demo:
                print(f"-- {backend}: demo jobs", file=sys.stderr, flush=True)
                jobs += demo_jobs(backend, workdir, args.steps, max(1, args.demo_jobs))
                print("-- standalone training.run", file=sys.stderr, flush=True)
                alone.append(standalone(jobs[0], args.steps))
            if not args.skip_placement:
                print(f"-- {backend}: placement throughput", file=sys.stderr, flush=True)
                placements += throughput(
                    backend,
                    workdir,
                    args.clusters,
                    args.jobs,
                    not args.skip_loop,
                    args.placement_budget_s,
                )
    report(jobs, alone, placements, args.steps)
    print(f"plot saved to {plot(jobs, alone, placements)}; run took {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
