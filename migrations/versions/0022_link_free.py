"""links.free_gbps: a measured link's capacity apart from what is free on it now

An agent reports the most its recent probes carried (the link's capacity, as before, in
`bandwidth_gbps`) and, beside it, what its newest probe carried with the path's traffic on
it (`free_gbps`; NULL for declared links and for reports of older agents).

Revision ID: 0022
Revises: 0021
Create Date: 2026-12-07 01:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0022"
down_revision: str | None = "0021"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("links") as batch:
        batch.add_column(sa.Column("free_gbps", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("links") as batch:
        batch.drop_column("free_gbps")
