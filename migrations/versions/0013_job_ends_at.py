"""jobs: when a running job is expected to end

`jobs.ends_at` (nullable datetime): set when the job is placed, from its plan's estimated run
time. The reconcile loop reads it for the jobs holding GPUs, to weigh holding a queued job for
faster GPUs those jobs hand back soon (`scheduler.waiting`). Jobs placed before this revision
have none and count as ending at an unknown time. A nullable column needs no table copy on
either backend; dropping it does on SQLite, so the downgrade uses batch mode.

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-28 13:40:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("ends_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("ends_at")
