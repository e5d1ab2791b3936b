"""jobs: a fencing epoch per job; allocations: billing pauses

`jobs.fence` (BIGINT NOT NULL, default 0) is bumped by every launch of a run and every
adoption of an orphaned job; a run's progress, settlement and checkpoints carry the value it
started with and are refused once the job's has moved on, so a run that outlived its
replica's lease writes nothing. Existing jobs start at their `attempts`, the epoch their
workers stamped on checkpoints before this revision, so their next run's epoch is above every
checkpoint they wrote and resuming from one is not refused. Adding a column with a default
needs no table copy on either backend; dropping it does on SQLite, so the downgrade uses batch
mode.

`allocations.paused_at` (nullable) and `allocations.paused_s` (NUMERIC(18,6), default 0): a
job adopted from a dead replica is not billed from the old run's last sign of life until its
relaunch; `paused_s` keeps the skipped seconds so GPU usage stays auditable against
`billed_from`..`metered_until`.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-22 17:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("fence", sa.BigInteger(), server_default="0", nullable=False))
    op.execute("UPDATE jobs SET fence = attempts WHERE attempts > 0")
    op.add_column("allocations", sa.Column("paused_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column(
        "allocations",
        sa.Column("paused_s", sa.Numeric(18, 6), server_default="0", nullable=False),
    )


def downgrade() -> None:
    with op.batch_alter_table("allocations", schema=None) as batch_op:
        batch_op.drop_column("paused_s")
        batch_op.drop_column("paused_at")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("fence")
