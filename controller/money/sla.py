"""SLA credits: what a provider promised of a cluster, against what was measured during a run.

A provider's SLA (`Sla`) promises a cluster's uptime and its uplink's bandwidth, and states
the share of a run's charges on that cluster refunded when a promise is missed. The evidence
is what cpn itself records: the cluster's state transitions (its agent's lease: a cluster not
READY or SUSPECT is down) and the agents' link measurements during the run. When a run's
allocation on the cluster ends, the rule is applied once: the tenant is refunded by a ledger
line (kind `sla_credit`), whose postings take it back from the provider and the platform in
the shares they were paid (`settlement.split`), so the books still balance.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from controller.money import settlement
from controller.money.amounts import q6
from controller.money.metering import SLA_CREDIT, WAN_RESERVED
from controller.store.models import (
    Allocation,
    Cluster,
    ClusterTransition,
    Job,
    LedgerEntry,
    Link,
    Sla,
    Usage,
)
from grammar.states import LIVE, ClusterState


@dataclass(frozen=True)
class Promise:
    uptime: Decimal | None  # the fraction of the time the cluster is up
    uplink_gbps: float | None  # what its uplink carries
    credit_rate: Decimal  # the share of the run's charges there refunded when missed


def uptime(
    before: ClusterState,
    changes: Sequence[tuple[datetime, ClusterState]],
    start: datetime,
    end: datetime,
) -> float:
    """The fraction of [start, end) the cluster was up (READY or SUSPECT: its agent held a
    lease), from its state at `start` and its state changes (sorted by time)."""
    span = (end - start).total_seconds()
    if span <= 0:
        return 1.0
    down, state, since = 0.0, before, start
    for at, to in changes:
        if at <= start:
            state = to
            continue
        if at >= end:
            break
        if state not in LIVE:
            down += (at - since).total_seconds()
        state, since = to, at
    if state not in LIVE:
        down += (end - since).total_seconds()
    return max(0.0, 1.0 - down / span)


def missed(promise: Promise, delivered_uptime: float, measured_gbps: float | None) -> list[str]:
    """Each promise the run did not get, in words with the numbers; empty when all were kept
    (a bandwidth promise without a measurement in the run is not judged)."""
    out = []
    if promise.uptime is not None and Decimal(str(delivered_uptime)) < promise.uptime:
        out.append(f"uptime {delivered_uptime:.2%} against {float(promise.uptime):.2%} promised")
    if (
        promise.uplink_gbps is not None
        and measured_gbps is not None
        and measured_gbps < promise.uplink_gbps
    ):
        out.append(
            f"uplink {measured_gbps:.3g} Gbit/s measured against {promise.uplink_gbps:.3g} promised"
        )
    return out


def refund(charges: Decimal, promise: Promise, misses: Sequence[str]) -> Decimal:
    """What the tenant gets back of `charges` on the cluster: the stated share when a
    promise was missed, nothing otherwise."""
    return q6(charges * promise.credit_rate) if misses and charges > 0 else Decimal(0)


def credit_run(session: Session, job: Job) -> list[LedgerEntry]:
    """Apply the SLAs of the clusters the job's ended allocations ran on, once each: a
    refund line per missed promise set, with the evidence in its description."""
    made: list[LedgerEntry] = []
    periods = session.execute(
        select(Allocation.cluster_id, Allocation.billed_from, Allocation.ended_at)
        .where(
            Allocation.job_id == job.id,
            Allocation.billed_from.is_not(None),
            Allocation.ended_at.is_not(None),
        )
        .distinct()
    ).all()
    for cluster_id, start, end in periods:
        if start is None or end is None or end <= start:
            continue
        cluster = session.get(Cluster, cluster_id)
        if cluster is None or cluster.provider_id is None:
            continue
        promise = _promise(session, cluster_id, start)
        if promise is None or _credited(session, job.id, cluster.name, start):
            continue
        misses = missed(
            promise,
            _uptime(session, cluster_id, start, end),
            _measured(session, cluster_id, start, end),
        )
        charges = _charges(session, job.id, cluster.name, start, end)
        amount = refund(charges, promise, misses)
        if amount <= 0:
            continue
        usage = Usage(
            tenant_id=job.tenant_id,
            job_id=job.id,
            kind=SLA_CREDIT,
            cluster=cluster.name,
            quantity=amount,
            period_start=start,
            period_end=end,
            priced=True,
        )
        session.add(usage)
        session.flush()
        entry = LedgerEntry(
            tenant_id=job.tenant_id,
            job_id=job.id,
            usage_id=usage.id,
            kind=SLA_CREDIT,
            description=(
                f"SLA credit on {cluster.name}: {'; '.join(misses)}; "
                f"{float(promise.credit_rate):.0%} of {charges} refunded"
            )[:256],
            quantity=amount,
            unit_price=Decimal(-1),
            amount=-amount,
            period_start=start,
            period_end=end,
        )
        session.add(entry)
        session.flush()
        settlement.post(session, [entry], {str(usage.id): cluster.name})
        made.append(entry)
    return made


def _promise(session: Session, cluster_id: str, at: datetime) -> Promise | None:
    row = session.scalars(
        select(Sla)
        .where(Sla.cluster_id == cluster_id, Sla.effective_from <= at)
        .order_by(Sla.effective_from.desc(), Sla.id.desc())
        .limit(1)
    ).first()
    if row is None:
        return None
    uptime_ = Decimal(str(row.uptime)) if row.uptime is not None else None
    return Promise(uptime_, row.uplink_gbps, Decimal(str(row.credit_rate)))


def _credited(session: Session, job_id: str, cluster: str, start: datetime) -> bool:
    return (
        session.scalar(
            select(func.count()).where(
                Usage.job_id == job_id,
                Usage.kind == SLA_CREDIT,
                Usage.cluster == cluster,
                Usage.period_start == start,
            )
        )
        or 0
    ) > 0


def _uptime(session: Session, cluster_id: str, start: datetime, end: datetime) -> float:
    before = session.scalar(
        select(ClusterTransition.to_state)
        .where(ClusterTransition.cluster_id == cluster_id, ClusterTransition.at <= start)
        .order_by(ClusterTransition.at.desc(), ClusterTransition.id.desc())
        .limit(1)
    )
    changes = session.execute(
        select(ClusterTransition.at, ClusterTransition.to_state)
        .where(
            ClusterTransition.cluster_id == cluster_id,
            ClusterTransition.at > start,
            ClusterTransition.at < end,
        )
        .order_by(ClusterTransition.at, ClusterTransition.id)
    ).all()
    return uptime(before or ClusterState.READY, [(a, s) for a, s in changes], start, end)


def _measured(session: Session, cluster_id: str, start: datetime, end: datetime) -> float | None:
    """The best rate the agents measured out of the cluster during the run: its uplink
    carries at least that; None without a measurement in the run."""
    value = session.scalar(
        select(func.max(Link.bandwidth_gbps)).where(
            Link.src_cluster_id == cluster_id,
            Link.source == "measured",
            Link.measured_at >= start,
            Link.measured_at <= end,
        )
    )
    return float(value) if value is not None else None


def _charges(
    session: Session, job_id: str, cluster: str, start: datetime, end: datetime
) -> Decimal:
    """The job's GPU, egress and reserved-bandwidth charges for the cluster's resources
    within the run."""
    rows = session.scalars(
        select(LedgerEntry.amount)
        .join(Usage, Usage.id == LedgerEntry.usage_id)
        .where(
            LedgerEntry.job_id == job_id,
            Usage.cluster == cluster,
            Usage.kind.in_(("gpu_seconds", "wan_bytes", WAN_RESERVED)),
            Usage.period_start >= start,
            Usage.period_end <= end,
        )
    ).all()
    return sum((q6(Decimal(str(a))) for a in rows), Decimal(0))
