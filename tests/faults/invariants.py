"""The books after a fault, read straight from the database: what every fault test asserts.

- GPUs: for every (cluster, model), `in_use` = the GPUs of its open allocations, never
  negative, never above `count`; no job that is not active holds an open allocation.
- Money: every usage row (but those of a running job not settled yet) is priced by exactly
  one ledger entry whose amount is the usage times the price in effect for its period
  (`controller.money.metering.charge_of`, the formula the audits use), and the ledger's exact total
  is the sum of those charges.
- Metering: each allocation's GPU time is metered once: a job's GPU usage equals the GPUs of
  its allocations times the time they were billed (from `billed_from` to `metered_until`, less
  the pauses while no run was alive, `paused_s`), and
  its usage periods on one (cluster, model) never overlap.
- Runs: a job reached each terminal state at most once.
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from controller.money import settlement
from controller.money.amounts import exact_total, q6
from controller.money.metering import _seconds, charge_of
from controller.store.db import is_sqlite, make_engine, make_sessionmaker
from controller.store.models import (
    Allocation,
    Cluster,
    ClusterGpus,
    Job,
    JobEvent,
    LedgerEntry,
    Usage,
)
from grammar.states import ACTIVE, TERMINAL, JobState


@dataclass
class Books:
    """What the database says, and every broken invariant found in it."""

    states: dict[str, JobState] = field(default_factory=dict)
    terminal_events: dict[str, Counter[JobState]] = field(default_factory=dict)
    in_use: dict[tuple[str, str], int] = field(default_factory=dict)
    open_allocations: dict[str, int] = field(default_factory=dict)  # job -> GPUs held
    usage_rows: int = 0
    unpriced: int = 0  # usage rows of active jobs, not settled yet
    gpu_seconds: dict[str, Decimal] = field(default_factory=dict)  # job -> GPU time metered
    ledger_rows: int = 0
    ledger_total: Decimal = Decimal(0)
    charged: Decimal = Decimal(0)  # sum of usage x price, recomputed
    broken: list[str] = field(default_factory=list)

    def summary(self) -> str:
        states = Counter(str(s) for s in self.states.values())
        return (
            f"jobs {dict(states)}, GPUs in use {sum(self.in_use.values())}, "
            f"usage rows {self.usage_rows} ({self.unpriced} unsettled), "
            f"ledger rows {self.ledger_rows}, "
            f"ledger total {self.ledger_total} = usage x prices {self.charged}"
        )


def read_books(url: str) -> Books:
    """Read the books on `url` and check every invariant; `broken` lists what does not hold.

    All in one snapshot, while the control plane writes: PostgreSQL reads at REPEATABLE READ,
    and SQLite in an explicit read transaction (pysqlite sends BEGIN only before a write, so
    each SELECT would otherwise see the commits made since the one before it, and a job's
    release landing between the allocations and the inventory read as a broken book)."""
    engine = make_engine(url)
    try:
        with make_sessionmaker(engine)() as s, s.begin():
            if is_sqlite(url):
                s.connection().exec_driver_sql("BEGIN")
            else:
                s.connection(execution_options={"isolation_level": "REPEATABLE READ"})
            return _check(s)
    finally:
        engine.dispose()


def assert_books(url: str) -> Books:
    books = read_books(url)
    assert not books.broken, "\n".join([books.summary(), *books.broken])
    return books


def _check(s: Session) -> Books:
    books = Books()
    broken = books.broken
    books.states = dict(s.execute(select(Job.id, Job.state)).all())

    # GPUs
    held: dict[tuple[str, str], int] = {
        (name, model): int(n)
        for name, model, n in s.execute(
            select(Cluster.name, Allocation.gpu_model, func.sum(Allocation.gpus))
            .join(Cluster, Cluster.id == Allocation.cluster_id)
            .where(Allocation.ended_at.is_(None))
            .group_by(Cluster.name, Allocation.gpu_model)
        )
    }
    for inv, name in s.execute(
        select(ClusterGpus, Cluster.name).join(Cluster, Cluster.id == ClusterGpus.cluster_id)
    ):
        key = (name, inv.model)
        books.in_use[key] = inv.in_use
        if inv.in_use != held.get(key, 0):
            broken.append(f"{key}: in_use {inv.in_use} != open allocations {held.get(key, 0)}")
        if not 0 <= inv.in_use <= inv.count:
            broken.append(f"{key}: in_use {inv.in_use} outside 0..{inv.count}")
    for key in set(held) - set(books.in_use):
        broken.append(f"{key}: {held[key]} GPUs held without an inventory row")
    for job_id, gpus in s.execute(
        select(Allocation.job_id, func.sum(Allocation.gpus))
        .where(Allocation.ended_at.is_(None))
        .group_by(Allocation.job_id)
    ):
        books.open_allocations[job_id] = int(gpus)
        if books.states.get(job_id) not in set(ACTIVE):
            broken.append(f"job {job_id} is {books.states.get(job_id)} and holds {gpus} GPUs")

    # Runs: each terminal state reached at most once
    for job_id, to in s.execute(
        select(JobEvent.job_id, JobEvent.to_state).where(
            JobEvent.kind == "state", JobEvent.to_state.in_(TERMINAL)
        )
    ):
        assert to is not None
        books.terminal_events.setdefault(job_id, Counter())[to] += 1
    for job_id, seen in books.terminal_events.items():
        if sum(seen.values()) != 1:
            broken.append(f"job {job_id} ended {sum(seen.values())} times: {dict(seen)}")

    # Money: one ledger entry per usage row, at usage x price
    usage = s.scalars(select(Usage).order_by(Usage.id)).all()
    entries = s.scalars(select(LedgerEntry).order_by(LedgerEntry.id)).all()
    books.usage_rows, books.ledger_rows = len(usage), len(entries)
    by_usage: dict[int, list[LedgerEntry]] = defaultdict(list)
    for entry in entries:
        by_usage[entry.usage_id].append(entry)
    ids = dict(s.execute(select(Cluster.name, Cluster.id)).all())
    for row in usage:
        priced = by_usage.get(row.id, [])
        if not row.priced and not priced and books.states.get(row.job_id) in set(ACTIVE):
            books.unpriced += 1  # WAN bytes of a running job: priced when its run settles
            continue
        if not row.priced or len(priced) != 1:
            broken.append(f"usage {row.id} (priced={row.priced}) has {len(priced)} ledger entries")
            continue
        charge = charge_of(s, row, ids)
        entry = priced[0]
        books.charged += charge.amount
        if (q6(Decimal(entry.amount)), q6(Decimal(entry.unit_price))) != (
            charge.amount,
            charge.unit_price,
        ):
            broken.append(
                f"ledger {entry.id}: {entry.amount} at {entry.unit_price}, but usage {row.id} "
                f"x price = {charge.amount} at {charge.unit_price}"
            )
    for usage_id in set(by_usage) - {u.id for u in usage}:
        broken.append(f"ledger entries for usage {usage_id}, which does not exist")
    unposted = settlement.unbalanced(s)
    if unposted:
        broken.append(f"ledger entries whose postings do not sum to zero: {unposted[:10]}")
    books.ledger_total = exact_total(s, LedgerEntry.amount)
    if books.ledger_total != books.charged:
        broken.append(f"ledger total {books.ledger_total} != usage x prices {books.charged}")

    # Metering: each allocation's billed time metered exactly once
    billed: dict[str, Decimal] = defaultdict(Decimal)
    for alloc in s.scalars(select(Allocation)):
        if alloc.billed_from is not None and alloc.metered_until is not None:
            span = _seconds(alloc.billed_from, alloc.metered_until) - Decimal(alloc.paused_s)
            billed[alloc.job_id] += q6(Decimal(alloc.gpus) * span)
    metered: dict[str, Decimal] = defaultdict(Decimal)
    periods: dict[tuple[str, str, str | None], list[tuple[datetime, datetime]]] = defaultdict(list)
    for row in usage:
        if row.kind == "gpu_seconds":
            metered[row.job_id] += Decimal(row.quantity)
            periods[(row.job_id, row.cluster, row.gpu_model)].append(
                (row.period_start, row.period_end)
            )
    books.gpu_seconds = dict(metered)
    for job_id in set(billed) | set(metered):
        if q6(metered[job_id]) != q6(billed[job_id]):
            broken.append(
                f"job {job_id}: GPU usage {metered[job_id]} GPU-s != allocations billed "
                f"{billed[job_id]} GPU-s"
            )
    for where, spans in periods.items():
        spans.sort()
        for (_, end), (start, _) in itertools.pairwise(spans):
            if start < end:
                broken.append(f"{where}: usage periods overlap ({start} < {end})")
    return books
