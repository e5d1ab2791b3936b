"""Metering and the ledger: totals reconcile exactly with usage x prices across a price change."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from decimal import Decimal

from sqlalchemy import select

from controller.jobs import lifecycle
from controller.money.metering import (
    egress_charge,
    gpu_charge,
    meter_allocations,
    meter_wan,
    price_usage,
)
from controller.money.pricing import egress_price_history, gpu_price_history, price_at
from controller.network.allocations import Slot, release, reserve
from controller.store.db import make_engine, make_sessionmaker
from controller.store.models import Allocation, Cluster, Job, LedgerEntry, Usage
from grammar.states import JobState
from tests.service.conftest import Network, spec


def test_ledger_reconciles_across_a_price_change(network: Network) -> None:
    job_out = network.tenant.post("/v1/jobs", spec(gpus=4, qos={"qos_class": "standard"}))
    engine = make_engine(network.server.database_url)
    sessions = make_sessionmaker(engine)
    with sessions() as s, s.begin():
        job = s.get(Job, job_out["id"])
        assert job is not None
        reserve(s, job, [Slot("us-east", "A100", 3), Slot("eu-west", "H100", 1)])
        lifecycle.transition(s, job, JobState.SCHEDULED, "placed")
        lifecycle.transition(s, job, JobState.RUNNING, "launched")  # billing starts here
    started = datetime.now(UTC)
    change_at = started + timedelta(seconds=1.0)
    network.admin.post(
        "/v1/pricing/gpu",
        {
            "cluster": "us-east",
            "gpu_model": "A100",
            "qos_class": "standard",
            "price_per_gpu_hour": 7.25,
            "effective_from": change_at.isoformat(),
        },
    )
    network.admin.post(
        "/v1/pricing/egress",
        {
            "src": "us-east",
            "dst": "eu-west",
            "price_per_gb": 0.09,
            "effective_from": change_at.isoformat(),
        },
    )
    with sessions() as s, s.begin():  # a first periodic metering pass, before the change
        job = s.get(Job, job_out["id"])
        assert job is not None
        meter_allocations(s, job)
        meter_wan(
            s,
            job,
            {("us-east", "eu-west"): 3_000_000_000, ("eu-west", "us-east"): 1_500_000},
            started,
            datetime.now(UTC),
        )
        price_usage(s, job.id)
    while datetime.now(UTC) <= change_at + timedelta(seconds=0.3):
        time.sleep(0.05)
    with sessions() as s, s.begin():
        job = s.get(Job, job_out["id"])
        assert job is not None
        meter_wan(s, job, {("us-east", "eu-west"): 2_000_000_000}, change_at, datetime.now(UTC))
        assert release(s, job) == 4
        meter_allocations(s, job)
        price_usage(s, job.id)
        assert price_usage(s, job.id) == []  # nothing is priced twice

    with sessions() as s:
        usage = s.scalars(select(Usage).where(Usage.job_id == job_out["id"])).all()
        entries = s.scalars(select(LedgerEntry).where(LedgerEntry.job_id == job_out["id"])).all()
        assert all(u.priced for u in usage) and len(entries) == len(usage)
        # Independent recomputation: every usage row at the catalogue price of its period.
        expected = Decimal(0)
        us_east_prices = set()
        ids = dict(s.execute(select(Cluster.name, Cluster.id)).all())
        for u in usage:
            if u.kind == "gpu_seconds":
                price = price_at(
                    gpu_price_history(s, ids[u.cluster], u.gpu_model or "", u.qos_class or ""),
                    u.period_start,
                )
                assert price is not None
                if u.cluster == "us-east":
                    us_east_prices.add(price)
                expected += gpu_charge(Decimal(u.quantity), price)[1]
            else:
                price = price_at(
                    egress_price_history(s, ids[u.cluster], ids[u.dst_cluster or ""]),
                    u.period_start,
                ) or Decimal(0)
                expected += egress_charge(Decimal(u.quantity), price)[1]
        total = sum((Decimal(e.amount) for e in entries), Decimal(0))
        assert total == expected
        assert us_east_prices == {Decimal("2.5"), Decimal("7.25")}  # the job spanned the change
        gpu_seconds = sum(Decimal(u.quantity) for u in usage if u.kind == "gpu_seconds")
        # Metered GPU-seconds equal what the allocations held while the job ran: 4 GPUs from
        # the RUNNING transition (billed_from) to their end.
        rows = s.execute(
            select(Allocation.billed_from, Allocation.ended_at, Allocation.gpus).where(
                Allocation.job_id == job_out["id"]
            )
        ).all()
        assert all(start is not None for start, _, _ in rows)  # every allocation ran
        held = 0.0
        for start, end, n in rows:
            assert start is not None
            held += ((end or start) - start).total_seconds() * n
        assert abs(float(gpu_seconds) - held) < 1e-5
    engine.dispose()

    ledger = network.tenant.get(f"/v1/tenants/{network.tenant_id}/ledger")
    assert Decimal(ledger["total"]) == total
    assert ledger["total_items"] == len(entries)
    usage_view = network.tenant.get(f"/v1/tenants/{network.tenant_id}/usage")
    assert usage_view["wan_bytes"] == 3_000_000_000 + 1_500_000 + 2_000_000_000
    assert abs(usage_view["gpu_seconds"] - float(gpu_seconds)) < 1e-3


def test_reservations_never_exceed_capacity(network: Network) -> None:
    ids = [network.tenant.post("/v1/jobs", spec(name=f"j{i}", gpus=2))["id"] for i in range(5)]
    engine = make_engine(network.server.database_url)
    sessions = make_sessionmaker(engine)
    granted = 0
    for job_id in ids:
        try:
            with sessions() as s, s.begin():
                job = s.get(Job, job_id)
                assert job is not None
                reserve(s, job, [Slot("us-east", "A100", 2), Slot("eu-west", "H100", 1)])
                granted += 1
        except Exception as exc:  # Conflict: the cluster ran out
            assert "no longer has" in str(exc)
    assert granted == 4  # us-east has 8 A100: four jobs of 2, the fifth refused whole
    clusters = {c["name"]: c for c in network.admin.clusters()}
    assert clusters["us-east"]["gpus"][0]["in_use"] == 8
    assert clusters["eu-west"]["gpus"][0]["in_use"] == 4  # the refused job left nothing behind
    engine.dispose()
