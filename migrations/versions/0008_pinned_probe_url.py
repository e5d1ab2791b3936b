"""clusters: an admin-pinned probe URL

`clusters.pinned_probe_url` (nullable): when set, the peer list in heartbeat acks gives this
URL for the cluster instead of the one its agent reports (which stays stored in `probe_url`).
Adding a nullable column needs no table copy on either backend; dropping it does on SQLite,
so the downgrade uses batch mode.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-22 15:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("clusters", sa.Column("pinned_probe_url", sa.String(length=512), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("clusters", schema=None) as batch_op:
        batch_op.drop_column("pinned_probe_url")
