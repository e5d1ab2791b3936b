"""Metering and the ledger.

GPU use is metered from allocation records (GPUs x seconds held), WAN use from the workers'
reports (bytes per link) and from the rate an allocation holds on its cluster's ports (Gbit/s
x seconds, where that bandwidth is priced). Metering splits every period at price changes, so
each usage row has exactly one price; pricing turns each row into one append-only ledger
entry. Totals then reconcile with usage times prices to the last decimal, across any price
change.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import ColumnElement, func, select
from sqlalchemy.orm import Session

from controller.money import settlement
from controller.money.amounts import MICRO, exact_total, q6
from controller.money.pricing import (
    PricedSpan,
    bandwidth_price_history,
    egress_price_history,
    gpu_price_history,
    offer_at,
    price_at,
    priced_part,
    require,
    spans,
)
from controller.store.models import (
    Allocation,
    Cluster,
    Job,
    LedgerEntry,
    Usage,
    utcnow,
)
from controller.values.errors import NotFound
from scheduler.bandwidth import KBPS_PER_GBPS

SECONDS_PER_HOUR = Decimal(3600)
BYTES_PER_GB = Decimal(10**9)


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
    """Meter GPU-seconds of the job's allocations up to `until` (or their end), per price span,
    from when the job ran on them (`billed_from`): GPUs held while a job waits to launch are
    not billed."""
    until = until or utcnow()
    made: list[Usage] = []
    allocations = session.scalars(
        select(Allocation).where(Allocation.job_id == job.id).order_by(Allocation.id)
    ).all()
    for alloc in allocations:
        start = alloc.metered_until or alloc.billed_from
        if start is None:
            continue  # reserved for a run that never started: nothing to bill
        end = min(alloc.ended_at or until, until, alloc.paused_at or until)
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
        for part in _reserved_parts(session, alloc, start, end):
            usage = Usage(
                tenant_id=job.tenant_id,
                job_id=job.id,
                kind=WAN_RESERVED,
                cluster=name,
                quantity=q6(_gbps(alloc) * _seconds(part.start, part.end)),
                period_start=part.start,
                period_end=part.end,
            )
            session.add(usage)
            made.append(usage)
        alloc.metered_until = end
    session.flush()
    return made


WAN_RESERVED = "wan_reserved"
"""The usage kind of WAN rate held on a cluster's ports: Gbit/s x seconds (issue 52)."""


MIN_TERM = "min_term"
"""The usage kind of GPU-seconds an offer's minimum term bills beyond what a run held."""


def meter_minimum_terms(session: Session, job: Job) -> list[Usage]:
    """An offer's minimum term: a run placed at it pays for at least `min_hours` of each GPU
    it held there. Once an allocation has ended and is metered, what it was billed short of
    that is metered as one more row (kind `min_term`, GPU-seconds at the offer's price, dated
    when the run was placed there), once."""
    made: list[Usage] = []
    for alloc in session.scalars(
        select(Allocation).where(
            Allocation.job_id == job.id,
            Allocation.ended_at.is_not(None),
            Allocation.billed_from.is_not(None),
            Allocation.metered_until.is_not(None),
        )
    ):
        start, metered = alloc.billed_from, alloc.metered_until
        assert start is not None and metered is not None
        offer = offer_at(session, alloc.cluster_id, alloc.gpu_model, alloc.qos_class, start)
        if offer is None or not offer.min_hours:
            continue
        cluster = session.get(Cluster, alloc.cluster_id)
        name = cluster.name if cluster else alloc.cluster_id
        done = session.scalar(
            select(func.count()).where(
                Usage.job_id == job.id,
                Usage.kind == MIN_TERM,
                Usage.cluster == name,
                Usage.gpu_model == alloc.gpu_model,
                Usage.period_start == start,
            )
        )
        if done:
            continue
        held = Decimal(alloc.gpus) * (_seconds(start, metered) - Decimal(alloc.paused_s))
        short = q6(Decimal(alloc.gpus) * Decimal(offer.min_hours) * SECONDS_PER_HOUR - held)
        if short <= 0:
            continue
        usage = Usage(
            tenant_id=job.tenant_id,
            job_id=job.id,
            kind=MIN_TERM,
            cluster=name,
            gpu_model=alloc.gpu_model,
            qos_class=alloc.qos_class,
            quantity=short,
            period_start=start,
            period_end=start,
        )
        session.add(usage)
        made.append(usage)
    session.flush()
    return made


def _gbps(alloc: Allocation) -> Decimal:
    return Decimal(alloc.wan_kbps or 0) / Decimal(KBPS_PER_GBPS)


def _reserved_parts(
    session: Session, alloc: Allocation, start: datetime, end: datetime
) -> list[PricedSpan]:
    """The priced spans of the WAN rate `alloc` holds on its cluster's ports over
    [start, end); none when it holds none or its cluster's bandwidth has no price."""
    if not alloc.wan_kbps or end <= start:
        return []
    return priced_part(bandwidth_price_history(session, alloc.cluster_id), start, end)


