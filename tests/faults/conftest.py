"""A small compute network for fault tests: a real `cpn serve` that the test kills and starts
again over the same database, clusters created over the REST API, agent heartbeats POSTed by
the test (so what each one got back is counted), and jobs of a tiny built-in task on real Ray.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from api.client import Client
from api.processes import ControlPlane, start_control_plane, wait_until
from bench.pg_server import Postgres, throwaway_postgres, unavailable
from controller.loop.controller import live_replicas
from controller.store.db import make_engine, make_sessionmaker
from controller.store.models import Allocation
from grammar.states import TERMINAL

ADMIN_TOKEN = "cpn_admin_faults-0123456789abcdef0123"
CLUSTERS = {"east": ("A100", 2, 2.5), "west": ("H100", 2, 4.0)}
"""name -> (GPU model, GPUs, price per GPU-hour)."""
SETTINGS = {
    "CPN_RECONCILE_INTERVAL_S": "0.3",
    "CPN_REPLICA_TTL_S": "3",
    # Heartbeats stop while the controller is down; the clusters must not be lost meanwhile:
    # the tests are about the controller and the database, not about agents going silent.
    "CPN_HEARTBEAT_INTERVAL_S": "1",
    "CPN_LEASE_GRACE_S": "120",
    "CPN_PROBE_INTERVAL_S": "600",
    "CPN_RAY_NUM_CPUS": "2",
    "CPN_KEY_RATE_LIMIT": "0",
    "CPN_AGENT_RATE_LIMIT": "0",
}


class Heartbeats(threading.Thread):
    """The clusters' agents: a heartbeat per cluster every `every` seconds to whatever serve
    is current, counting the answers (status code, or 0 when nothing listened)."""

    def __init__(self, tokens: dict[str, str], every: float = 0.3) -> None:
        super().__init__(daemon=True, name="heartbeats")
        self.tokens = tokens
        self.every = every
        self.url: str | None = None
        self.codes: Counter[int] = Counter()
        self.stopped = threading.Event()

    def beat(self, client: httpx.Client, url: str) -> None:
        for name, token in self.tokens.items():
            model, count, _ = CLUSTERS[name]
            gpu = {"model": model, "memory_gib": 80, "count": count, "allocatable": count}
            try:
                code = client.post(
                    f"{url}/v1/agent/heartbeat",
                    json={"cluster": name, "gpus": [gpu]},
                    headers={"Authorization": f"Bearer {token}"},
                ).status_code
            except httpx.HTTPError:
                code = 0
            self.codes[code] += 1

    def run(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self.stopped.wait(self.every):
                if self.url:
                    self.beat(client, self.url)


@dataclass
class Network:
    """One database, the `cpn serve` over it now (None while it is down), its clusters."""

    workdir: Path
    database_url: str
    plane: ControlPlane | None = None
    tenant_token: str = ""
    beats: Heartbeats | None = None
    planes: list[ControlPlane] = field(default_factory=list)

    @property
    def failpoint_dir(self) -> Path:
        return self.workdir / "failpoints"

    def start(
        self, failpoints: str = "", migrate: bool = False, controller: bool = True
    ) -> ControlPlane:
        """`cpn serve` over the database, with these failpoints armed (none by default);
        without `controller`, the API only (no placement passes)."""
        settings = {
            **SETTINGS,
            "CPN_CHECKPOINT_ROOT": str(self.workdir / "checkpoints"),
            "CPN_FAILPOINTS": failpoints,
            "CPN_FAILPOINT_DIR": str(self.failpoint_dir),
            "CPN_RUN_CONTROLLER": "true" if controller else "false",
        }
        self.plane = start_control_plane(
            self.database_url, ADMIN_TOKEN, settings=settings, migrate=migrate
        )
        self.planes.append(self.plane)
        if self.beats is not None:
            self.beats.url = self.plane.url
        return self.plane

    def admin(self) -> Client:
        assert self.plane is not None
        return Client(self.plane.url, ADMIN_TOKEN, timeout=60)

    def build(self) -> None:
        """Clusters, prices, a link, a tenant; heartbeats flowing; the clusters READY."""
        tokens = {}
        with self.admin() as admin:
            for name, (model, _, price) in CLUSTERS.items():
                admin.create_cluster(name, name)
                tokens[name] = admin.create_api_key("agent", name)["token"]
                admin.post(
                    "/v1/pricing/gpu",
                    {
                        "cluster": name,
                        "gpu_model": model,
                        "qos_class": "standard",
                        "price_per_gpu_hour": price,
                    },
                )
            admin.declare_link(
                "east", "west", bandwidth_gbps=1.0, rtt_ms=20.0, egress_price_per_gb=0.05
            )
            tenant = admin.post("/v1/tenants", {"name": "acme"})
            self.tenant_token = admin.create_api_key("tenant", tenant["id"])["token"]
            self.beats = Heartbeats(tokens)
            assert self.plane is not None
            self.beats.url = self.plane.url
            self.beats.start()
            wait_until(
                lambda: all(c["state"] == "READY" and c["gpus"] for c in admin.clusters()),
                60,
                "clusters READY",
            )

    def submit(self, count: int, steps: int, gpus: int = 1) -> list[str]:
        assert self.plane is not None
        with Client(self.plane.url, self.tenant_token, timeout=60) as tenant:
            return [
                str(
                    tenant.submit(
                        {
                            "name": f"job{i}",
                            "task": "builtin:mnist1d-mlp",
                            "gpus": gpus,
                            "steps": steps,
                            "compression": "none",
                            "sync": "every-step",
                            "args": {"checkpoint_every": max(1, steps // 4)},
                        },
                        idempotency_key=f"fault-job-{i}",
                    ).id
                )
                for i in range(count)
            ]

    def reached(self, name: str, timeout: float) -> None:
        """Wait until the serve blocks at failpoint `name` (its marker file appears)."""
        assert self.plane is not None
        plane = self.plane
        wait_until(
            lambda: (
                (self.failpoint_dir / name).exists()
                or (not plane.proc.alive() and pytest.fail(f"serve exited:\n{plane.proc.tail()}"))
            ),
            timeout,
            f"failpoint {name}",
        )

    def crash(self) -> None:
        """SIGKILL the serve and everything it started (its process group: a local Ray too)."""
        assert self.plane is not None
        proc = self.plane.proc
        os.killpg(proc.popen.pid, signal.SIGKILL)
        proc.popen.wait(30)
        self.plane = None
        if self.beats is not None:
            self.beats.url = None
        for marker in self.failpoint_dir.glob("*"):
            marker.unlink()
        # SQLite admits one controller replica: the dead one's row must age out first (the
        # new serve would refuse to start otherwise), as after any crash.
        engine = make_engine(self.database_url)
        sessions = make_sessionmaker(engine)

        def dead() -> bool:
            with sessions() as s:
                return not live_replicas(s, float(SETTINGS["CPN_REPLICA_TTL_S"]))

        try:
            wait_until(dead, 30, "the killed replica to age out", every=0.2)
        finally:
            engine.dispose()

    def wait_ended(self, job_ids: list[str], timeout: float) -> dict[str, dict[str, Any]]:
        with self.admin() as admin:

            def ended() -> dict[str, dict[str, Any]] | None:
                jobs = {j: admin.job(j).model_dump(mode="json") for j in job_ids}
                return jobs if all(j["state"] in TERMINAL for j in jobs.values()) else None

            return wait_until(ended, timeout, f"jobs {job_ids} to end", every=0.3)

    def paused_s(self, job_id: str) -> Decimal:
        """Seconds of the job's allocations that were not billed: no run of it was alive."""
        engine = make_engine(self.database_url)
        try:
            with make_sessionmaker(engine)() as s:
                rows = s.scalars(select(Allocation.paused_s).where(Allocation.job_id == job_id))
                return sum((Decimal(r) for r in rows), Decimal(0))
        finally:
            engine.dispose()

    def state_events(self, job_id: str) -> list[str]:
        with self.admin() as admin:
            events = admin.paginate(f"/v1/jobs/{job_id}/events")
            return [str(e["to_state"]) for e in events if e["kind"] == "state"]

    def report(self, job_id: str) -> dict[str, Any]:
        """What the job's SUCCEEDED event kept of its run's report (steps, resumed_from_step)."""
        with self.admin() as admin:
            events = admin.paginate(f"/v1/jobs/{job_id}/events")
            done = [e for e in events if e["kind"] == "state" and e["to_state"] == "SUCCEEDED"]
            assert len(done) == 1, done
            return dict(done[0]["data"]["report"])

    def info_events(self, job_id: str) -> list[str]:
        with self.admin() as admin:
            events = admin.paginate(f"/v1/jobs/{job_id}/events")
            return [str(e["message"]) for e in events if e["kind"] == "info"]

    def close(self) -> None:
        if self.beats is not None:
            self.beats.stopped.set()
            self.beats.join(10)
        for plane in self.planes:
            if plane.proc.alive():
                plane.proc.stop(timeout=60)
            # whatever the serve started and left behind (a local Ray), by its group
            with contextlib.suppress(ProcessLookupError):
                os.killpg(plane.proc.popen.pid, signal.SIGKILL)


@pytest.fixture
def network(tmp_path: Path) -> Iterator[Network]:
    """A network over a SQLite file in the test's folder; the test starts its serves."""
    net = Network(tmp_path, f"sqlite:///{tmp_path / 'cpn.db'}")
    try:
        yield net
    finally:
        net.close()


# ---- a throwaway PostgreSQL server -------------------------------------------------------------


@pytest.fixture
def postgres() -> Iterator[Postgres]:
    why = unavailable()
    if why is not None:
        pytest.skip(why)
    with throwaway_postgres() as server:
        yield server


def running_steps(url: str) -> dict[str, int]:
    """Each job's newest recorded metric step, straight from the database."""
    from sqlalchemy import func

    from controller.store.models import JobMetric

    engine = make_engine(url)
    try:
        with make_sessionmaker(engine)() as s:
            return dict(
                s.execute(
                    select(JobMetric.job_id, func.max(JobMetric.step)).group_by(JobMetric.job_id)
                ).all()
            )
    finally:
        engine.dispose()
