"""Two `cpn serve` replicas on one PostgreSQL, 200 concurrent submissions for 100 GPUs.

The controllers run in placement-only mode (CPN_LAUNCH_JOBS=false): this test is about the
reconcile loop's reservations, and 200 real trainings do not fit on a 2-core machine. A thread
checks the capacity invariant continuously while the replicas compete.
"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, func, select, text

from api.client import Client
from api.processes import ControlPlane, start_control_plane
from controller.store.models import Allocation, ClusterGpus
from tests.conftest import clear_tables
from tests.e2e.world import wait_for

pytestmark = pytest.mark.slow
CLUSTERS = 10
GPUS_PER_CLUSTER = 10


class Invariant(threading.Thread):
    """Polls the database: reserved <= allocatable everywhere, and reservations add up."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.engine = create_engine(url)
        self.stop = threading.Event()
        self.checks = 0
        self.violations: list[str] = []
        self.max_reserved = 0

    def run(self) -> None:
        while not self.stop.is_set():
            with self.engine.connect() as conn, conn.begin():
                conn.execute(text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ"))
                rows = conn.execute(
                    select(ClusterGpus.cluster_id, ClusterGpus.in_use, ClusterGpus.allocatable)
                ).all()
                held = dict(
                    conn.execute(
                        select(Allocation.cluster_id, func.sum(Allocation.gpus))
                        .where(Allocation.ended_at.is_(None))
                        .group_by(Allocation.cluster_id)
                    ).all()
                )
            total = 0
            for cid, in_use, allocatable in rows:
                total += in_use
                if in_use > allocatable:
                    self.violations.append(f"{cid}: {in_use} in use > {allocatable}")
                if int(held.get(cid, 0)) != in_use:
                    self.violations.append(f"{cid}: allocations {held.get(cid)} != in_use {in_use}")
            if total > CLUSTERS * GPUS_PER_CLUSTER:
                self.violations.append(f"{total} GPUs reserved of {CLUSTERS * GPUS_PER_CLUSTER}")
            self.max_reserved = max(self.max_reserved, total)
            self.checks += 1
            time.sleep(0.01)
        self.engine.dispose()


def test_two_replicas_never_overcommit(pg_server_url: str, tmp_path: Path) -> None:
    from controller.store.migrate import upgrade

    upgrade(pg_server_url)
    clear_tables(pg_server_url)
    settings = {
        "CPN_LAUNCH_JOBS": "false",
        "CPN_RECONCILE_INTERVAL_S": "0.2",
        "CPN_HEARTBEAT_INTERVAL_S": "5",
        "CPN_LEASE_GRACE_S": "60",
    }
    token = "cpn_admin_replicas-0123456789abcdef"
    planes: list[ControlPlane] = [start_control_plane(pg_server_url, token, settings=settings)]
    planes.append(start_control_plane(pg_server_url, token, settings=settings, migrate=False))
    admin = Client(planes[0].url, token, timeout=60)
    try:
        for i in range(CLUSTERS):
            name = f"dc{i}"
            admin.create_cluster(name, f"region{i % 3}")
            agent = Client(planes[i % 2].url, admin.create_api_key("agent", name)["token"])
            agent.post(
                "/v1/agent/heartbeat",
                {
                    "cluster": name,
                    "gpus": [
                        {
                            "model": "A100",
                            "memory_gib": 80,
                            "count": GPUS_PER_CLUSTER,
                            "allocatable": GPUS_PER_CLUSTER,
                        }
                    ],
                },
            )
            agent.close()
            admin.post(
                "/v1/pricing/gpu",
                {
                    "cluster": name,
                    "gpu_model": "A100",
                    "qos_class": "standard",
                    "price_per_gpu_hour": 1.0 + i / 10,
                },
            )
        for i in range(CLUSTERS):
            for j in range(i + 1, CLUSTERS):
                admin.declare_link(f"dc{i}", f"dc{j}", bandwidth_gbps=10, rtt_ms=20 + i + j)
        tenants = []
        for name in ("acme", "globex"):
            t = admin.post("/v1/tenants", {"name": name})
            tenants.append(admin.create_api_key("tenant", t["id"])["token"])

        watcher = Invariant(pg_server_url)
        watcher.start()
        rng = random.Random(7)
        specs = [
            {
                "name": f"j{i}",
                "task": "builtin:mnist1d-mlp",
                "gpus": rng.randint(1, 12),
                "steps": 100,
                "compression": "none",
                "sync": "every-step",
            }
            for i in range(200)
        ]

        def submit(i: int) -> str:
            with Client(planes[i % 2].url, tenants[i % 2], timeout=120) as c:
                return str(c.submit(specs[i], idempotency_key=f"k{i}").id)

        with ThreadPoolExecutor(max_workers=32) as pool:
            ids = list(pool.map(submit, range(200)))
        assert len(set(ids)) == 200

        def settled() -> list[dict[str, Any]] | None:
            jobs = list(admin.paginate("/v1/jobs"))
            waiting = [j for j in jobs if j["state"] == "PENDING"]
            ok = all(j["reason"].startswith("waiting") for j in waiting)
            return jobs if ok and len(jobs) == 200 else None

        def quiet() -> list[dict[str, Any]] | None:
            first = settled()
            time.sleep(1.0)
            second = settled()
            if first is None or second is None:
                return None
            same = [j["state"] for j in first] == [j["state"] for j in second]
            return second if same else None

        jobs = wait_for(quiet, 120, "every job placed or explicitly waiting")
        placed = [j for j in jobs if j["state"] == "SCHEDULED"]
        assert placed and len(placed) + sum(j["state"] == "PENDING" for j in jobs) == 200
        owners = {j["id"]: j for j in placed}
        assert len(owners) == len(placed)
        # Both replicas placed work, each job exactly once.
        events = {
            j["id"]: [
                e
                for e in admin.paginate(f"/v1/jobs/{j['id']}/events")
                if e["to_state"] == "SCHEDULED"
            ]
            for j in placed[:40]
        }
        assert all(len(v) == 1 for v in events.values())
        assert sum(sum(c["gpus"] for c in j["placement"]["clusters"]) for j in placed) <= 100

        def owners_seen() -> set[str]:
            with create_engine(pg_server_url).connect() as conn:
                return {
                    r[0]
                    for r in conn.execute(
                        text("SELECT DISTINCT owner FROM jobs WHERE owner IS NOT NULL")
                    )
                }

        # Free the capacity: cancelling the placed jobs lets the waiting ones in. Which
        # replica's pass takes a freed GPU first is a race (under load one may win a round
        # whole), so rounds go on, a few at most, until both have placed work.
        for _ in range(4):
            for job in placed:
                admin.post(f"/v1/jobs/{job['id']}/cancel")
            jobs = wait_for(quiet, 120, "the waiting jobs placed after cancellations")
            placed = [j for j in jobs if j["state"] == "SCHEDULED"]
            assert placed
            if len(owners_seen()) == 2:
                break
        watcher.stop.set()
        watcher.join(10)
        assert watcher.checks > 50, watcher.checks
        assert watcher.violations == []
        assert watcher.max_reserved <= CLUSTERS * GPUS_PER_CLUSTER
        assert len(owners_seen()) == 2, owners_seen()
    finally:
        admin.close()
        for plane in planes:
            plane.proc.stop()


def test_a_second_replica_on_sqlite_refuses_to_start(tmp_path: Path) -> None:
    from api.processes import ProcessError

    url = f"sqlite:///{tmp_path / 'cpn.db'}"
    token = "cpn_admin_replicas-0123456789abcdef"
    first = start_control_plane(url, token, settings={"CPN_LAUNCH_JOBS": "false"})
    try:
        with pytest.raises(ProcessError) as refused:
            start_control_plane(url, token, settings={"CPN_LAUNCH_JOBS": "false"}, migrate=False)
        assert "supports one replica" in str(refused.value)
        assert "PostgreSQL" in str(refused.value)
    finally:
        first.proc.stop()
