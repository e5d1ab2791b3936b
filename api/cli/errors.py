"""The one shape of an error from `cpn`: a single stderr line, then an exit code.

    cpn <cmd>: error: <field>: <message>

`field` names what is wrong (a flag, a file, a key path inside a file) so the user knows what
to fix; the message says how. Bad input exits 2; a refusal or failure at run time (the API
said no, the run broke) exits 1, and commands that document other codes pass them.
Typer's own usage errors (unknown option, value out of range) are printed the same way by
`api.cli.main` through `usage_error`.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from api.config import Settings

BAD_INPUT = 2
FAILED = 1


def error_line(cmd: str, field: str | None, message: str) -> str:
    """`cpn <cmd>: error: <field>: <message>` (no `<field>: ` part when there is no field)."""
    where = f"cpn {cmd}" if cmd else "cpn"
    return f"{where}: error: {field}: {message}" if field else f"{where}: error: {message}"


def fail(cmd: str, field: str | None, message: str, code: int = BAD_INPUT) -> typer.Exit:
    """Print the error line and return the exit to raise: `raise fail(...) from None`."""
    print(error_line(cmd, field, message), file=sys.stderr)
    return typer.Exit(code)


def settings(cmd: str) -> Settings:
    """The control plane's settings, or the one line naming each bad `CPN_*` variable."""
    from api.config import load_settings

    try:
        return load_settings()
    except ValueError as exc:
        raise fail(cmd, None, str(exc)) from None


@contextmanager
def reaching_database(cmd: str) -> Iterator[None]:
    """A database that cannot be reached is one line naming CPN_DATABASE_URL, not a traceback."""
    from sqlalchemy.exc import OperationalError

    try:
        yield
    except OperationalError as exc:
        cause = str(exc.orig if exc.orig is not None else exc).strip().splitlines()
        raise fail(
            cmd,
            "CPN_DATABASE_URL",
            f"cannot reach the database ({cause[0] if cause else 'no reason given'}); is it "
            "running, and is the URL right?",
            FAILED,
        ) from None


def usage_error(command_path: str, exc: typer.TyperException) -> str:
    """The error line of a usage error Typer raised while parsing `command_path` (`cpn x y`).

    A bad value names its flag as the field; other usage errors (unknown option, missing
    value) carry Typer's own sentence, which already names the flag."""
    cmd = command_path.removeprefix("cpn").strip()
    if type(exc) is typer.BadParameter:  # not its subclasses: those format their own text
        field = _param_field(exc)
        if field is not None:
            return error_line(cmd, field, exc.message)
    message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
    return error_line(cmd, None, message)


def _param_field(exc: typer.BadParameter) -> str | None:
    hint = exc.param_hint
    if isinstance(hint, str):
        return hint
    if hint:
        return " / ".join(hint)
    names = getattr(exc.param, "opts", None) or [getattr(exc.param, "name", None)]
    return " / ".join(names) if all(names) else None
