"""`cpn train` commands (being built)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Attach this module's commands to the root CLI app."""
