"""job_counts: each tenant's number of jobs, kept by triggers

The job list answers `total` with every page; counting a tenant's jobs read all of their index
entries (O(jobs): 0.35 ms on SQLite and 1.2 ms of PostgreSQL's CPU a read at 10,000 jobs, more
than the rest of the read). `job_counts` keeps the number, moved by triggers on every insert
and delete of `jobs` (and the rare update that moves a job to another tenant) whatever writes
them, so the list sums a few rows instead (`api.job_list`).

On PostgreSQL an insert adds to the stripe `pg_backend_pid() % 16`, once per statement (a
transition table): two transactions inserting one tenant's jobs at once update different
rows, and neither waits for the other's commit, unless their backends' stripes agree (1 in
16). SQLite has one writer: stripe 0, a row at a time. A delete takes from the tenant's lowest
stripe and never inserts, so a cascade from a deleted tenant (whose counts go with it) cannot
fail a foreign key.

SQLite drops a table's triggers with the table: a later migration that rebuilds `jobs` in
batch mode must create these again (`tests/controller/test_migrations.py` checks the counts
at the newest revision on both backends).

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-29 17:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_TAKE_SQLITE = """
    UPDATE job_counts SET n = n - 1
    WHERE tenant_id = OLD.tenant_id
      AND stripe = (SELECT min(stripe) FROM job_counts WHERE tenant_id = OLD.tenant_id);
"""
_ADD_SQLITE = """
    INSERT INTO job_counts (tenant_id, stripe, n) VALUES (NEW.tenant_id, 0, 1)
    ON CONFLICT (tenant_id, stripe) DO UPDATE SET n = n + 1;
"""

SQLITE = (
    f"CREATE TRIGGER jobs_counted_insert AFTER INSERT ON jobs BEGIN {_ADD_SQLITE} END",
    f"CREATE TRIGGER jobs_counted_delete AFTER DELETE ON jobs BEGIN {_TAKE_SQLITE} END",
    "CREATE TRIGGER jobs_counted_move AFTER UPDATE OF tenant_id ON jobs "
    f"FOR EACH ROW WHEN NEW.tenant_id IS NOT OLD.tenant_id BEGIN {_TAKE_SQLITE} {_ADD_SQLITE} END",
)

POSTGRES = (
    """
CREATE FUNCTION jobs_counted_insert() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO job_counts AS c (tenant_id, stripe, n)
    SELECT tenant_id, pg_backend_pid() % 16, count(*) FROM new_jobs
    GROUP BY tenant_id ORDER BY tenant_id
    ON CONFLICT (tenant_id, stripe) DO UPDATE SET n = c.n + EXCLUDED.n;
    RETURN NULL;
END
$$
""",
    """
CREATE TRIGGER jobs_counted_insert AFTER INSERT ON jobs
REFERENCING NEW TABLE AS new_jobs
FOR EACH STATEMENT EXECUTE FUNCTION jobs_counted_insert()
""",
    """
CREATE FUNCTION jobs_counted_delete() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE job_counts AS c SET n = c.n - d.k
    FROM (SELECT tenant_id, count(*) AS k FROM old_jobs GROUP BY tenant_id) AS d
    WHERE c.tenant_id = d.tenant_id
      AND c.stripe = (SELECT min(stripe) FROM job_counts m WHERE m.tenant_id = d.tenant_id);
    RETURN NULL;
END
$$
""",
    """
CREATE TRIGGER jobs_counted_delete AFTER DELETE ON jobs
REFERENCING OLD TABLE AS old_jobs
FOR EACH STATEMENT EXECUTE FUNCTION jobs_counted_delete()
""",
    """
CREATE FUNCTION jobs_counted_move() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE job_counts SET n = n - 1
    WHERE tenant_id = OLD.tenant_id
      AND stripe = (SELECT min(stripe) FROM job_counts WHERE tenant_id = OLD.tenant_id);
    INSERT INTO job_counts AS c (tenant_id, stripe, n)
    VALUES (NEW.tenant_id, pg_backend_pid() % 16, 1)
    ON CONFLICT (tenant_id, stripe) DO UPDATE SET n = c.n + 1;
    RETURN NULL;
END
$$
""",
    """
CREATE TRIGGER jobs_counted_move AFTER UPDATE OF tenant_id ON jobs
FOR EACH ROW WHEN (NEW.tenant_id IS DISTINCT FROM OLD.tenant_id)
EXECUTE FUNCTION jobs_counted_move()
""",
)


def _sqlite() -> bool:
    return op.get_bind().dialect.name == "sqlite"


def upgrade() -> None:
    op.create_table(
        "job_counts",
        sa.Column("tenant_id", sa.String(length=36), nullable=False),
        sa.Column("stripe", sa.SmallInteger(), autoincrement=False, nullable=False),
        sa.Column("n", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("tenant_id", "stripe"),
    )
    op.execute(
        "INSERT INTO job_counts (tenant_id, stripe, n) "
        "SELECT tenant_id, 0, count(*) FROM jobs GROUP BY tenant_id"
    )
    for statement in SQLITE if _sqlite() else POSTGRES:
        op.execute(statement)


def downgrade() -> None:
    for name in ("insert", "delete", "move"):
        if _sqlite():
            op.execute(f"DROP TRIGGER jobs_counted_{name}")
        else:
            op.execute(f"DROP TRIGGER jobs_counted_{name} ON jobs")
            op.execute(f"DROP FUNCTION jobs_counted_{name}()")
    op.drop_table("job_counts")
