"""A live compute network for end-to-end tests: real `cpn serve`, real agents, real Ray."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from api.client import Client
from api.processes import ControlPlane, Proc, start_agent, start_control_plane, write_inventory
from api.processes import wait_until as wait_for

CLUSTERS: dict[str, dict[str, Any]] = {
    "us-east": {"model": "A100", "count": 2, "price": 2.5},
    "eu-west": {"model": "H100", "count": 2, "price": 4.0},
    "ap-south": {"model": "L4", "count": 2, "price": 0.8},
}
LINKS = [
    ("us-east", "eu-west", 1.0, 40.0, 0.02),
    ("us-east", "ap-south", 0.5, 80.0, 0.08),
    ("eu-west", "ap-south", 0.5, 60.0, 0.05),
]
FAST = {
    "CPN_HEARTBEAT_INTERVAL_S": "0.5",
    "CPN_LEASE_GRACE_S": "3",
    "CPN_PROBE_INTERVAL_S": "30",
    "CPN_RECONCILE_INTERVAL_S": "0.3",
    "CPN_REPLICA_TTL_S": "3",
    "CPN_RAY_NUM_CPUS": "2",
}


@dataclass
class World:
    plane: ControlPlane
    admin: Client
    tenant: Client
    tenant_id: str
    workdir: Path
    settings: dict[str, str]
    agents: dict[str, Proc] = field(default_factory=dict)
    agent_tokens: dict[str, str] = field(default_factory=dict)
    clusters: dict[str, dict[str, Any]] = field(default_factory=lambda: dict(CLUSTERS))

    def start_agent(self, name: str) -> Proc:
        spec = self.clusters[name]
        inventory = write_inventory(
            self.workdir / f"{name}.yaml",
            [{"model": spec["model"], "memory_gib": 80, "count": spec["count"]}],
        )
        proc = start_agent(name, self.plane.url, self.agent_tokens[name], inventory)
        self.agents[name] = proc
        return proc

    def job(self, job_id: str) -> dict[str, Any]:
        return dict(self.admin.get(f"/v1/jobs/{job_id}"))

    def states(self, job_id: str) -> list[str]:
        events = self.admin.paginate(f"/v1/jobs/{job_id}/events")
        return [e["to_state"] for e in events if e["kind"] == "state"]

    def wait_state(self, job_id: str, states: set[str], timeout: float) -> dict[str, Any]:
        return dict(
            wait_for(
                lambda: (j := self.job(job_id))["state"] in states and j,
                timeout,
                f"job {job_id} in {states}",
            )
        )

    def gpus_in_use(self) -> int:
        return sum(g["in_use"] for g in self.admin.gpus())

    def stop(self) -> None:
        for proc in self.agents.values():
            proc.stop()
        self.plane.proc.stop(timeout=60)
        self.admin.close()
        self.tenant.close()


def build_world(
    workdir: Path,
    database_url: str | None = None,
    clusters: dict[str, dict[str, Any]] | None = None,
    links: list[tuple[str, str, float, float, float]] | None = None,
    workers: int = 1,
    **settings: str,
) -> World:
    """The world of `clusters` joined by `links` (CLUSTERS and LINKS when not given), its
    control plane on `workers` processes."""
    clusters = CLUSTERS if clusters is None else clusters
    env = {**FAST, "CPN_CHECKPOINT_ROOT": str(workdir / "checkpoints"), **settings}
    plane = start_control_plane(
        database_url or f"sqlite:///{workdir / 'cpn.db'}",
        "cpn_admin_e2e-0123456789abcdef0123456789",
        settings=env,
        workers=workers,
    )
    admin = Client(plane.url, plane.admin_token, timeout=60)
    world = World(plane, admin, admin, "", workdir, env, clusters=dict(clusters))
    for name, spec in clusters.items():
        admin.create_cluster(name, name)
        world.agent_tokens[name] = admin.create_api_key("agent", name)["token"]
        for qos_class in ("guaranteed", "standard", "spot"):
            admin.post(
                "/v1/pricing/gpu",
                {
                    "cluster": name,
                    "gpu_model": spec["model"],
                    "qos_class": qos_class,
                    "price_per_gpu_hour": spec["price"],
                },
            )
    for a, b, gbps, rtt, price in LINKS if links is None else links:
        admin.declare_link(a, b, bandwidth_gbps=gbps, rtt_ms=rtt, egress_price_per_gb=price)
    tenant = admin.post("/v1/tenants", {"name": "acme"})
    world.tenant_id = tenant["id"]
    world.tenant = Client(
        plane.url, admin.create_api_key("tenant", tenant["id"])["token"], timeout=60
    )
    for name in clusters:
        world.start_agent(name)
    wait_for(
        lambda: all(c["state"] == "READY" and c["gpus"] for c in admin.clusters()),
        60,
        "clusters READY",
    )
    return world
