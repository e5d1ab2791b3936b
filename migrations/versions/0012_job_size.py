"""jobs: a job's size for the queue order

`jobs.run_s` (nullable float): seconds the job would compute alone on its fewest GPUs of the
reference model (`scheduler.reference_run_s`), set at submission. The queue orders a tenant's
jobs by response ratio, (waited + size) / size, so short jobs pass long ones while long ones
age. Jobs submitted before this revision have none and count as an hour's
(`scheduler.rules.UNKNOWN_RUN_S`). A nullable column needs no table copy on either backend;
dropping it does on SQLite, so the downgrade uses batch mode.

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-28 01:10:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("run_s", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("run_s")
