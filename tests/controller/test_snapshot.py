"""The scheduler's world as read from the database, on SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

from sqlalchemy import update

from agents.protocol import GpuInventory as GpuReport
from agents.protocol import Heartbeat
from controller.network.leases import LeasePolicy
from controller.network.resources import create_cluster, declare_link, ingest_heartbeat
from controller.network.snapshot import build_world
from controller.store.db import make_engine, make_sessionmaker
from controller.store.models import Cluster, GpuPrice, utcnow

LEASES = LeasePolicy(heartbeat_interval_s=1.0, grace_s=10.0)


def test_each_pass_sees_the_links_as_they_are_now(db_url: str) -> None:
    """Passes reuse the last pass's link table while the rows are unchanged: a changed link,
    a new one and a cluster's new name must still show in the next world."""
    engine = make_engine(db_url)
    sessions = make_sessionmaker(engine)
    with sessions() as s, s.begin():
        for name in ("east", "west", "north"):
            c = create_cluster(s, name, "us", {})
            s.add(
                GpuPrice(
                    cluster_id=c.id,
                    gpu_model="A100",
                    qos_class="standard",
                    price_per_gpu_hour=Decimal("2"),
                    effective_from=utcnow() - timedelta(hours=1),
                )
            )
            gpus = [GpuReport(model="A100", memory_gib=80, count=8, allocatable=8)]
            s.flush()
            ingest_heartbeat(s, Heartbeat(cluster=name, gpus=gpus), LEASES)
        declare_link(
            s, "east", "west", bandwidth_gbps=1.0, rtt_ms=10, loss=0, egress_price_per_gb=0
        )

    def links() -> dict[tuple[str, str], float]:
        with sessions() as s:
            world = build_world(s, "standard")
        return {(k.a, k.b): k.bandwidth_gbps for k in world.snapshot.links}

    assert links() == links() == {("east", "west"): 1.0}
    with sessions() as s, s.begin():
        declare_link(
            s, "east", "west", bandwidth_gbps=2.5, rtt_ms=10, loss=0, egress_price_per_gb=0
        )
    assert links() == {("east", "west"): 2.5}
    with sessions() as s, s.begin():
        declare_link(s, "west", "north", bandwidth_gbps=4, rtt_ms=10, loss=0, egress_price_per_gb=0)
    assert links() == {("east", "west"): 2.5, ("west", "north"): 4.0}
    with sessions() as s, s.begin():
        s.execute(update(Cluster).where(Cluster.name == "north").values(name="south"))
    assert links() == {("east", "west"): 2.5, ("west", "south"): 4.0}
    engine.dispose()
