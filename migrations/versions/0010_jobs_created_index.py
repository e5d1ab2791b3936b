"""jobs: indexes for the all-tenant job list and the queue cap

An admin's `GET /v1/jobs` (every tenant) pages in `created_at DESC, id DESC` order; without an
index on that order each page sorted the whole table. Tenants' own lists already use
`ix_jobs_tenant_created`. Every submission counts the tenant's PENDING jobs against
CPN_MAX_QUEUED_JOBS (`controller.jobs.service._check_queue_cap`); on `ix_jobs_tenant_id` that read
every job row of the tenant (6.4 ms at 10,000 queued on SQLite), on (tenant_id, state) it
counts index entries (0.4 ms).

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
    op.create_index("ix_jobs_tenant_state", "jobs", ["tenant_id", "state"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_jobs_tenant_state", table_name="jobs")
    op.drop_index("ix_jobs_created", table_name="jobs")
