"""GPU reservations: never more than a cluster offers, even with several controllers.

The invariant, for every (cluster, GPU model): `in_use` = the GPUs of its open allocations,
never negative, never above what was allocatable when reserved. Each reservation is one
conditional UPDATE (`in_use + n <= allocatable`), which PostgreSQL and SQLite both apply
atomically per row, so two controllers can never both take the last GPUs. Each release first
closes its allocation with a conditional UPDATE (`ended_at IS NULL`), so of two concurrent
releases of one allocation (a cancel and a settlement) exactly one gives its GPUs back.
The WAN ports (`WanPort`) keep the same invariant for bandwidth: what is reserved of a
cluster's uplink or downlink is the `wan_kbps` of its open allocations, never negative, never
above the capacity declared when reserved, given back by the release that closes each one.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import delete, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session
from sqlalchemy.orm.attributes import set_committed_value

from controller.network.labels import number
from controller.network.resources import carried_gbps, link_rows
from controller.store.models import Allocation, Cluster, ClusterGpus, Job, WanPort, utcnow
from controller.values.errors import Conflict
from scheduler.bandwidth import KBPS_PER_GBPS, burst_room, free_gbps, port_gbps
from wire.plan import JobPlan

log = logging.getLogger("cpn.allocations")


def bursts(plan: JobPlan, cluster: str, direction: str) -> tuple[float, float] | None:
    """A placed job's exchanges through `cluster`'s uplink (`direction` "up") or downlink,
    as its plan was timed: the rate they cross it at (Gbit/s, the planned share of the path)
    and the part of its step they take; None where none crosses it paced or the plan gives
    no step to share. Reservations are averages, so this is what a later job's stream may
    take from it (`scheduler.bandwidth.burst_room`)."""
    end = 0 if direction == "up" else 1
    rates = [k.bandwidth_gbps for k in plan.links if k.paced and (k.src, k.dst)[end] == cluster]
    est = plan.estimate
    if not rates or est.compute_s is None or est.step_time_s <= 0:
        return None
    local = est.compute_s + (est.intra_s or 0.0) + est.step_overhead_s
    return max(rates), max(0.0, (est.step_time_s - local) / est.step_time_s)


def held_plans(
    session: Session, cluster_ids: Iterable[str]
) -> dict[str, list[tuple[int, JobPlan]]]:
    """The open WAN reservations on these clusters' ports: per cluster id, each holding
    job's rate there (kbit/s) and its plan."""
    ids = sorted(cluster_ids)
    if not ids:
        return {}
    kbps: dict[tuple[str, str], int] = defaultdict(int)
    plans: dict[str, JobPlan] = {}
    for cluster_id, job_id, rate, plan in session.execute(
        select(Allocation.cluster_id, Job.id, Allocation.wan_kbps, Job.placement)
        .join(Job, Job.id == Allocation.job_id)
        .where(
            Allocation.ended_at.is_(None),
            Allocation.wan_kbps > 0,
            Allocation.cluster_id.in_(ids),
        )
    ):
        if plan is not None:
            kbps[(cluster_id, job_id)] += rate or 0
            plans[job_id] = plan
    out: dict[str, list[tuple[int, JobPlan]]] = defaultdict(list)
    for (cluster_id, job_id), rate in sorted(kbps.items()):
        out[cluster_id].append((rate, plans[job_id]))
    return out


def free_room(
    name: str,
    direction: str,
    capacity: float | None,
    reserved_kbps: int,
    holders: Sequence[tuple[int, JobPlan]],
) -> float | None:
    """What the planner may still reserve of `name`'s port (`direction`) of `capacity`
    Gbit/s (None: undeclared, no limit), `reserved_kbps` held by `holders` (each job's rate
    and plan): the capacity less the reservations (`free_gbps`), and no more than keeps each
    holder's bursts within `BURST_TOLERANCE` of its plan (`burst_room`)."""
    left = free_gbps(capacity, reserved_kbps)
    if capacity is None or left is None:
        return left
    for rate, plan in holders:
        seen = bursts(plan, name, direction)
        if seen is not None:
            others = max(reserved_kbps - rate, 0) / KBPS_PER_GBPS
            left = min(left, burst_room(seen[1], seen[0], capacity, others))
    return left


