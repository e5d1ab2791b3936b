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
