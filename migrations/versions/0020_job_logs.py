"""job_logs: what a job's workers printed and its driver said, line by line

A run's reports carry the lines its workers wrote to stdout and stderr since the last report
and the driver's own (a cluster left, a restart and its error); the controller stores them in
the report's transaction, keeping a job's newest lines (issue 51).

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-03 12:40:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0020"
down_revision: str | None = "0019"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "job_logs",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(length=36), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("source", sa.String(length=64), nullable=False),
        sa.Column("stream", sa.String(length=8), nullable=False),
        sa.Column("text", sa.String(length=2100), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_job_logs_job", "job_logs", ["job_id", "id"])


def downgrade() -> None:
    op.drop_index("ix_job_logs_job", table_name="job_logs")
    op.drop_table("job_logs")