@dataclass(frozen=True)
class Slot:
    """`gpus` GPUs of `gpu_model` in cluster `cluster`."""

    cluster: str
    gpu_model: str
    gpus: int


def reserve(
    session: Session,
    job: Job,
    slots: Sequence[Slot],
    wan_kbps: Mapping[str, int] | None = None,
) -> list[Allocation]:
    """Reserve every slot or none (the caller's transaction rolls back on Conflict), and on
    each cluster of `wan_kbps` (cluster name -> the plan's WAN rate there) that much of its
    uplink and downlink, where an admin declared their capacity (`reserve_wan`)."""
    now = utcnow()
    made = []
    wan = dict(wan_kbps or {})
    for slot in slots:
        row = session.execute(
            select(ClusterGpus.id, Cluster.id)
            .join(Cluster, Cluster.id == ClusterGpus.cluster_id)
            .where(Cluster.name == slot.cluster, ClusterGpus.model == slot.gpu_model)
        ).first()
        if row is None:
            raise Conflict(
                f"cluster {slot.cluster!r} has no {slot.gpu_model} GPUs", field="placement"
            )
        inv_id, cluster_id = row
        result = session.execute(
            update(ClusterGpus)
            .where(
                ClusterGpus.id == inv_id,
                ClusterGpus.in_use + slot.gpus <= ClusterGpus.allocatable,
            )
            .values(in_use=ClusterGpus.in_use + slot.gpus)
            .execution_options(synchronize_session=False)
        )
        if result.rowcount != 1:  # type: ignore[attr-defined]
            raise Conflict(
                f"cluster {slot.cluster!r} no longer has {slot.gpus} free {slot.gpu_model} GPUs",
                field="placement",
            )
        need = wan.pop(slot.cluster, 0)  # on the cluster's first slot: one need per cluster
        if need > 0:
            reserve_wan(session, cluster_id, slot.cluster, need)
        alloc = Allocation(
            job_id=job.id,
            cluster_id=cluster_id,
            gpu_model=slot.gpu_model,
            gpus=slot.gpus,
            qos_class=job.qos_class,
            started_at=now,
            wan_kbps=need or None,
        )
        session.add(alloc)
        made.append(alloc)
    session.flush()
    return made


def reserve_wan(session: Session, cluster_id: str, name: str, kbps: int) -> None:
    """Take `kbps` of the cluster's uplink and of its downlink, or raise Conflict naming the
    one that is full. A port without a declared capacity counts what is reserved (for the
    network map) and limits nothing; with one, the UPDATE is conditional on the sum staying
    within it, so concurrent placements can never both take its last bandwidth."""
    labels = session.scalar(select(Cluster.labels).where(Cluster.id == cluster_id)) or {}
    for direction, key in (("up", "uplink_gbps"), ("down", "downlink_gbps")):
        _ensure_port(session, cluster_id, direction)
        capacity = number(labels, key, name)
        cond = [WanPort.cluster_id == cluster_id, WanPort.direction == direction]
        if capacity is not None:
            cond.append(WanPort.reserved_kbps + kbps <= round(capacity * KBPS_PER_GBPS))
        result = session.execute(
            update(WanPort)
            .where(*cond)
            .values(reserved_kbps=WanPort.reserved_kbps + kbps)
            .execution_options(synchronize_session=False)
        )
        if result.rowcount != 1:  # type: ignore[attr-defined]
            raise Conflict(
                f"the {direction}link of {name} ({key} {capacity:g}) has too little bandwidth "
                f"left for this plan's {kbps / 1000:,.1f} Mbit/s",
                field="placement",
            )


def _ensure_port(session: Session, cluster_id: str, direction: str) -> None:
    """The port's row, made on its first reservation (clusters are made without them)."""
    dialect = session.get_bind().dialect.name
    insert = pg_insert if dialect == "postgresql" else sqlite_insert
    session.execute(
        insert(WanPort)
        .values(cluster_id=cluster_id, direction=direction, reserved_kbps=0)
        .on_conflict_do_nothing()
    )


