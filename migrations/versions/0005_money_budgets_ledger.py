"""money: hard budgets, billing from run start, append-only ledger, tenant soft delete

- `tenants.deleted_at`: deleting a tenant is a soft delete; its jobs, usage and ledger stay.
- `allocations.billed_from`: billing counts from when the job runs, not from when its GPUs
  were reserved. Rows already there keep being billed from their start, except the open
  allocations of jobs still SCHEDULED (not running yet: billed once they run).
- `usage` and `ledger` lose their ON DELETE CASCADE (to tenants, jobs, usage): nothing erases
  the money trail. On PostgreSQL the keys are dropped and made again; on SQLite (foreign keys
  on) the two tables are copied aside, rebuilt and filled again, ledger first, so dropping a
  table never cascades into another one's rows (a batch-mode copy of `usage` would: dropping
  it deletes its rows first, and the ledger's CASCADE would follow).
- `ledger`: `UNIQUE(usage_id)` (a usage row is charged once) and triggers that refuse UPDATE
  and DELETE (and TRUNCATE on PostgreSQL): the ledger is append-only in the database.

A later revision that rebuilds `ledger` on SQLite (batch mode) drops its triggers with the old
table: make them again there (`LEDGER_TRIGGERS_SQLITE`).

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-22 14:40:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

APPEND_ONLY = "the ledger is append-only: its entries are never changed or deleted"

LEDGER_TRIGGERS_SQLITE = (
    f"""CREATE TRIGGER ledger_no_update BEFORE UPDATE ON ledger
BEGIN SELECT RAISE(ABORT, '{APPEND_ONLY} (UPDATE refused)'); END""",
    f"""CREATE TRIGGER ledger_no_delete BEFORE DELETE ON ledger
BEGIN SELECT RAISE(ABORT, '{APPEND_ONLY} (DELETE refused)'); END""",
)
LEDGER_TRIGGERS_POSTGRES = (
    f"""CREATE FUNCTION cpn_ledger_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '{APPEND_ONLY} (% refused)', TG_OP USING ERRCODE = 'restrict_violation';
END
$$""",
    """CREATE TRIGGER ledger_no_update_delete BEFORE UPDATE OR DELETE ON ledger
FOR EACH ROW EXECUTE FUNCTION cpn_ledger_append_only()""",
    """CREATE TRIGGER ledger_no_truncate BEFORE TRUNCATE ON ledger
FOR EACH STATEMENT EXECUTE FUNCTION cpn_ledger_append_only()""",
)

MONEY_KEYS = (
    ("usage", "tenant_id", "tenants"),
    ("usage", "job_id", "jobs"),
    ("ledger", "tenant_id", "tenants"),
    ("ledger", "job_id", "jobs"),
    ("ledger", "usage_id", "usage"),
)
"""The money tables' foreign keys: (table, column, referred table), each to `id`."""


def _is_sqlite() -> bool:
    return op.get_bind().dialect.name == "sqlite"


def _fk(column: str, referred: str, cascade: bool) -> sa.ForeignKeyConstraint:
    return sa.ForeignKeyConstraint(
        [column], [f"{referred}.id"], ondelete="CASCADE" if cascade else None
    )


