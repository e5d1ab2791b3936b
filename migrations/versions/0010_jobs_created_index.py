"""jobs: an index for the all-tenant job list

An admin's `GET /v1/jobs` (every tenant) pages in `created_at DESC, id DESC` order; without an
index on that order each page sorted the whole table. Tenants' own lists already use
`ix_jobs_tenant_created`.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-23 08:30:00
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_jobs_created", "jobs", ["created_at", "id"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_jobs_created", table_name="jobs")