def resize_wan(session: Session, job: Job, wanted: Mapping[str, int]) -> dict[str, int]:
    """Move the WAN rate the job's open allocations hold on each cluster's ports to
    `wanted` (cluster name -> kbit/s; its plan changed: a cluster left or joined). A rise
    is taken like a reservation (`reserve_wan`, under a savepoint): where a port has too
    little left, that cluster keeps what it held. A fall is given back. Returns the rate
    held per cluster afterwards."""
    first: dict[str, Allocation] = {}
    for alloc, name in session.execute(
        select(Allocation, Cluster.name)
        .join(Cluster, Cluster.id == Allocation.cluster_id)
        .where(Allocation.job_id == job.id, Allocation.ended_at.is_(None))
        .order_by(Allocation.wan_kbps.is_(None), Allocation.id)
    ).all():
        first.setdefault(name, alloc)  # the one that carries the cluster's rate, if any
    held: dict[str, int] = {}
    for name, alloc in first.items():
        old, new = alloc.wan_kbps or 0, max(0, int(wanted.get(name, 0)))
        if new > old:
            try:
                with session.begin_nested():
                    reserve_wan(session, alloc.cluster_id, name, new - old)
            except Conflict:
                new = old
        elif new < old:
            _return_wan(session, alloc.cluster_id, old - new)
        alloc.wan_kbps = new or None
        held[name] = new
    session.flush()
    return held


def _give_back_wan(session: Session, alloc: Allocation) -> None:
    """Return an allocation's WAN reservation to its cluster's ports; never below zero."""
    _return_wan(session, alloc.cluster_id, alloc.wan_kbps or 0)


def _return_wan(session: Session, cluster_id: str, kbps: int) -> None:
    """Return `kbps` of the cluster's uplink and downlink; never below zero."""
    if kbps <= 0:
        return
    for direction in ("up", "down"):
        session.execute(
            update(WanPort)
            .where(
                WanPort.cluster_id == cluster_id,
                WanPort.direction == direction,
                WanPort.reserved_kbps >= kbps,
            )
            .values(reserved_kbps=WanPort.reserved_kbps - kbps)
            .execution_options(synchronize_session=False)
        )


def release(
    session: Session, job: Job, until: datetime | None = None, cluster_id: str | None = None
) -> int:
    """End the job's open allocations (on `cluster_id` alone: a cluster that left a running
    job) and give their GPUs back; returns GPUs released.

    Idempotent per allocation: one closed by a concurrent release is skipped, never released
    twice. A missing inventory row (its model no longer reported) goes once nothing holds it.
    `until`: when the run's workers stopped, recorded as the allocations' end (what billing
    reads) when it is earlier than now.
    """
    now = min(until, utcnow()) if until is not None else utcnow()
    released = 0
    query = select(Allocation).where(Allocation.job_id == job.id, Allocation.ended_at.is_(None))
    if cluster_id is not None:
        query = query.where(Allocation.cluster_id == cluster_id)
    for alloc in session.scalars(query).all():
        closed = session.execute(
            update(Allocation)
            .where(Allocation.id == alloc.id, Allocation.ended_at.is_(None))
            .values(ended_at=now)
            .execution_options(synchronize_session=False)
        )
        if closed.rowcount != 1:  # type: ignore[attr-defined]
            session.refresh(alloc)  # another release got there first; take its end time
            continue
        set_committed_value(alloc, "ended_at", now)
        _give_back(session, alloc)
        _give_back_wan(session, alloc)
        released += alloc.gpus
    session.flush()
    return released


