"""A tenant's burst of submissions gets `jobs` analyzed (`controller.store.table_stats`), so its
list reads the newest page by index instead of sorting all of its jobs."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import Connection, Engine, insert, text

from api.job_list import _keys
from api.processes import wait_until
from controller.store.db import make_engine, scratch_database
from controller.store.migrate import upgrade
from controller.store.models import Job, Tenant
from controller.store.table_stats import BurstAnalyzer, BurstPolicy


def test_a_tenants_burst_asks_for_one_analyze_an_interval() -> None:
    policy = BurstPolicy(min_jobs=3, min_interval_s=10)
    assert not policy.inserted(["a", "a", "b"], now=0)  # no tenant at 3 yet
    assert policy.inserted(["a"], now=1)
    assert not policy.since  # the analyze sees all of those
    assert not policy.inserted(["b"] * 5, now=5)  # too soon after the last
    assert policy.inserted([], now=11)  # b's 5 still counted: due once the interval is over


def test_no_analyze_starts_while_one_runs() -> None:
    policy = BurstPolicy(min_jobs=2, min_interval_s=0)
    assert not policy.inserted(["a", "a"], now=0, busy=True)
    assert policy.since["a"] == 2  # counted for the next one
    assert policy.inserted([], now=1)


def _jobs(tenant: str, n: int) -> list[dict[str, object]]:
    spec = {"name": "x", "task": "builtin:mnist1d-mlp", "gpus": 1}
    return [
        {"tenant_id": tenant, "name": f"j{i}", "spec": spec, "gpus_min": 1, "gpus_max": 1}
        for i in range(n)
    ]


def _plan(conn: Connection, tenant: str) -> str:
    keys, _ = _keys(True, False)
    compiled = keys.compile(conn.engine)
    params = dict(compiled.params, tenant=tenant, limit=50, offset=0)
    rows = conn.exec_driver_sql(f"EXPLAIN {compiled}", params).scalars().all()
    return "\n".join(rows)


@pytest.fixture
def engine(pg_server_url: str) -> Iterator[Engine]:
    with scratch_database(pg_server_url, "cpn_stats") as url:
        upgrade(url)
        engine = make_engine(url)
        try:
            yield engine
        finally:
            engine.dispose()


@pytest.mark.postgres
def test_a_burst_gets_the_tenants_list_read_by_index(engine: Engine) -> None:
    with engine.begin() as conn:
        # only this test's analyze may run: autovacuum's own would hide whether it did
        conn.execute(text("ALTER TABLE jobs SET (autovacuum_enabled = false)"))
        old = conn.execute(insert(Tenant).values(name="old").returning(Tenant.id)).scalar_one()
        new = conn.execute(insert(Tenant).values(name="new").returning(Tenant.id)).scalar_one()
        conn.execute(insert(Job), _jobs(old, 200))
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("ANALYZE jobs"))
    with engine.begin() as conn:
        conn.execute(insert(Job), _jobs(new, 3000))
    with engine.connect() as conn:
        before = _plan(conn, new)
    assert "Sort" in before  # the tenant is estimated at a row or two: all 3,000 sorted

    analyzer = BurstAnalyzer(engine, BurstPolicy(min_jobs=1000))
    analyzer.inserted([new] * 3000)
    wait_until(lambda: analyzer.analyzed == 1, 30, "the burst's ANALYZE")
    with engine.connect() as conn:
        after = _plan(conn, new)
    # newest first along an index of `created_at`, stopping at the page's 50
    assert "Sort" not in after and "Index Scan Backward" in after, after
