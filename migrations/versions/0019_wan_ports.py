"""wan_ports, allocations.wan_kbps: a datacenter's uplink and downlink as reserved resources

A placed job reserves, on the uplink and downlink of each cluster its plan crosses the WAN
from, the bandwidth its plan sends (its bytes over its run), in the transaction that reserves
its GPUs, by a conditional update against the capacity an admin declared (the cluster's
`uplink_gbps` / `downlink_gbps` labels); it is given back when the allocation closes. Integers
of kbit/s, so sums are exact on both backends (issue 49).

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-02 05:10:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0019"
down_revision: str | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "wan_ports",
        sa.Column("cluster_id", sa.String(length=36), nullable=False),
        sa.Column("direction", sa.String(length=4), nullable=False),
        sa.Column("reserved_kbps", sa.BigInteger(), server_default="0", nullable=False),
        sa.CheckConstraint("reserved_kbps >= 0", name="ck_wan_port_nonnegative"),
        sa.ForeignKeyConstraint(["cluster_id"], ["clusters.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("cluster_id", "direction"),
    )
    op.add_column("allocations", sa.Column("wan_kbps", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("allocations") as batch:
        batch.drop_column("wan_kbps")
    op.drop_table("wan_ports")
