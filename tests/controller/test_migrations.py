"""The newest migration matches the models; serve refuses an unmigrated database."""

from __future__ import annotations

import os
import subprocess
import sys
from decimal import Decimal

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from controller.store.db import make_engine
from controller.store.migrate import pending_reason
from controller.store.models import Base, UTCDateTime


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
    from sqlalchemy import MetaData, func, select, text

    from controller.store.db import is_sqlite, scratch_database
    from controller.store.migrate import upgrade

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
            kept = conn.execute(text("SELECT sum(n) FROM job_counts")).scalar()
            charged = conn.execute(text("SELECT charged_micros FROM tenants")).scalar()
            amount = conn.execute(text("SELECT amount FROM ledger")).scalar()
        engine.dispose()
        assert counts == {t.name: 1 for t in tables}
        assert kept == 1  # revision 0015 counted the job already there
        assert charged == round(Decimal(str(amount)) * 10**6)  # revision 0018 summed the ledger

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


def _job_counts(engine) -> tuple[dict[str, int], dict[str, int]]:
    """(kept by the triggers, counted): each tenant's number of jobs."""
    from sqlalchemy import text

    with engine.connect() as conn:
        kept = conn.execute(text("SELECT tenant_id, sum(n) FROM job_counts GROUP BY tenant_id"))
        counted = conn.execute(text("SELECT tenant_id, count(*) FROM jobs GROUP BY tenant_id"))
        return (
            {t: int(n) for t, n in kept if n},
            {t: int(n) for t, n in counted},
        )


def test_job_counts_follow_every_write_of_jobs(db_url: str) -> None:
    """Revision 0015: `job_counts` (the job list's `total`) moves with every insert, delete and
    change of tenant of `jobs`, in one statement or row by row, whatever writes it; a tenant's
    hard delete cascades without a foreign-key error. Fails if a later migration that rebuilds
    `jobs` (SQLite's batch mode) loses the triggers."""
    from sqlalchemy import MetaData, text

    engine = make_engine(db_url)
    meta = MetaData()
    meta.reflect(engine, only=["tenants", "jobs"])
    tenants, jobs = meta.tables["tenants"], meta.tables["jobs"]
    try:
        with engine.begin() as conn:
            a, b = _fill(conn, tenants, {}), _fill(conn, tenants, {})
            mine = [_fill(conn, jobs, {"tenants": a}) for _ in range(3)]
            row = dict(conn.execute(jobs.select().where(jobs.c.id == mine[0])).one()._mapping)
            many = [
                {**row, "id": f"many-{i}", "tenant_id": t, "idempotency_key": f"k{i}"}
                for i, t in enumerate([a, b, a, b, b])
            ]
            conn.execute(jobs.insert(), many)  # executemany
            two = [{**row, "id": f"two-{t}", "tenant_id": t, "idempotency_key": t} for t in (a, b)]
            conn.execute(jobs.insert().values(two))  # one statement, two rows
        assert _job_counts(engine) == ({a: 6, b: 4}, {a: 6, b: 4})
        with engine.begin() as conn:
            conn.execute(jobs.delete().where(jobs.c.id.in_([mine[0], "many-1"])))
            conn.execute(
                text("UPDATE jobs SET tenant_id = :b WHERE id = :id"), {"b": b, "id": mine[1]}
            )
            conn.execute(
                text("UPDATE jobs SET reason = 'same tenant' WHERE id = :id"), {"id": mine[2]}
            )
        assert _job_counts(engine) == ({a: 4, b: 4}, {a: 4, b: 4})
        with engine.begin() as conn:
            conn.execute(tenants.delete().where(tenants.c.id == b))  # cascades to its jobs
        assert _job_counts(engine) == ({a: 4}, {a: 4})
    finally:
        engine.dispose()


