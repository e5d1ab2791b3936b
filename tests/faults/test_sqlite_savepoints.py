"""A transaction on SQLite is all or nothing even when a SAVEPOINT comes before its first write.

pysqlite sends BEGIN only before the first write: a SAVEPOINT issued earlier (the placement's
`begin_nested()` around its GPU reservation) opened the transaction itself, and releasing it
committed the reservation, so a placement that rolled back (or whose process was killed)
after reserving left the GPUs reserved for a job still PENDING. Found by the fault test that
kills the controller at `place.before_commit`; `controller.store.db.make_engine` now begins the
transaction before such a savepoint.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import text

from controller.store.db import make_engine, make_sessionmaker


class Crash(Exception):
    pass


def test_a_rollback_undoes_writes_made_inside_a_savepoint(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'db.sqlite'}")
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE gpus (in_use INTEGER)"))
        conn.execute(text("INSERT INTO gpus VALUES (0)"))
    sessions = make_sessionmaker(engine)
    with pytest.raises(Crash), sessions() as s, s.begin():
        s.execute(text("SELECT in_use FROM gpus")).all()  # reads first, as a placement does
        with s.begin_nested():
            s.execute(text("UPDATE gpus SET in_use = in_use + 4"))  # the reservation
        s.execute(text("UPDATE gpus SET in_use = in_use + 100"))
        raise Crash  # the placement fails before it commits
    with engine.connect() as conn:
        assert conn.execute(text("SELECT in_use FROM gpus")).scalar() == 0

    with sessions() as s, s.begin():  # and a savepoint rolled back alone, then a commit
        s.execute(text("SELECT in_use FROM gpus")).all()
        with pytest.raises(Crash), s.begin_nested():
            s.execute(text("UPDATE gpus SET in_use = in_use + 100"))
            raise Crash
        with s.begin_nested():
            s.execute(text("UPDATE gpus SET in_use = in_use + 4"))
    with engine.connect() as conn:
        assert conn.execute(text("SELECT in_use FROM gpus")).scalar() == 4
    engine.dispose()
