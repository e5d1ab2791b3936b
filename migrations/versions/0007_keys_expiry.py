"""keys: expiry, short prefixes, the environment admin key's marker

API keys may carry an expiry (`expires_at`; past it a key fails like a revoked one). The key
given through CPN_ADMIN_TOKEN is marked (`from_env`), so starting with a new token revokes the
key it replaced; existing rows are marked when the bootstrap created them (role admin, name
"CPN_ADMIN_TOKEN"). Stored prefixes shrink to at most 8 characters of a generated key's random
part: the old ones were the first 12 characters of every token, the whole of a short one given
through the environment. Rows of keys cpn did not mint (the environment's, or any not of the
form `cpn_<role>_...`) keep no prefix at all.

On SQLite the table is copied by batch mode (to narrow `prefix`); no table references
`api_keys`, so the copy touches nothing else.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-22 14:40:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

PREFIX_CHARS = 8
ENV_KEY_NAME = "CPN_ADMIN_TOKEN"

api_keys = sa.table(
    "api_keys",
    sa.column("id", sa.String()),
    sa.column("name", sa.String()),
    sa.column("prefix", sa.String()),
    sa.column("role", sa.String()),
    sa.column("from_env", sa.Boolean()),
)


def short_prefix(prefix: str, role: str, from_env: bool) -> str:
    """What remains of an old 12-character prefix: the random part of a minted key, cut."""
    minted = f"cpn_{role}_"
    if from_env or not prefix.startswith(minted):
        return ""
    return prefix[len(minted) :][:PREFIX_CHARS]


def upgrade() -> None:
    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        batch_op.add_column(sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(
            sa.Column("from_env", sa.Boolean(), server_default=sa.false(), nullable=False)
        )
    conn = op.get_bind()
    conn.execute(
        api_keys.update()
        .where(api_keys.c.role == "admin", api_keys.c.name == ENV_KEY_NAME)
        .values(from_env=True)
    )
    rows = conn.execute(
        sa.select(api_keys.c.id, api_keys.c.prefix, api_keys.c.role, api_keys.c.from_env)
    ).all()
    for row in rows:
        new = short_prefix(row.prefix or "", row.role, bool(row.from_env))
        if new != row.prefix:
            conn.execute(api_keys.update().where(api_keys.c.id == row.id).values(prefix=new))
    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        batch_op.alter_column(
            "prefix",
            existing_type=sa.String(length=16),
            type_=sa.String(length=PREFIX_CHARS),
            existing_nullable=False,
        )


def downgrade() -> None:
    # The cut prefixes stay cut: the text they came from is not stored anywhere.
    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        batch_op.alter_column(
            "prefix",
            existing_type=sa.String(length=PREFIX_CHARS),
            type_=sa.String(length=16),
            existing_nullable=False,
        )
        batch_op.drop_column("from_env")
        batch_op.drop_column("expires_at")
