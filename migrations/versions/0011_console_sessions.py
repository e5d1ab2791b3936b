"""console sessions in the database

Console sign-ins lived in one process's memory: behind several replicas a browser needed
sticky sessions, and the workers of one `cpn serve --workers N` would each know a different
subset. The table is keyed by the SHA-256 of the cookie's random id and names the key by its
hash, so it holds nothing a caller could present.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-27 05:20:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "console_sessions",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("key_hash", sa.String(length=64), nullable=False),
        sa.Column("csrf", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_console_sessions_key_hash", "console_sessions", ["key_hash"])
    op.create_index("ix_console_sessions_expires_at", "console_sessions", ["expires_at"])


def downgrade() -> None:
    op.drop_index("ix_console_sessions_expires_at", table_name="console_sessions")
    op.drop_index("ix_console_sessions_key_hash", table_name="console_sessions")
    op.drop_table("console_sessions")
