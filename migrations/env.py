"""Alembic environment: runs against the URL that `controller.store.migrate` passes in."""

from __future__ import annotations

from typing import Any, Literal

from alembic import context
from sqlalchemy import DateTime, pool

from controller.store.db import make_engine
from controller.store.models import Base, UTCDateTime

config = context.config
target_metadata = Base.metadata


def render_item(type_: str, obj: Any, autogen_context: Any) -> str | Literal[False]:
    """Write UTC datetimes as plain timezone-aware DateTime so revisions don't import models."""
    if type_ == "type" and isinstance(obj, UTCDateTime):
        return "sa.DateTime(timezone=True)"
    return False


def compare_type(
    ctx: Any, inspected: Any, metadata: Any, inspected_type: Any, metadata_type: Any
) -> bool | None:
    if isinstance(metadata_type, UTCDateTime):
        return not isinstance(inspected_type, DateTime)
    return None


def run_migrations() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = make_engine(config.get_main_option("sqlalchemy.url") or "", poolclass=pool.NullPool)
    with engine.connect() as conn:
        _run(conn)
    engine.dispose()


def _run(connection: Any) -> None:
    """SQLite runs with foreign keys off while migrating: a batch ALTER rebuilds a table (copy,
    drop, rename), and dropping the old table with keys on would cascade-delete every row that
    references it (events, usage, the ledger). The keys are checked once at the end instead."""
    sqlite = connection.dialect.name == "sqlite"
    if sqlite:
        connection.exec_driver_sql("PRAGMA foreign_keys=OFF")
        connection.commit()  # end the autobegun block so the migration commits its own
    try:
        _migrate(connection)
        if sqlite:
            broken = connection.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
            if broken:
                raise RuntimeError(f"migration left rows with broken foreign keys: {broken[:5]}")
    finally:
        if sqlite:
            connection.exec_driver_sql("PRAGMA foreign_keys=ON")
            connection.commit()


def _migrate(connection: Any) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=True,
        render_item=render_item,
        compare_type=compare_type,
    )
    with context.begin_transaction():
        context.run_migrations()


run_migrations()
