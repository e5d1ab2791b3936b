"""A priced compute network with a tenant, over a real server on each backend."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from agents.protocol import GpuInventory, Heartbeat
from api.client import Client
from tests.conftest import LiveServer, start_server


@dataclass(frozen=True)
class Offer:
    """What one cluster of the network offers: its GPUs and their standard price."""

    cluster: str
    gpu_model: str
    gpus: int
    price_per_gpu_hour: float


OFFERS = (
    Offer("us-east", "A100", 8, 2.50),
    Offer("eu-west", "H100", 8, 4.00),
    Offer("ap-south", "L4", 16, 0.80),
)
QOS_PRICE_FACTORS = (("guaranteed", 1.5), ("standard", 1.0), ("spot", 0.4))


@dataclass
class Network:
    server: LiveServer
    admin: Client
    tenant_id: str
    tenant: Client
    other_tenant_id: str
    other: Client


def build_network(live: LiveServer) -> Network:
    admin = live.client()
    for offer in OFFERS:
        admin.create_cluster(offer.cluster, offer.cluster)
        token = admin.create_api_key("agent", offer.cluster)["token"]
        beat = Heartbeat(
            cluster=offer.cluster,
            gpus=[
                GpuInventory(
                    model=offer.gpu_model,
                    memory_gib=80,
                    count=offer.gpus,
                    allocatable=offer.gpus,
                )
            ],
        )
        with live.client(token) as agent:
            agent.post("/v1/agent/heartbeat", beat.model_dump(mode="json", exclude_unset=True))
        for qos_class, factor in QOS_PRICE_FACTORS:
            admin.post(
                "/v1/pricing/gpu",
                {
                    "cluster": offer.cluster,
                    "gpu_model": offer.gpu_model,
                    "qos_class": qos_class,
                    "price_per_gpu_hour": offer.price_per_gpu_hour * factor,
                },
            )
    admin.declare_link("us-east", "eu-west", bandwidth_gbps=10, rtt_ms=70, egress_price_per_gb=0.02)
    admin.declare_link(
        "us-east", "ap-south", bandwidth_gbps=1, rtt_ms=200, egress_price_per_gb=0.08
    )
    admin.declare_link(
        "eu-west", "ap-south", bandwidth_gbps=2, rtt_ms=120, egress_price_per_gb=0.05
    )
    a = admin.post("/v1/tenants", {"name": "acme", "gpu_quota": 20, "budget": 10_000})
    b = admin.post("/v1/tenants", {"name": "globex"})
    ta = admin.create_api_key("tenant", a["id"])["token"]
    tb = admin.create_api_key("tenant", b["id"])["token"]
    return Network(live, admin, a["id"], live.client(ta), b["id"], live.client(tb))


def _serve(db_url: str, quote_ttl_s: float) -> Iterator[Network]:
    live = start_server(database_url=db_url, quote_ttl_s=quote_ttl_s, run_controller=False)
    net = build_network(live)
    yield net
    for c in (net.admin, net.tenant, net.other):
        c.close()
    live.stop()


@pytest.fixture
def network(db_url: str) -> Iterator[Network]:
    yield from _serve(db_url, quote_ttl_s=600.0)


@pytest.fixture
def expiring_network(db_url: str) -> Iterator[Network]:
    """Quotes live three seconds here: long enough for a quote and the submission it holds to
    happen within it on a loaded machine, short enough to wait for one to expire."""
    yield from _serve(db_url, quote_ttl_s=3.0)


def spec(**overrides: object) -> dict[str, object]:
    base: dict[str, object] = {
        "name": "train-mlp",
        "task": "builtin:mnist1d-mlp",
        "gpus": 8,
        "steps": 2000,
    }
    base.update(overrides)
    return base
