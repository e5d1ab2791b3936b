"""tenants.charged_micros, tenants.held_micros, jobs.held_micros: a tenant's books as running totals

A placement checks the tenant's budget against what is committed: its ledger's total plus the
estimates of its jobs holding GPUs. Summing those at every placement read all of the tenant's
active jobs with several queries each, so a pass grew quadratically with one tenant's backlog
(issue 48). The totals are now kept with the writes that move them, in their transactions:

- `tenants.charged_micros`: the ledger's total, added to by a trigger on every insert into the
  ledger, whatever writes it (the ledger is append-only: nothing else moves it);
- `jobs.held_micros`: the estimate a job holds against its tenant's budget while it holds GPUs
  (set with its reservation, cleared when its run ends on the books);
- `tenants.held_micros`: the sum of its jobs' `held_micros`.

Integers of micro-dollars, so SQLite (which stores NUMERIC as a float) adds them exactly.
Backfilled from the ledger and from the plans of the jobs holding GPUs now. The index on
(tenant_id, state) gains `ends_at`: the jobs that ran past their estimated end are the ones a
placement reads one by one.

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-02 05:00:00
"""

from collections.abc import Sequence
from decimal import ROUND_CEILING, ROUND_HALF_EVEN, Decimal
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = "0018"
down_revision: str | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_MICRO = Decimal("0.000001")

SQLITE = """
CREATE TRIGGER ledger_charges_tenant AFTER INSERT ON ledger
BEGIN
    UPDATE tenants
    SET charged_micros = charged_micros + CAST(round(NEW.amount * 1000000) AS INTEGER)
    WHERE id = NEW.tenant_id;
END
"""
POSTGRES = (
    """
CREATE FUNCTION cpn_ledger_charges_tenant() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE tenants SET charged_micros = charged_micros + round(NEW.amount * 1000000)::bigint
    WHERE id = NEW.tenant_id;
    RETURN NULL;
END
$$
""",
    """
CREATE TRIGGER ledger_charges_tenant AFTER INSERT ON ledger
FOR EACH ROW EXECUTE FUNCTION cpn_ledger_charges_tenant()
""",
)


def _estimate_micros(plan: Any) -> int:
    """A stored plan's price (or estimated cost), rounded up to the micro-dollar."""
    if not isinstance(plan, dict):
        return 0
    price = plan.get("price")
    value = price.get("total") if isinstance(price, dict) else None
    if value is None:
        estimate = plan.get("estimate")
        value = estimate.get("cost") if isinstance(estimate, dict) else None
    if value is None:
        return 0
    return int(Decimal(str(value)).quantize(_MICRO, rounding=ROUND_CEILING) / _MICRO)


def upgrade() -> None:
    op.add_column(
        "tenants",
        sa.Column("charged_micros", sa.BigInteger(), nullable=False, server_default="0"),
    )
    op.add_column(
        "tenants", sa.Column("held_micros", sa.BigInteger(), nullable=False, server_default="0")
    )
    op.add_column("jobs", sa.Column("held_micros", sa.BigInteger(), nullable=True))
    op.create_index("ix_jobs_tenant_state_ends", "jobs", ["tenant_id", "state", "ends_at"])
    op.drop_index("ix_jobs_tenant_state", table_name="jobs")
    if op.get_bind().dialect.name == "sqlite":
        op.execute(SQLITE)
    else:
        for statement in POSTGRES:
            op.execute(statement)

    bind = op.get_bind()
    tenants = sa.table(
        "tenants",
        sa.column("id", sa.String),
        sa.column("charged_micros", sa.BigInteger),
        sa.column("held_micros", sa.BigInteger),
    )
    jobs = sa.table(
        "jobs",
        sa.column("id", sa.String),
        sa.column("tenant_id", sa.String),
        sa.column("placement", sa.JSON),
        sa.column("held_micros", sa.BigInteger),
    )
    ledger = sa.table("ledger", sa.column("tenant_id", sa.String), sa.column("amount", sa.Numeric))
    allocations = sa.table(
        "allocations", sa.column("job_id", sa.String), sa.column("ended_at", sa.DateTime)
    )
    charged: dict[str, Decimal] = {}
    for tenant_id, amount in bind.execute(sa.select(ledger.c.tenant_id, ledger.c.amount)):
        exact = Decimal(str(amount)).quantize(_MICRO, rounding=ROUND_HALF_EVEN)
        charged[tenant_id] = charged.get(tenant_id, Decimal(0)) + exact
    held: dict[str, int] = {}
    holding = sa.select(allocations.c.job_id).where(allocations.c.ended_at.is_(None))
    for job_id, tenant_id, plan in bind.execute(
        sa.select(jobs.c.id, jobs.c.tenant_id, jobs.c.placement).where(jobs.c.id.in_(holding))
    ):
        micros = _estimate_micros(plan)
        bind.execute(sa.update(jobs).where(jobs.c.id == job_id).values(held_micros=micros))
        held[tenant_id] = held.get(tenant_id, 0) + micros
    for tenant_id in set(charged) | set(held):
        bind.execute(
            sa.update(tenants)
            .where(tenants.c.id == tenant_id)
            .values(
                charged_micros=int(charged.get(tenant_id, Decimal(0)) / _MICRO),
                held_micros=held.get(tenant_id, 0),
            )
        )


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        op.execute("DROP TRIGGER ledger_charges_tenant")
    else:
        op.execute("DROP TRIGGER ledger_charges_tenant ON ledger")
        op.execute("DROP FUNCTION cpn_ledger_charges_tenant()")
    op.create_index("ix_jobs_tenant_state", "jobs", ["tenant_id", "state"])
    op.drop_index("ix_jobs_tenant_state_ends", table_name="jobs")
    with op.batch_alter_table("tenants") as batch:
        batch.drop_column("held_micros")
        batch.drop_column("charged_micros")
    op.drop_column("jobs", "held_micros")
