"""A tenant's budget is a hard limit, at placement and while its jobs run.

At placement (`controller.loop.placement`): what the tenant has committed plus the new job's
estimate must fit its budget. Committed is its ledger total, plus, for each of its jobs that
hold GPUs (SCHEDULED or RUNNING), the rest of that job's estimate, or what the run has cost so
far when it ran past its estimate. The check and the GPU reservation are one transaction, and
the tenant row is locked first (`SELECT ... FOR NO KEY UPDATE` on PostgreSQL; SQLite has one
writer), so two replicas placing jobs of one tenant at once count each other's jobs: they can
never both spend the last of a budget.

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

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from controller.money.metering import MICRO, exact_total, q6, tenant_spend, unbilled
from controller.store.models import Allocation, Job, LedgerEntry, Tenant
from grammar.states import ACTIVE
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


def _active_jobs(session: Session, tenant_id: str) -> list[Job]:
    return list(
        session.scalars(select(Job).where(Job.tenant_id == tenant_id, Job.state.in_(ACTIVE)))
    )


def _held_by(session: Session, job: Job, now: datetime) -> Decimal:
    """The rest of the job's estimate, or what its run cost beyond it."""
    run_start = session.scalar(
        select(func.min(Allocation.started_at)).where(
            Allocation.job_id == job.id, Allocation.ended_at.is_(None)
        )
    )
    charged = (
        exact_total(
            session,
            LedgerEntry.amount,
            LedgerEntry.job_id == job.id,
            LedgerEntry.period_start >= run_start,
        )
        if run_start is not None
        else Decimal(0)
    )
    cost_so_far = charged + unbilled(session, job, now)
    return max(estimate_of(job.placement), cost_so_far) - charged


def commitment(session: Session, tenant_id: str, now: datetime) -> Commitment:
    held = sum((_held_by(session, j, now) for j in _active_jobs(session, tenant_id)), Decimal(0))
    return Commitment(charged=tenant_spend(session, tenant_id), held=held)


def spent(session: Session, tenant_id: str, now: datetime) -> Decimal:
    """The tenant's spend as of `now`: charged, plus what its jobs ran up and is not billed."""
    running = sum((unbilled(session, j, now) for j in _active_jobs(session, tenant_id)), Decimal(0))
    return tenant_spend(session, tenant_id) + running


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