def bandwidth_charge(
    gbit_seconds: Decimal, price_per_gbps_hour: Decimal
) -> tuple[Decimal, Decimal]:
    """(Gbit/s-hours, amount) for a reserved-bandwidth usage row."""
    return q6(gbit_seconds / SECONDS_PER_HOUR), q6(
        gbit_seconds * price_per_gbps_hour / SECONDS_PER_HOUR
    )


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


@dataclass(frozen=True)
class Charge:
    """What one usage row costs at the price in effect for its period."""

    kind: str  # gpu | egress
    description: str
    quantity: Decimal  # GPU-hours or GB
    unit_price: Decimal
    amount: Decimal


SLA_CREDIT = "sla_credit"
"""The usage and ledger kind of a provider's refund for a missed SLA (`controller.money.sla`)."""
HELD_CREDIT = "held_credit"
"""The usage kind of a platform credit: what a run cost over its held quote, in dollars."""


def charge_of(session: Session, usage: Usage, ids: Mapping[str, str]) -> Charge:
    """The charge of a usage row (`ids`: cluster name -> id); NotFound when a GPU has no price."""
    if usage.kind == HELD_CREDIT:
        amount = q6(Decimal(usage.quantity))
        what = f"platform credit: the run cost {amount} over its held quote"
        return Charge("credit", what, amount, Decimal(-1), -amount)
    if usage.kind == SLA_CREDIT:  # written priced (`controller.money.sla`), with its evidence
        amount = q6(Decimal(usage.quantity))
        return Charge(SLA_CREDIT, f"SLA credit on {usage.cluster}", amount, Decimal(-1), -amount)
    if usage.kind in ("gpu_seconds", MIN_TERM):
        assert usage.gpu_model and usage.qos_class
        what = f"{usage.gpu_model} on {usage.cluster} ({usage.qos_class})"
        if usage.kind == MIN_TERM:
            what = f"minimum term of the offer: {what}"
        history = gpu_price_history(
            session, ids.get(usage.cluster, ""), usage.gpu_model, usage.qos_class
        )
        unit = require(price_at(history, usage.period_start), what)
        quantity, amount = gpu_charge(Decimal(usage.quantity), unit)
        return Charge("gpu", what, quantity, unit, amount)
    if usage.kind == WAN_RESERVED:
        what = f"WAN rate reserved on {usage.cluster}'s ports"
        history = bandwidth_price_history(session, ids.get(usage.cluster, ""))
        unit = price_at(history, usage.period_start) or Decimal(0)
        quantity, amount = bandwidth_charge(Decimal(usage.quantity), unit)
        return Charge("bandwidth", what, quantity, unit, amount)
    assert usage.dst_cluster
    history = egress_price_history(
        session, ids.get(usage.cluster, ""), ids.get(usage.dst_cluster, "")
    )
    unit = price_at(history, usage.period_start) or Decimal(0)
    quantity, amount = egress_charge(Decimal(usage.quantity), unit)
    return Charge("egress", f"WAN {usage.cluster} -> {usage.dst_cluster}", quantity, unit, amount)


def price_usage(session: Session, job_id: str | None = None) -> list[LedgerEntry]:
    """Turn every unpriced usage row into one ledger entry at the price in effect for it, and
    each entry into its balanced postings (`settlement.post`), in the caller's transaction."""
    stmt = select(Usage).where(Usage.priced.is_(False)).order_by(Usage.id)
    if job_id:
        stmt = stmt.where(Usage.job_id == job_id)
    rows = session.scalars(stmt.with_for_update(skip_locked=True)).all()
    ids = dict(session.execute(select(Cluster.name, Cluster.id)).all())
    entries = []
    for usage in rows:
        charge = charge_of(session, usage, ids)
        entry = LedgerEntry(
            tenant_id=usage.tenant_id,
            job_id=usage.job_id,
            usage_id=usage.id,
            kind=charge.kind,
            description=charge.description,
            quantity=charge.quantity,
            unit_price=charge.unit_price,
            amount=charge.amount,
            period_start=usage.period_start,
            period_end=usage.period_end,
        )
        session.add(entry)
        usage.priced = True
        entries.append(entry)
    session.flush()
    settlement.post(session, entries, {str(u.id): u.cluster for u in rows})
    return entries


def cap_at_held(session: Session, job: Job, at: datetime | None = None) -> Decimal:
    """A held quote is a promise: the tenant never pays more than its total. What the job's
    ledger holds over it is credited back by the platform as one more usage row and ledger
    line (kind `credit`, visible to the tenant and its admins), so the ledger still equals
    usage times prices; returns the credit (0 when the run kept within the quote). Called
    after each pricing of the job (`end_run`): a later run's overrun is credited too."""
    held = job.held_price
    if held is None:
        return Decimal(0)
    promised = held.price.total if held.price is not None else held.estimate.cost
    if promised is None:
        return Decimal(0)
    paid = exact_total(session, LedgerEntry.amount, LedgerEntry.job_id == job.id)
    over = q6(paid - q6(Decimal(str(promised))))
    if over <= 0:
        return Decimal(0)
    now = at or utcnow()
    session.add(
        Usage(
            tenant_id=job.tenant_id,
            job_id=job.id,
            kind=HELD_CREDIT,
            cluster="platform",
            quantity=over,
            period_start=now,
            period_end=now,
        )
    )
    session.flush()
    price_usage(session, job.id)
    return over


