"""integrity: GPU accounting constraints, 64-bit counters, bounded messages

GPU inventory rows get a `missing` flag (a model the agent stopped reporting while jobs still
hold its GPUs) and CHECK constraints that make the database refuse any write breaking the
GPU invariant (`0 <= in_use <= count`, `0 <= allocatable <= count`); allocations hold at least
one GPU. Before the constraints go on, the books are repaired: `in_use` is recounted from the
open allocations (the invariant's definition), rows lost to the old heartbeat code come back
as missing rows, and `count` is raised to what is in use.

Step and byte counters become 64-bit (`job_metrics.step`, `job_metrics.wan_bytes`,
`jobs.checkpoint_step`): a job past 2 GiB of WAN traffic overflowed a 32-bit column on
PostgreSQL. On PostgreSQL this rewrites `job_metrics`; on SQLite (64-bit integers anyway)
the tables are copied by batch mode. Message bounds need no DDL: the columns keep their
lengths and the models cut over-long text when it is written.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-22 14:40:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

GPU_CHECKS = (
    ("ck_gpu_in_use_nonnegative", "in_use >= 0"),
    ("ck_gpu_allocatable_nonnegative", "allocatable >= 0"),
    ("ck_gpu_allocatable_within_count", "allocatable <= count"),
    ("ck_gpu_in_use_within_count", "in_use <= count"),
)
COUNTERS = (("job_metrics", "step", False), ("job_metrics", "wan_bytes", False))

inventory = sa.table(
    "gpu_inventory",
    sa.column("cluster_id", sa.String()),
    sa.column("model", sa.String()),
    sa.column("memory_gib", sa.Float()),
    sa.column("count", sa.Integer()),
    sa.column("allocatable", sa.Integer()),
    sa.column("in_use", sa.Integer()),
    sa.column("missing", sa.Boolean()),
    sa.column("updated_at", sa.DateTime(timezone=True)),
)
allocations = sa.table(
    "allocations",
    sa.column("cluster_id", sa.String()),
    sa.column("gpu_model", sa.String()),
    sa.column("gpus", sa.Integer()),
    sa.column("ended_at", sa.DateTime(timezone=True)),
)


def _repair_books() -> None:
    """Make the rows satisfy the constraints by the invariant's definition, not by clamping."""
    op.execute(sa.delete(allocations).where(allocations.c.gpus <= 0))
    open_allocs = allocations.c.ended_at.is_(None)
    same_row = sa.and_(
        allocations.c.cluster_id == inventory.c.cluster_id,
        allocations.c.gpu_model == inventory.c.model,
        open_allocs,
    )
    held = sa.select(sa.func.coalesce(sa.func.sum(allocations.c.gpus), 0)).where(same_row)
    op.execute(sa.update(inventory).values(in_use=held.scalar_subquery()))
    # Open allocations whose row the old heartbeat code deleted: back as missing rows.
    lost = (
        sa.select(
            allocations.c.cluster_id,
            allocations.c.gpu_model,
            sa.literal(0.0),
            sa.func.sum(allocations.c.gpus),
            sa.literal(0),
            sa.func.sum(allocations.c.gpus),
            sa.true(),
            sa.func.current_timestamp(),
        )
        .where(
            open_allocs,
            ~sa.exists().where(
                inventory.c.cluster_id == allocations.c.cluster_id,
                inventory.c.model == allocations.c.gpu_model,
            ),
        )
        .group_by(allocations.c.cluster_id, allocations.c.gpu_model)
    )
    op.execute(
        sa.insert(inventory).from_select(
            [
                "cluster_id",
                "model",
                "memory_gib",
                "count",
                "allocatable",
                "in_use",
                "missing",
                "updated_at",
            ],
            lost,
        )
    )
    op.execute(sa.update(inventory).where(inventory.c.count < 0).values(count=0))
    op.execute(sa.update(inventory).where(inventory.c.allocatable < 0).values(allocatable=0))
    op.execute(
        sa.update(inventory)
        .where(inventory.c.allocatable > inventory.c.count)
        .values(allocatable=inventory.c.count)
    )
    op.execute(
        sa.update(inventory)
        .where(inventory.c.in_use > inventory.c.count)
        .values(count=inventory.c.in_use)
    )


def upgrade() -> None:
    with op.batch_alter_table("gpu_inventory", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("missing", sa.Boolean(), server_default=sa.false(), nullable=False)
        )
    _repair_books()
    with op.batch_alter_table("gpu_inventory", schema=None) as batch_op:
        for name, condition in GPU_CHECKS:
            batch_op.create_check_constraint(name, condition)
    with op.batch_alter_table("allocations", schema=None) as batch_op:
        batch_op.create_check_constraint("ck_allocation_gpus_positive", "gpus > 0")
    with op.batch_alter_table("job_metrics", schema=None) as batch_op:
        for _table, column, nullable in COUNTERS:
            batch_op.alter_column(
                column,
                existing_type=sa.Integer(),
                type_=sa.BigInteger(),
                existing_nullable=nullable,
            )
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.alter_column(
            "checkpoint_step",
            existing_type=sa.Integer(),
            type_=sa.BigInteger(),
            existing_nullable=True,
        )


def downgrade() -> None:
    """Back to 32-bit counters (fails, rightly, on a value past 2**31-1) and no constraints;
    missing rows go away with their flag, as the old code would have deleted them."""
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.alter_column(
            "checkpoint_step",
            existing_type=sa.BigInteger(),
            type_=sa.Integer(),
            existing_nullable=True,
        )
    with op.batch_alter_table("job_metrics", schema=None) as batch_op:
        for _table, column, nullable in reversed(COUNTERS):
            batch_op.alter_column(
                column,
                existing_type=sa.BigInteger(),
                type_=sa.Integer(),
                existing_nullable=nullable,
            )
    with op.batch_alter_table("allocations", schema=None) as batch_op:
        batch_op.drop_constraint("ck_allocation_gpus_positive", type_="check")
    op.execute(sa.delete(inventory).where(inventory.c.missing.is_(True)))
    with op.batch_alter_table("gpu_inventory", schema=None) as batch_op:
        for name, _condition in reversed(GPU_CHECKS):
            batch_op.drop_constraint(name, type_="check")
        batch_op.drop_column("missing")
