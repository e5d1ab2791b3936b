"""SQLite: a transaction that reads before it writes waits for another writer, never fails.

A placement opens its transaction at its first savepoint, reads (the GPUs free), then writes
(the reservation). Begun deferred, its read took a snapshot; a submission committed meanwhile
made its write fail at once with "database is locked", the busy timeout never consulted, and
the controller's pass was retried (issue 48). Begun IMMEDIATE, it holds the write lock from
the start and the other writer waits for it instead.
"""

from __future__ import annotations

import threading
from pathlib import Path

from sqlalchemy import select, update

from controller.store.db import make_engine, make_sessionmaker
from controller.store.migrate import upgrade
from controller.store.models import Tenant


def test_a_savepoint_transaction_that_reads_then_writes_outlasts_a_concurrent_writer(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'cpn.db'}"
    upgrade(url)
    engine = make_engine(url)
    sessions = make_sessionmaker(engine)
    with sessions() as s, s.begin():
        s.add_all([Tenant(name="a"), Tenant(name="b")])
    errors: list[BaseException] = []

    def other_writer() -> None:  # a submission, on its own connection
        try:
            with sessions() as s, s.begin():
                s.execute(update(Tenant).where(Tenant.name == "b").values(gpu_quota=7))
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            errors.append(exc)

    try:
        with sessions() as s, s.begin(), s.begin_nested():
            s.scalar(select(Tenant.id).where(Tenant.name == "a"))  # read first
            writer = threading.Thread(target=other_writer)
            writer.start()
            writer.join(timeout=1.0)  # deferred, it committed here; immediate, it waits
            s.execute(update(Tenant).where(Tenant.name == "a").values(gpu_quota=3))
        writer.join(timeout=60)
        assert not writer.is_alive()
        assert errors == []
        with sessions() as s:
            quotas = dict(s.execute(select(Tenant.name, Tenant.gpu_quota)).all())
        assert quotas == {"a": 3, "b": 7}
    finally:
        engine.dispose()
