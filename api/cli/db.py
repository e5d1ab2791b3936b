"""`cpn db upgrade`: apply the schema migrations."""

from __future__ import annotations

import typer

from api.cli.errors import reaching_database
from api.cli.errors import settings as cli_settings

db_app = typer.Typer(help="Database schema migrations.", no_args_is_help=True)


@db_app.command("upgrade")
def upgrade(
    revision: str = typer.Argument("head", help="Target revision (default: the newest)."),
) -> None:
    """Apply migrations to CPN_DATABASE_URL (SQLite file by default)."""
    from controller.store.migrate import upgrade as run_upgrade

    settings = cli_settings("db upgrade")
    with reaching_database("db upgrade"):
        run_upgrade(settings.database_url, revision)
    print(f"cpn db: {settings.database_url.split('@')[-1]} is at revision {revision}")


@db_app.command("current")
def current() -> None:
    """Print whether the database is at the newest revision."""
    from controller.store.db import make_engine
    from controller.store.migrate import pending_reason

    engine = make_engine(cli_settings("db current").database_url)
    reason = pending_reason(engine)
    engine.dispose()
    print(reason or "cpn db: up to date")
    if reason:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Attach `cpn db ...`."""
    app.add_typer(db_app, name="db")
