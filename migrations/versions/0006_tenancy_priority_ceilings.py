"""tenancy: priority ceilings and allowed QoS classes per tenant

Priority is granted, not chosen: each tenant gets an admin-set priority ceiling (0 unless an
admin raises it) and the QoS classes it may use (standard and spot; guaranteed is granted).
Existing tenants get the same defaults: a tenant that relied on a higher priority or on the
guaranteed class needs an admin to grant it (PATCH /v1/tenants/{id}).

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-22 14:40:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Plain ADD COLUMNs (with server defaults for the rows already there): SQLite's batch mode
    # needs no table copy for them, so the tenants' foreign keys are never touched.
    with op.batch_alter_table("tenants", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("priority_ceiling", sa.Integer(), server_default="0", nullable=False)
        )
        batch_op.add_column(
            sa.Column(
                "qos_classes", sa.JSON(), server_default='["standard", "spot"]', nullable=False
            )
        )


def downgrade() -> None:
    # ALTER TABLE ... DROP COLUMN on both backends (SQLite >= 3.35): a batch copy of `tenants`
    # would drop the old table, and with foreign keys on that deletes every tenant's jobs.
    op.execute("ALTER TABLE tenants DROP COLUMN qos_classes")
    op.execute("ALTER TABLE tenants DROP COLUMN priority_ceiling")
