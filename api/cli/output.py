"""How a read command prints: `-o table|wide|json|yaml`, kubectl's flag (`--json` is `-o json`;
`wide` is the table with more columns, every value whole: nothing cut to fit the terminal)."""

from __future__ import annotations

import json
import sys
from typing import Any

import typer

from api.cli.errors import fail

FORMATS = ("table", "wide", "json", "yaml")

OutputOpt = typer.Option(
    None, "-o", "--output", help="table | wide | json | yaml (default: table).", show_default=False
)


def chosen(cmd: str, output: str | None, as_json: bool) -> str:
    """The format asked for: `-o` when given (one line naming the flag when it is none of
    FORMATS, or contradicts `--json`), else json with `--json`, else table."""
    if output is None:
        return "json" if as_json else "table"
    fmt = output.strip().lower()
    if fmt not in FORMATS:
        raise fail(cmd, "--output", f"{output!r}: use table, wide, json or yaml")
    if as_json and fmt != "json":
        raise fail(cmd, "--json", f"and -o {fmt} ask for two formats; give one")
    return fmt


def emit(data: Any, fmt: str) -> None:
    """Print `data` (JSON's types) as JSON or YAML."""
    if fmt == "yaml":
        import yaml

        yaml.safe_dump(data, sys.stdout, sort_keys=False, allow_unicode=True)
    else:
        print(json.dumps(data, indent=2))


def print_tables(tables: Any, fmt: str) -> None:
    """Print rich tables (one or a list); `wide` on a console too wide to cut or wrap them."""
    from rich.console import Console

    console = Console(width=100_000, soft_wrap=True) if fmt == "wide" else Console()
    for table in tables if isinstance(tables, list) else [tables]:
        console.print(table)