@pytest.mark.postgres
@pytest.mark.parametrize("migrated_url", ["postgres"], indirect=True)
def test_two_transactions_insert_one_tenants_jobs_at_once(db_url: str) -> None:
    """On PostgreSQL two open transactions insert one tenant's jobs without the second waiting
    for the first's commit (each adds to its backend's stripe of `job_counts`); fails with one
    counter row a tenant (the second's insert times out on the first's row lock)."""
    from sqlalchemy import Connection, MetaData, text

    engine = make_engine(db_url)
    meta = MetaData()
    meta.reflect(engine, only=["tenants", "jobs"])
    tenants, jobs = meta.tables["tenants"], meta.tables["jobs"]
    conns: list[Connection] = []
    try:
        with engine.begin() as conn:
            tenant = _fill(conn, tenants, {})
            _fill(conn, jobs, {"tenants": tenant})
            row = dict(conn.execute(jobs.select()).one()._mapping)
        by_stripe: dict[int, Connection] = {}  # two whose backends' pids differ modulo 16
        while len(by_stripe) < 2:
            conns.append(engine.connect())
            by_stripe[conns[-1].execute(text("SELECT pg_backend_pid() % 16")).scalar_one()] = conns[
                -1
            ]
        first, second = by_stripe.values()
        first.execute(jobs.insert().values({**row, "id": "first", "idempotency_key": "first"}))
        second.execute(text("SET LOCAL lock_timeout = '2s'"))
        second.execute(jobs.insert().values({**row, "id": "second", "idempotency_key": "second"}))
        second.commit()
        first.commit()
        assert _job_counts(engine) == ({tenant: 3}, {tenant: 3})
    finally:
        for conn in conns:
            conn.close()
        engine.dispose()


def test_revision_0016_rewrites_rows_the_models_no_longer_loosen_for(
    migrated_url: str, tmp_path
) -> None:
    """Rows an older cpn wrote (free-form args; quote options and a held quote naming their
    shares `placement`), written at revision 0015, read as typed values after the upgrade."""
    from sqlalchemy.orm import Session

    from controller.store.db import is_sqlite, scratch_database
    from controller.store.migrate import upgrade
    from controller.store.models import Job, Quote
    from tests.controller.test_plan import OLD_JOB_PLAN, STORED_QUOTE_OPTION
    from wire.spec import stored_spec

    old_spec = {
        "name": "old",
        "task": "builtin:mnist1d-mlp",
        "args": {"eval_every": -1, "anything": [1, 2], "lr": 0.05, "seed": 3},
        "gpus": 2,
        "steps": 100,
    }

    def check(url: str) -> None:
        from sqlalchemy import MetaData

        upgrade(url, "0015")
        engine = make_engine(url)
        meta = MetaData()
        meta.reflect(engine, only=["tenants", "quotes", "jobs"])
        tenants, quotes, jobs = (meta.tables[t] for t in ("tenants", "quotes", "jobs"))
        with engine.begin() as conn:
            tenant = _fill(conn, tenants, {})
            quote_id = _fill(conn, quotes, {"tenants": tenant})
            job = _fill(conn, jobs, {"tenants": tenant, "quotes": quote_id})
            conn.execute(
                quotes.update().values(spec=old_spec, options={"options": [STORED_QUOTE_OPTION]})
            )
            conn.execute(
                jobs.update().values(
                    spec=old_spec,
                    placement=OLD_JOB_PLAN,
                    held_price={"quote_id": quote_id, **STORED_QUOTE_OPTION},
                    state="PENDING",
                )
            )
        engine.dispose()
        upgrade(url)
        engine = make_engine(url)
        try:
            with Session(engine) as session:
                row = session.get(Job, job)
                quote = session.get(Quote, quote_id)
                assert row is not None and quote is not None
                assert stored_spec(row.spec).args.given() == {"lr": 0.05, "seed": 3}
                assert stored_spec(quote.spec).args.given() == {"lr": 0.05, "seed": 3}
                assert row.held_price is not None and row.held_price.quote_id == quote_id
                assert [s.cluster for s in row.held_price.clusters] == ["ap-south"]
                assert [s.gpus for s in quote.options.options[0].clusters] == [8]
                assert row.placement is not None and row.placement.gpus == 8
        finally:
            engine.dispose()

    if is_sqlite(migrated_url):
        check(f"sqlite:///{tmp_path / 'old.db'}")
    else:
        from tests.conftest import PG_URL

        with scratch_database(PG_URL, "cpn_rewrite") as url:
            check(url)
