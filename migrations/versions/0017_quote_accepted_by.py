"""quotes.accepted_by: a quote is accepted once

A quote prices one spec and is accepted by one job (issue 48): the job that accepted it is
written in the same transaction as the job, by a conditional update (`accepted_by IS NULL`),
so two submissions racing with one quote get one job and one 409 on every backend. Quotes
accepted before this revision are left unmarked (their jobs keep their held prices).

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-02 02:20:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("quotes") as batch:
        batch.add_column(sa.Column("accepted_by", sa.String(36), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("quotes") as batch:
        batch.drop_column("accepted_by")
