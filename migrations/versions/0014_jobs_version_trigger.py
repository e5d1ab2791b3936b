"""jobs: every UPDATE moves the row's version

A job's `version` is its ETag, and the job list keeps each job's rendered JSON by
`(id, version)` (`api.job_list`), so a row must never change while its version stays. The ORM
moves it (`version_id_col`) and cpn's Core updates set it; this trigger moves it for any other
`UPDATE` that leaves it as it was (an operator's SQL, a later migration's data fix), on both
backends. An update that sets it itself (the ORM, cpn's Core updates) is left alone.

SQLite drops a table's triggers with the table: a later migration that rebuilds `jobs` in
batch mode must create this trigger again (`tests/controller/test_migrations.py` checks it at
the newest revision on both backends).

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-29 11:00:00
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SQLITE = """
CREATE TRIGGER jobs_version_moves AFTER UPDATE ON jobs
FOR EACH ROW WHEN NEW.version IS OLD.version
BEGIN
    UPDATE jobs SET version = OLD.version + 1 WHERE id = NEW.id;
END
"""

POSTGRES_FUNCTION = """
CREATE FUNCTION jobs_version_moves() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.version IS NOT DISTINCT FROM OLD.version THEN
        NEW.version := OLD.version + 1;
    END IF;
    RETURN NEW;
END
$$
"""

POSTGRES_TRIGGER = """
CREATE TRIGGER jobs_version_moves BEFORE UPDATE ON jobs
FOR EACH ROW EXECUTE FUNCTION jobs_version_moves()
"""


def _sqlite() -> bool:
    return op.get_bind().dialect.name == "sqlite"


def upgrade() -> None:
    if _sqlite():
        op.execute(SQLITE)
    else:
        op.execute(POSTGRES_FUNCTION)
        op.execute(POSTGRES_TRIGGER)


def downgrade() -> None:
    if _sqlite():
        op.execute("DROP TRIGGER jobs_version_moves")
    else:
        op.execute("DROP TRIGGER jobs_version_moves ON jobs")
        op.execute("DROP FUNCTION jobs_version_moves()")
