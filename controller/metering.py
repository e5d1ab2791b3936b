"""Metering and the ledger.

GPU use is metered from allocation records (GPUs x seconds held), WAN use from the workers'
reports (bytes per link). Metering splits every period at price changes, so each usage row has
exactly one price; pricing turns each row into one append-only ledger entry. Totals then
reconcile with usage times prices to the last decimal, across any price change.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from decimal import ROUND_HALF_EVEN, Decimal

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from controller.models import Allocation, Cluster, Job, LedgerEntry, Usage, utcnow
from controller.pricing import (
    egress_price_history,
    gpu_price_history,
    price_at,
    require,
    spans,
)

MICRO = Decimal("0.000001")
SECONDS_PER_HOUR = Decimal(3600)
BYTES_PER_GB = Decimal(10**9)


def q6(value: Decimal) -> Decimal:
    """Money and quantities are kept to 6 decimals, rounded half-even (banker's rounding)."""
    return value.quantize(MICRO, rounding=ROUND_HALF_EVEN)


def _seconds(start: datetime, end: datetime) -> Decimal:
    delta = end - start
    return Decimal(delta.days * 86400 + delta.seconds) + Decimal(delta.microseconds) / 10**6


def gpu_charge(gpu_seconds: Decimal, price_per_gpu_hour: Decimal) -> tuple[Decimal, Decimal]:
    """(GPU-hours, amount) for a usage row: the one formula both ledger and audits use."""
    return q6(gpu_seconds / SECONDS_PER_HOUR), q6(
        gpu_seconds * price_per_gpu_hour / SECONDS_PER_HOUR
    )


def egress_charge(nbytes: Decimal, price_per_gb: Decimal) -> tuple[Decimal, Decimal]:
    """(GB, amount) for a WAN usage row."""
    return q6(nbytes / BYTES_PER_GB), q6(nbytes * price_per_gb / BYTES_PER_GB)


def meter_allocations(session: Session, job: Job, until: datetime | None = None) -> list[Usage]:
    """Meter GPU-seconds of the job's allocations up to `until` (or their end), per price span."""
    until = until or utcnow()
    made: list[Usage] = []
    allocations = session.scalars(
        select(Allocation).where(Allocation.job_id == job.id).order_by(Allocation.id)
    ).all()
    for alloc in allocations:
        start = alloc.metered_until or alloc.started_at
        end = min(alloc.ended_at or until, until)
        if end <= start:
            continue
        cluster = session.get(Cluster, alloc.cluster_id)
        name = cluster.name if cluster else alloc.cluster_id
        history = gpu_price_history(session, alloc.cluster_id, alloc.gpu_model, alloc.qos_class)
        try:
            parts = spans(history, start, end)
        except LookupError:
            require(None, f"{alloc.gpu_model} on {name} ({alloc.qos_class})")
            raise
        for part in parts:
            usage = Usage(
                tenant_id=job.tenant_id,
                job_id=job.id,
                kind="gpu_seconds",
                cluster=name,
                gpu_model=alloc.gpu_model,
                qos_class=alloc.qos_class,
                quantity=q6(Decimal(alloc.gpus) * _seconds(part.start, part.end)),
                period_start=part.start,
                period_end=part.end,
            )
            session.add(usage)
            made.append(usage)
        alloc.metered_until = end
    session.flush()
    return made


def meter_wan(
    session: Session,
    job: Job,
    bytes_by_link: Mapping[tuple[str, str], int],
    period_start: datetime,
    period_end: datetime,
) -> list[Usage]:
    """Record WAN bytes that crossed each (src, dst) link during a reporting period."""
    made = []
    for (src, dst), nbytes in sorted(bytes_by_link.items()):
        if nbytes <= 0:
            continue
        usage = Usage(
            tenant_id=job.tenant_id,
            job_id=job.id,
            kind="wan_bytes",
            cluster=src,
            dst_cluster=dst,
            quantity=Decimal(int(nbytes)),
            period_start=period_start,
            period_end=period_end,
        )
        session.add(usage)
        made.append(usage)
    session.flush()
    return made


def price_usage(session: Session, job_id: str | None = None) -> list[LedgerEntry]:
    """Turn every unpriced usage row into one ledger entry at the price in effect for it."""
    stmt = select(Usage).where(Usage.priced.is_(False)).order_by(Usage.id)
    if job_id:
        stmt = stmt.where(Usage.job_id == job_id)
    rows = session.scalars(stmt.with_for_update(skip_locked=True)).all()
    ids = dict(session.execute(select(Cluster.name, Cluster.id)).all())
    entries = []
    for usage in rows:
        if usage.kind == "gpu_seconds":
            assert usage.gpu_model and usage.qos_class
            history = gpu_price_history(
                session, ids.get(usage.cluster, ""), usage.gpu_model, usage.qos_class
            )
            unit = require(
                price_at(history, usage.period_start),
                f"{usage.gpu_model} on {usage.cluster} ({usage.qos_class})",
            )
            quantity, amount = gpu_charge(Decimal(usage.quantity), unit)
            kind = "gpu"
            what = f"{usage.gpu_model} on {usage.cluster} ({usage.qos_class})"
        else:
            assert usage.dst_cluster
            history = egress_price_history(
                session, ids.get(usage.cluster, ""), ids.get(usage.dst_cluster, "")
            )
            unit = price_at(history, usage.period_start) or Decimal(0)
            quantity, amount = egress_charge(Decimal(usage.quantity), unit)
            kind = "egress"
            what = f"WAN {usage.cluster} -> {usage.dst_cluster}"
        entry = LedgerEntry(
            tenant_id=usage.tenant_id,
            job_id=usage.job_id,
            usage_id=usage.id,
            kind=kind,
            description=what,
            quantity=quantity,
            unit_price=unit,
            amount=amount,
            period_start=usage.period_start,
            period_end=usage.period_end,
        )
        session.add(entry)
        usage.priced = True
        entries.append(entry)
    session.flush()
    return entries


def tenant_spend(session: Session, tenant_id: str) -> Decimal:
    total = session.scalar(
        select(func.coalesce(func.sum(LedgerEntry.amount), 0)).where(
            LedgerEntry.tenant_id == tenant_id
        )
    )
    return Decimal(total or 0)
