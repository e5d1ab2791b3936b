"""A tenant's budget is a hard limit, at placement and while its jobs run.

At placement (`controller.loop.placement`): what the tenant has committed plus the new job's
estimate must fit its budget. Committed is its ledger total, plus the estimates of its jobs
that hold GPUs, plus what those running past their estimated end cost beyond their estimate.
The first two are running totals on the tenant row (`Tenant.charged_micros`, moved by every
ledger entry; `Tenant.held_micros`, moved by `hold` with each reservation and `unhold` when a
run ends), so a check reads a few rows however many jobs the tenant has: re-summing every
active job at each placement made a pass quadratic in one tenant's backlog. The check and the
GPU reservation are one transaction, and the tenant row is locked first (`SELECT ... FOR NO
KEY UPDATE` on PostgreSQL; SQLite has one writer), so two replicas placing jobs of one tenant
at once count each other's jobs: they can never both spend the last of a budget.

While its jobs run (`controller.loop.launcher`): when the tenant's spend (its ledger, plus what its
running jobs have cost and is not billed yet) reaches the budget, its runs are checkpointed
and stopped (`StopReason.BUDGET`) and the jobs end FAILED, "budget exhausted".

The job spec's own `qos.budget` is another limit, per job, that the planner keeps.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from decimal import ROUND_CEILING, Decimal

from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session

from controller.money.metering import (
    MICRO,
    from_micros,
    micros,
    q6,
    tenant_unbilled,
    unbilled,
)
from controller.store.models import Job, Tenant
from grammar.states import JobState
from wire.plan import JobPlan

# ---- pure ------------------------------------------------------------------------------------


def as_money(value: float | Decimal | None) -> Decimal:
    """A price or budget as an exact decimal to 6 places (floats through their shortest repr,
    so a budget of 0.01 is 0.01, not 0.01000000000000000020816681711721685)."""
    if value is None:
        return Decimal(0)
    return q6(value if isinstance(value, Decimal) else Decimal(str(value)))


@dataclass(frozen=True)
class Commitment:
    """What a tenant's money is spoken for by: charges, and jobs holding GPUs."""

    charged: Decimal
    """The ledger's total."""
    held: Decimal
    """The rest of the estimates of its jobs that hold GPUs (or what they cost beyond them)."""

    @property
    def total(self) -> Decimal:
        return self.charged + self.held


def left(budget: Decimal, commitment: Commitment) -> Decimal:
    return budget - commitment.total


def refusal(budget: Decimal, commitment: Commitment, estimate: Decimal) -> str | None:
    """None when a job estimated at `estimate` fits the budget, else why it must wait. A
    budget of 0 (or less) places nothing, whatever the estimate."""
    if budget <= 0:
        return f"the tenant's budget is {budget:.2f}: nothing is placed; an admin may raise it"
    if commitment.total + estimate <= budget:
        return None
    return (
        f"the plan costs {estimate:.2f} and the tenant has {max(left(budget, commitment), 0):.2f}"
        f" of its budget of {budget:.2f} left ({commitment.charged:.2f} charged,"
        f" {commitment.held:.2f} held by its running jobs); an admin may raise the budget"
    )


def reached(budget: Decimal, spent: Decimal) -> bool:
    """The budget is used up: spend reached it (nothing spent reaches nothing, even a 0 budget
    with free GPUs)."""
    return spent > 0 and spent >= budget


def priced_up(value: float | None) -> Decimal:
    """An estimate as money for a budget check: rounded up to the micro-dollar, so a positive
    cost never counts as 0 (a tiny estimate rounded half-even did, and jobs of a budget-0
    tenant were placed)."""
    if value is None:
        return Decimal(0)
    return Decimal(str(value)).quantize(MICRO, rounding=ROUND_CEILING)


def estimate_of(plan: JobPlan | None) -> Decimal:
    """A placed job's estimated price, rounded up (0 for plans stored without one)."""
    if plan is None:
        return Decimal(0)
    if plan.price is not None:
        return priced_up(plan.price.total)
    return priced_up(plan.estimate.cost)