def _give_back(session: Session, alloc: Allocation) -> None:
    """Return an allocation's GPUs to its inventory row; never below zero."""
    row = (ClusterGpus.cluster_id == alloc.cluster_id) & (ClusterGpus.model == alloc.gpu_model)
    result = session.execute(
        update(ClusterGpus)
        .where(row, ClusterGpus.in_use >= alloc.gpus)
        .values(in_use=ClusterGpus.in_use - alloc.gpus)
        .execution_options(synchronize_session=False)
    )
    if result.rowcount != 1:  # type: ignore[attr-defined]
        # The books were already wrong (a row written before the invariant was kept): say so
        # loudly, and keep the row within its constraints rather than fail the settlement.
        log.error(
            "allocation %s returns %d %s GPUs that cluster %s does not count as in use",
            alloc.id,
            alloc.gpus,
            alloc.gpu_model,
            alloc.cluster_id,
        )
        session.execute(
            update(ClusterGpus)
            .where(row)
            .values(in_use=0)
            .execution_options(synchronize_session=False)
        )
    session.execute(
        delete(ClusterGpus)
        .where(row, ClusterGpus.missing.is_(True), ClusterGpus.in_use == 0)
        .execution_options(synchronize_session=False)
    )


@dataclass(frozen=True)
class Holder:
    """A job holding part of a WAN port: its id, its tenant and its rate there."""

    job_id: str
    tenant_id: str
    kbps: int


@dataclass(frozen=True)
class Port:
    """One cluster's uplink or downlink as it stands: declared capacity (None: undeclared,
    nothing limited), the most agents' probes carried over it (None: not measured), what is
    reserved and by whom."""

    cluster: str
    direction: str
    capacity_kbps: int | None
    reserved_kbps: int
    holders: tuple[Holder, ...]
    carried_kbps: int | None = None

    free_kbps: int | None = None
    """What the planner may still reserve (`free_room`: the capacity it plans on, less the
    reservations and what keeps the holders' bursts); None: undeclared, no limit."""


def ports(session: Session, only: Set[str] | None = None) -> list[Port]:
    """Every declared or reserved port, by cluster name then direction (up, down), with the
    jobs whose open allocations hold it, largest first; `only`: of these clusters (names)."""
    held: dict[str, list[Holder]] = {}
    for cluster_id, job_id, tenant_id, kbps in session.execute(
        select(Allocation.cluster_id, Allocation.job_id, Job.tenant_id, Allocation.wan_kbps)
        .join(Job, Job.id == Allocation.job_id)
        .where(Allocation.ended_at.is_(None), Allocation.wan_kbps > 0)
    ):
        held.setdefault(cluster_id, []).append(Holder(job_id, tenant_id, kbps or 0))
    reserved = {
        (cluster_id, direction): kbps
        for cluster_id, direction, kbps in session.execute(
            select(WanPort.cluster_id, WanPort.direction, WanPort.reserved_kbps)
        )
    }
    carried = carried_gbps(link_rows(session, only))
    clusters = select(Cluster.id, Cluster.name, Cluster.labels).order_by(Cluster.name)
    if only is not None:
        clusters = clusters.where(Cluster.name.in_(sorted(only)))
    rows = session.execute(clusters).all()
    plans = held_plans(session, [cluster_id for cluster_id, _, _ in rows if cluster_id in held])
    out: list[Port] = []
    for cluster_id, name, labels in rows:
        holders = tuple(sorted(held.get(cluster_id, ()), key=lambda h: (-h.kbps, h.job_id)))
        for i, (direction, key) in enumerate((("up", "uplink_gbps"), ("down", "downlink_gbps"))):
            capacity = number(labels or {}, key, name)
            kbps = reserved.get((cluster_id, direction))
            if capacity is None and kbps is None:
                continue
            seen = carried.get(name, (None, None))[i]
            planned = port_gbps(capacity, seen)
            room = free_room(name, direction, planned, kbps or 0, plans.get(cluster_id, ()))
            out.append(
                Port(
                    cluster=name,
                    direction=direction,
                    capacity_kbps=None if capacity is None else round(capacity * KBPS_PER_GBPS),
                    reserved_kbps=kbps or 0,
                    holders=holders,
                    carried_kbps=None if seen is None else round(seen * KBPS_PER_GBPS),
                    free_kbps=None if room is None else round(room * KBPS_PER_GBPS),
                )
            )
    return out
