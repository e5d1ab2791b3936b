"""The SQLite database holds every tenant's jobs, the ledger and the audit log: its files are
its owner's alone (0600), new or found readable by others (issue 48)."""

from __future__ import annotations

import logging
import stat
from pathlib import Path

import pytest
from sqlalchemy import text

from controller.store.db import make_engine


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_new_database_and_its_side_files_are_0600(tmp_path: Path) -> None:
    db = tmp_path / "new" / "cpn.db"
    engine = make_engine(f"sqlite:///{db}")
    try:
        with engine.begin() as conn:
            conn.execute(text("CREATE TABLE t (x INTEGER)"))
            conn.execute(text("INSERT INTO t VALUES (1)"))
        with engine.connect() as conn:  # WAL: the side files exist while a connection is open
            conn.execute(text("SELECT * FROM t")).all()
            files = [p for p in tmp_path.joinpath("new").iterdir() if p.name.startswith("cpn.db")]
            assert {p.name for p in files} >= {"cpn.db", "cpn.db-wal"}
            assert all(_mode(p) == 0o600 for p in files), {p.name: oct(_mode(p)) for p in files}
    finally:
        engine.dispose()


def test_an_existing_readable_database_is_tightened_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    db = tmp_path / "cpn.db"
    db.touch()
    db.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="controller.store.db"):
        make_engine(f"sqlite:///{db}").dispose()
    assert _mode(db) == 0o600
    assert any("readable by others" in r.message for r in caplog.records)
