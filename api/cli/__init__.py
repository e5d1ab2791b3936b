"""The `cpn` command line.

Each subcommand lives in its own module and registers itself on the Typer app; heavy imports
(torch, ray, sqlalchemy) happen inside the commands so `cpn --help` stays fast.
"""

from __future__ import annotations

import sys
from typing import Any

import typer

from api.cli import (
    admin,
    agent,
    apply,
    contexts,
    db,
    demo,
    jobs,
    plan,
    providers,
    serve,
    testbed,
    train,
)
from api.cli.errors import usage_error

app = typer.Typer(
    name="cpn",
    help="cpn: a cross-datacenter compute-network orchestrator.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
)


def _print_version(given: bool) -> None:
    if given:
        from api.version import VERSION

        print(VERSION)
        raise typer.Exit()


@app.callback()
def _root(
    _version: bool = typer.Option(
        False,
        "--version",
        callback=_print_version,
        is_eager=True,
        help="Print the installed cpn version and exit.",
    ),
) -> None:
    """cpn: a cross-datacenter compute-network orchestrator."""


@app.command("version")
def version() -> None:
    """Print the installed cpn version."""
    from api.version import VERSION

    print(VERSION)


for module in (
    serve,
    db,
    agent,
    admin,
    providers,
    apply,
    jobs,
    plan,
    train,
    demo,
    testbed,
    contexts,
):
    module.register(app)


_EXTRAS = {
    **dict.fromkeys(
        ("fastapi", "fastapi_offline", "starlette", "uvicorn", "sqlalchemy", "alembic",
         "psycopg", "pydantic_settings", "prometheus_client", "kubernetes", "pynvml"),
        "server",
    ),
    **dict.fromkeys(("torch", "ray", "numpy", "mnist1d", "sklearn", "matplotlib"), "train"),
}  # fmt: skip
"""Which extra brings each module the light client (`pip install cpn`) lacks."""


def _command_path(command: Any, args: list[str]) -> list[str]:
    """The (sub)command names at the start of `args`: `db upgrade` of `db upgrade --x`."""
    path = []
    for arg in args:
        commands = getattr(command, "commands", None) or {}  # a group's subcommands
        if arg not in commands:
            break
        path.append(arg)
        command = commands[arg]
    return path


def main(argv: list[str] | None = None) -> None:
    """Run the CLI; usage errors become one line on stderr and exit code 2."""
    command = typer.main.get_command(app)
    args = sys.argv[1:] if argv is None else argv
    if not args:  # a bare `cpn`: its help, as `cpn --help` prints it
        args = ["--help"]
    try:
        rv = command.main(args=args, prog_name="cpn", standalone_mode=False)
    except typer.Abort:
        print("cpn: aborted", file=sys.stderr)
        raise SystemExit(130) from None
    except typer.Exit as exc:
        raise SystemExit(exc.exit_code) from None
    except typer.TyperException as exc:
        # Usage errors (unknown option, bad value): one line naming the command and the fix.
        ctx = getattr(exc, "ctx", None)
        print(usage_error(ctx.command_path if ctx is not None else "cpn", exc), file=sys.stderr)
        raise SystemExit(getattr(exc, "exit_code", 2)) from None
    except ModuleNotFoundError as exc:
        extra = _EXTRAS.get((exc.name or "").split(".")[0])
        if extra is None:
            raise
        where = " ".join(_command_path(command, args))
        print(
            f"cpn {where}: error: this command needs cpn's {extra} extra (no module "
            f"{exc.name!r} here): pip install 'cpn[{extra}]'",
            file=sys.stderr,
        )
        raise SystemExit(1) from None
    if isinstance(rv, int):
        raise SystemExit(rv)
