"""Schema migrations: apply them (`cpn db upgrade`) and check they are current (serve, /readyz)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(url), revision)


def head_revision() -> str | None:
    return ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def pending_reason(engine: Engine) -> str | None:
    """None when the database is at the newest revision, else why not (and the fix)."""
    head = head_revision()
    try:
        current = current_revision(engine)
    except Exception as exc:  # unreachable database: say so rather than crash
        cause = getattr(exc, "orig", None) or exc
        first = str(cause).strip().splitlines()
        return (
            f"database unreachable ({first[0] if first else type(cause).__name__}): is it "
            "running, and is CPN_DATABASE_URL right?"
        )
    if current == head:
        return None
    state = "not initialised" if current is None else f"at revision {current}"
    return f"database is {state}, newest is {head}: run `cpn db upgrade`"
