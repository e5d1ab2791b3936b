"""The newest migration matches the models; serve refuses an unmigrated database."""

from __future__ import annotations

import os
import subprocess
import sys

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from controller.db import make_engine
from controller.migrate import pending_reason
from controller.models import Base, UTCDateTime


def _compare_type(ctx, inspected_column, metadata_column, inspected_type, metadata_type):
    from sqlalchemy import DateTime

    if isinstance(metadata_type, UTCDateTime):
        return not isinstance(inspected_type, DateTime)
    return None


def test_models_and_newest_revision_agree(migrated_url: str) -> None:
    engine = make_engine(migrated_url)
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": _compare_type})
        diff = compare_metadata(ctx, Base.metadata)
    engine.dispose()
    assert diff == []
    assert pending_reason(make_engine(migrated_url)) is None


def test_serve_refuses_unmigrated_database(tmp_path) -> None:
    env = {**os.environ, "CPN_DATABASE_URL": f"sqlite:///{tmp_path / 'fresh.db'}"}
    cpn = [sys.executable, "-m", "api.cli"]
    r = subprocess.run(
        [*cpn, "serve", "--port", "0"], env=env, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 1
    assert "cpn db upgrade" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = subprocess.run([*cpn, "db", "upgrade"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([*cpn, "db", "current"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "up to date" in r.stdout


def _fill(conn, table, parents: dict[str, object]) -> object:
    """Insert one row with a value for every column, foreign keys pointing at `parents`."""
    import datetime as dt
    import uuid

    from sqlalchemy import JSON, Boolean, DateTime, Float, Integer, Numeric

    row: dict[str, object] = {}
    for column in table.columns:
        fks = list(column.foreign_keys)
        if fks:
            row[column.name] = parents[fks[0].column.table.name]
        elif isinstance(column.type, Boolean):
            row[column.name] = False
        elif isinstance(column.type, Integer | Float | Numeric):
            row[column.name] = 1
        elif isinstance(column.type, DateTime):
            row[column.name] = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
        elif isinstance(column.type, JSON):
            row[column.name] = {}
        else:
            row[column.name] = uuid.uuid4().hex[:8]
    conn.execute(table.insert().values(row))
    key = [c.name for c in table.primary_key.columns]
    return row[key[0]] if key else None


def test_upgrading_keeps_every_row(migrated_url: str, tmp_path) -> None:
    """Upgrade from 0003 with a row in every table: no row is lost on the way to the newest.

    SQLite rebuilds a table to alter it; with foreign keys on, dropping the old copy would
    cascade-delete the rows that reference it (a job's events, usage, the ledger)."""
    from sqlalchemy import MetaData, func, select

    from controller.db import is_sqlite, scratch_database
    from controller.migrate import upgrade

    def check(url: str) -> None:
        upgrade(url, "0003")
        engine = make_engine(url)
        meta = MetaData()
        meta.reflect(engine)
        tables = [t for t in meta.sorted_tables if t.name != "alembic_version"]
        with engine.begin() as conn:
            ids: dict[str, object] = {}
            for table in tables:
                ids[table.name] = _fill(conn, table, ids)
        engine.dispose()
        upgrade(url)
        engine = make_engine(url)
        with engine.connect() as conn:
            counts = {
                t.name: conn.execute(select(func.count()).select_from(t)).scalar() for t in tables
            }
        engine.dispose()
        assert counts == {t.name: 1 for t in tables}

    if is_sqlite(migrated_url):
        check(f"sqlite:///{tmp_path / 'old.db'}")
    else:
        from tests.conftest import PG_URL

        with scratch_database(PG_URL, "cpn_upgrade") as url:
            check(url)


def test_every_update_of_a_job_moves_its_version(db_url: str) -> None:
    """Revision 0014: an UPDATE of `jobs` that leaves `version` moves it (the job list keeps
    rendered jobs by (id, version), `api.job_list`); one that sets it keeps what it set, so
    the ORM's version counter works as before. Fails if a later migration that rebuilds the
    table (SQLite's batch mode) loses the trigger."""
    from sqlalchemy import MetaData, text

    engine = make_engine(db_url)
    meta = MetaData()
    meta.reflect(engine, only=["tenants", "jobs"])
    try:
        with engine.begin() as conn:
            tenant = _fill(conn, meta.tables["tenants"], {})
            job = _fill(conn, meta.tables["jobs"], {"tenants": tenant})

        def version() -> int:
            with engine.connect() as conn:
                return int(conn.execute(text("SELECT version FROM jobs")).scalar_one())

        assert version() == 1
        with engine.begin() as conn:
            conn.execute(text("UPDATE jobs SET reason = 'by hand' WHERE id = :id"), {"id": job})
        assert version() == 2
        with engine.begin() as conn:
            conn.execute(
                text("UPDATE jobs SET reason = 'orm', version = 7 WHERE id = :id"), {"id": job}
            )
        assert version() == 7
    finally:
        engine.dispose()