def _usage_table(cascade: bool) -> None:
    op.create_table(
        "usage",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("tenant_id", sa.String(length=36), nullable=False),
        sa.Column("job_id", sa.String(length=36), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("cluster", sa.String(length=63), nullable=False),
        sa.Column("dst_cluster", sa.String(length=63), nullable=True),
        sa.Column("gpu_model", sa.String(length=128), nullable=True),
        sa.Column("qos_class", sa.String(length=16), nullable=True),
        sa.Column("quantity", sa.Numeric(precision=18, scale=6), nullable=False),
        sa.Column("period_start", sa.DateTime(timezone=True), nullable=False),
        sa.Column("period_end", sa.DateTime(timezone=True), nullable=False),
        sa.Column("priced", sa.Boolean(), nullable=False),
        _fk("job_id", "jobs", cascade),
        _fk("tenant_id", "tenants", cascade),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_usage_job_id", "usage", ["job_id"], unique=False)
    op.create_index("ix_usage_priced", "usage", ["priced"], unique=False)
    op.create_index("ix_usage_tenant", "usage", ["tenant_id", "period_start"], unique=False)


def _ledger_table(cascade: bool) -> None:
    op.create_table(
        "ledger",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("tenant_id", sa.String(length=36), nullable=False),
        sa.Column("job_id", sa.String(length=36), nullable=False),
        sa.Column("usage_id", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("description", sa.String(length=256), nullable=False),
        sa.Column("quantity", sa.Numeric(precision=18, scale=6), nullable=False),
        sa.Column("unit_price", sa.Numeric(precision=18, scale=6), nullable=False),
        sa.Column("amount", sa.Numeric(precision=18, scale=6), nullable=False),
        sa.Column("period_start", sa.DateTime(timezone=True), nullable=False),
        sa.Column("period_end", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        _fk("job_id", "jobs", cascade),
        _fk("tenant_id", "tenants", cascade),
        _fk("usage_id", "usage", cascade),
        sa.PrimaryKeyConstraint("id"),
        *([] if cascade else [sa.UniqueConstraint("usage_id", name="uq_ledger_usage")]),
    )
    op.create_index("ix_ledger_job_id", "ledger", ["job_id"], unique=False)
    op.create_index("ix_ledger_tenant", "ledger", ["tenant_id", "id"], unique=False)


def _rebuild_sqlite(cascade: bool) -> None:
    """Remake `usage` and `ledger` with (cascade) or without their ON DELETE CASCADE, rows
    kept: each is copied aside first, the ledger (which references usage) dropped first."""
    for table in ("ledger", "usage"):
        op.execute(f"CREATE TABLE _keep_{table} AS SELECT * FROM {table}")
        op.execute(f"DROP TABLE {table}")  # its indexes go with it
    _usage_table(cascade)
    _ledger_table(cascade)
    for table in ("usage", "ledger"):
        columns = ", ".join(c["name"] for c in sa.inspect(op.get_bind()).get_columns(table))
        op.execute(f"INSERT INTO {table} ({columns}) SELECT {columns} FROM _keep_{table}")
        op.execute(f"DROP TABLE _keep_{table}")


def _rekey_postgres(cascade: bool) -> None:
    """Drop and make again the money tables' foreign keys, by the names the server gave them."""
    inspector = sa.inspect(op.get_bind())
    for table, column, referred in MONEY_KEYS:
        for fk in inspector.get_foreign_keys(table):
            if fk["constrained_columns"] == [column] and fk["name"]:
                op.drop_constraint(fk["name"], table, type_="foreignkey")
        op.create_foreign_key(
            f"{table}_{column}_fkey",
            table,
            referred,
            [column],
            ["id"],
            ondelete="CASCADE" if cascade else None,
        )


def upgrade() -> None:
    with op.batch_alter_table("tenants", schema=None) as batch_op:  # a plain ADD COLUMN
        batch_op.add_column(sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=True))
    with op.batch_alter_table("allocations", schema=None) as batch_op:  # a plain ADD COLUMN
        batch_op.add_column(sa.Column("billed_from", sa.DateTime(timezone=True), nullable=True))
    allocations = sa.table(
        "allocations",
        sa.column("job_id", sa.String()),
        sa.column("started_at", sa.DateTime(timezone=True)),
        sa.column("ended_at", sa.DateTime(timezone=True)),
        sa.column("billed_from", sa.DateTime(timezone=True)),
    )
    jobs = sa.table("jobs", sa.column("id", sa.String()), sa.column("state", sa.String()))
    waiting = sa.and_(
        allocations.c.ended_at.is_(None),
        allocations.c.job_id.in_(sa.select(jobs.c.id).where(jobs.c.state == "SCHEDULED")),
    )
    op.execute(
        sa.update(allocations).where(sa.not_(waiting)).values(billed_from=allocations.c.started_at)
    )
    if _is_sqlite():
        _rebuild_sqlite(cascade=False)
        for statement in LEDGER_TRIGGERS_SQLITE:
            op.execute(statement)
    else:
        _rekey_postgres(cascade=False)
        op.create_unique_constraint("uq_ledger_usage", "ledger", ["usage_id"])
        for statement in LEDGER_TRIGGERS_POSTGRES:
            op.execute(statement)


def downgrade() -> None:
    if _is_sqlite():
        op.execute("DROP TRIGGER IF EXISTS ledger_no_update")
        op.execute("DROP TRIGGER IF EXISTS ledger_no_delete")
        _rebuild_sqlite(cascade=True)
    else:
        op.execute("DROP TRIGGER IF EXISTS ledger_no_truncate ON ledger")
        op.execute("DROP TRIGGER IF EXISTS ledger_no_update_delete ON ledger")
        op.execute("DROP FUNCTION IF EXISTS cpn_ledger_append_only()")
        op.drop_constraint("uq_ledger_usage", "ledger", type_="unique")
        _rekey_postgres(cascade=True)
    # ALTER TABLE ... DROP COLUMN on both backends (SQLite >= 3.35): a batch copy of `tenants`
    # would drop the old table, and with foreign keys on that deletes every tenant's jobs.
    op.execute("ALTER TABLE allocations DROP COLUMN billed_from")
    op.execute("ALTER TABLE tenants DROP COLUMN deleted_at")