# ---- reading the books -----------------------------------------------------------------------


@dataclass(frozen=True)
class Terms:
    budget: Decimal | None
    deleted: bool


def lock_terms(session: Session, tenant_id: str) -> Terms:
    """The tenant's budget, its row locked until the transaction ends (PostgreSQL: FOR NO KEY
    UPDATE, which serialises placements of one tenant's jobs but lets submissions, whose
    foreign key takes KEY SHARE, go on). A missing tenant counts as deleted."""
    row = session.execute(
        select(Tenant.budget, Tenant.deleted_at)
        .where(Tenant.id == tenant_id)
        .with_for_update(key_share=True)
    ).first()
    if row is None:
        return Terms(None, deleted=True)
    budget, deleted_at = row
    return Terms(None if budget is None else as_money(budget), deleted=deleted_at is not None)


def hold(session: Session, job: Job, plan: JobPlan) -> None:
    """The job's GPUs are being reserved for `plan`: its estimate is held against its
    tenant's budget (the job's `held_micros`, and added to the tenant's running total), in
    the reservation's transaction. Replaces what the job held before, if anything."""
    amount = micros(estimate_of(plan))
    _move_held(session, job.tenant_id, amount - (job.held_micros or 0))
    job.held_micros = amount


def unhold(session: Session, job: Job) -> None:
    """The job's run ended on the books (`lifecycle.end_run`): what it held goes back to its
    tenant's running total, once (the job row's version makes a second, concurrent end of
    the same run fail at its flush, rolling its share back). First in `end_run`, so the
    tenant row is locked before any GPU row is, in the order a placement takes them."""
    _move_held(session, job.tenant_id, -(job.held_micros or 0))
    if job.held_micros is not None:
        job.held_micros = None


def _move_held(session: Session, tenant_id: str, delta: int) -> None:
    session.execute(
        update(Tenant)
        .where(Tenant.id == tenant_id)
        .values(held_micros=Tenant.held_micros + delta)
        .execution_options(synchronize_session=False)
    )


def commitment(session: Session, tenant_id: str, now: datetime) -> Commitment:
    """The tenant's commitment from its running totals: what it was charged, what its jobs
    holding GPUs hold, and for the jobs running past their estimated end, what they have cost
    beyond their estimate (`unbilled`). A few reads, whatever the size of its backlog."""
    row = session.execute(
        select(Tenant.charged_micros, Tenant.held_micros).where(Tenant.id == tenant_id)
    ).first()
    if row is None:
        return Commitment(Decimal(0), Decimal(0))
    charged, held = from_micros(row[0]), from_micros(row[1])
    overdue = session.scalars(
        select(Job).where(
            Job.tenant_id == tenant_id,
            Job.state == JobState.RUNNING,
            or_(Job.ends_at.is_(None), Job.ends_at < now),
        )
    ).all()
    for job in overdue:
        held += max(unbilled(session, job, now) - from_micros(job.held_micros or 0), Decimal(0))
    return Commitment(charged=charged, held=held)


def spent(session: Session, tenant_id: str, now: datetime) -> Decimal:
    """The tenant's spend as of `now`: charged, plus what its jobs ran up and is not billed."""
    charged = session.scalar(select(Tenant.charged_micros).where(Tenant.id == tenant_id)) or 0
    return from_micros(charged) + tenant_unbilled(session, tenant_id, now)


def exhausted(session: Session, tenant_ids: Iterable[str], now: datetime) -> dict[str, str]:
    """Tenants among `tenant_ids` whose spend reached their budget, each with the detail."""
    out: dict[str, str] = {}
    rows = session.execute(
        select(Tenant.id, Tenant.budget).where(
            Tenant.id.in_(set(tenant_ids)), Tenant.budget.is_not(None)
        )
    ).all()
    for tenant_id, raw in rows:
        budget = as_money(raw)
        used = spent(session, tenant_id, now)
        if reached(budget, used):
            out[tenant_id] = f"the tenant spent {used:.2f} of its budget of {budget:.2f}"
    return out