def micros(amount: Decimal) -> int:
    """An amount kept to 6 places as whole micro-dollars (the running totals' unit)."""
    return int(q6(amount) / MICRO)


def from_micros(value: int) -> Decimal:
    return q6(Decimal(value) * MICRO)


def tenant_spend(session: Session, tenant_id: str) -> Decimal:
    """What the tenant was charged in all: its ledger's exact total (summed from the entries;
    `Tenant.charged_micros` keeps it as a running total, moved by a trigger on every insert
    into the ledger, which the budget checks read)."""
    return exact_total(session, LedgerEntry.amount, LedgerEntry.tenant_id == tenant_id)


def start_billing(session: Session, job: Job, at: datetime) -> None:
    """The job runs from `at`: its GPUs held for this run are billed from then on (a paused
    allocation resumes, the pause counted in `paused_s`)."""
    for alloc in session.scalars(
        select(Allocation).where(Allocation.job_id == job.id, Allocation.ended_at.is_(None))
    ):
        if alloc.billed_from is None:
            alloc.billed_from = at
        elif alloc.paused_at is not None:
            resumed = max(at, alloc.paused_at)
            alloc.paused_s = q6(Decimal(alloc.paused_s) + _seconds(alloc.paused_at, resumed))
            alloc.metered_until = resumed
            alloc.paused_at = None


def pause_billing(session: Session, job: Job, at: datetime) -> None:
    """No run of the job is alive since `at` (its replica died): meter its GPUs up to then
    and bill nothing more until `start_billing` resumes it at the relaunch. The tenant does
    not pay for the control plane's failure."""
    meter_allocations(session, job, until=at)
    for alloc in session.scalars(
        select(Allocation).where(
            Allocation.job_id == job.id,
            Allocation.ended_at.is_(None),
            Allocation.billed_from.is_not(None),
            Allocation.paused_at.is_(None),
        )
    ):
        alloc.paused_at = max(at, alloc.metered_until or alloc.billed_from or at)


def unbilled(session: Session, job: Job, now: datetime) -> Decimal:
    """What the job's run has cost so far and is not yet in the ledger: GPU time since its
    allocations were last metered, and usage not priced yet (WAN bytes of its latest reports).
    Read-only: the budget checks see spend as it accrues, the books are written by `end_run`."""
    return _unbilled(session, Allocation.job_id == job.id, Usage.job_id == job.id, now)


def tenant_unbilled(session: Session, tenant_id: str, now: datetime) -> Decimal:
    """`unbilled` summed over all of the tenant's jobs, in a few queries whatever their
    number (the launcher asks at every pass, for each tenant running there)."""
    of_tenant = Allocation.job_id.in_(select(Job.id).where(Job.tenant_id == tenant_id))
    return _unbilled(session, of_tenant, Usage.tenant_id == tenant_id, now)


def _unbilled(
    session: Session,
    allocations: ColumnElement[bool],
    usages: ColumnElement[bool],
    now: datetime,
) -> Decimal:
    total = Decimal(0)
    histories: dict[tuple[str, str, str], Any] = {}
    for alloc in session.scalars(
        select(Allocation).where(
            allocations,
            Allocation.ended_at.is_(None),
            Allocation.billed_from.is_not(None),
            Allocation.paused_at.is_(None),
        )
    ):
        start = alloc.metered_until or alloc.billed_from
        assert start is not None
        if now <= start:
            continue
        key = (alloc.cluster_id, alloc.gpu_model, alloc.qos_class)
        if key not in histories:
            histories[key] = gpu_price_history(session, *key)
        try:
            parts = spans(histories[key], start, now)
        except LookupError:  # unpriced GPUs cannot be placed; settling will say so
            continue
        for part in parts:
            gpu_seconds = q6(Decimal(alloc.gpus) * _seconds(part.start, part.end))
            total += gpu_charge(gpu_seconds, part.price)[1]
        for part in _reserved_parts(session, alloc, start, now):
            held = q6(_gbps(alloc) * _seconds(part.start, part.end))
            total += bandwidth_charge(held, part.price)[1]
    rows = session.scalars(select(Usage).where(usages, Usage.priced.is_(False))).all()
    if rows:
        ids = dict(session.execute(select(Cluster.name, Cluster.id)).all())
        for usage in rows:
            try:
                total += charge_of(session, usage, ids).amount
            except NotFound:
                continue
    return total
