"""`cpn clusters`, `cpn links`, `cpn gpus`: admin tables, read over REST like any client."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from api.cli.errors import FAILED, fail

UrlOpt = typer.Option(None, "--url", envvar="CPN_URL", help="Control plane URL.")
TokenOpt = typer.Option(None, "--token", envvar="CPN_TOKEN", help="Admin API key.")
JsonOpt = typer.Option(False, "--json", help="Print JSON instead of a table.")


def clusters_table(clusters: list[dict[str, Any]]) -> Table:
    table = Table(title="Clusters")
    for col in ("name", "region", "state", "cordoned", "GPUs", "last heartbeat"):
        table.add_column(col)
    for c in clusters:
        gpus = ", ".join(f"{g['count']}x {g['model']}" for g in c["gpus"]) or "-"
        seen = (c["last_heartbeat_at"] or "-")[11:19] or "-"
        style = {"READY": "green", "SUSPECT": "yellow", "DOWN": "red"}.get(c["state"], "")
        table.add_row(
            c["name"],
            c["region"],
            f"[{style}]{c['state']}[/]" if style else c["state"],
            "yes" if c["cordoned"] else "no",
            gpus,
            seen,
        )
    return table


def links_table(links: list[dict[str, Any]]) -> Table:
    table = Table(title="Links (measured over declared)")
    for col in ("from", "to", "source", "Gbit/s", "RTT ms", "loss", "$/GB", "at"):
        table.add_column(col)
    for k in links:
        table.add_row(
            k["src"],
            k["dst"],
            k["source"],
            f"{k['bandwidth_gbps']:.3f}",
            f"{k['rtt_ms']:.1f}",
            f"{k['loss']:.2f}",
            f"{k['egress_price_per_gb']:.3f}",
            k["measured_at"][11:19],
        )
    return table


def gpus_table(gpus: list[dict[str, Any]]) -> Table:
    table = Table(title="GPUs")
    for col in ("cluster", "state", "model", "GiB", "count", "allocatable", "in use"):
        table.add_column(col)
    for g in gpus:
        table.add_row(
            g["cluster"],
            g["cluster_state"],
            g["model"],
            f"{g['memory_gib']:g}",
            str(g["count"]),
            str(g["allocatable"]),
            str(g["in_use"]),
        )
    return table


def _show(
    cmd: str,
    url: str | None,
    token: str | None,
    as_json: bool,
    fetch: Callable[[Any], list[dict[str, Any]]],
    render: Callable[[list[dict[str, Any]]], Table],
) -> None:
    from api.client import ApiError, Client

    try:
        with Client(url, token) as client:
            rows = fetch(client)
    except ApiError as exc:
        raise fail(cmd, None, str(exc), FAILED) from None
    if as_json:
        print(json.dumps(rows, indent=2))
    else:
        Console().print(render(rows))


def clusters(
    url: str | None = UrlOpt, token: str | None = TokenOpt, as_json: bool = JsonOpt
) -> None:
    """List clusters with their state and GPUs."""
    _show("clusters", url, token, as_json, lambda c: c.clusters(), clusters_table)


def links(
    url: str | None = UrlOpt,
    token: str | None = TokenOpt,
    as_json: bool = JsonOpt,
    view: str = typer.Option("effective", help="effective | declared | measured | all"),
) -> None:
    """List WAN links between clusters."""
    if view not in ("effective", "declared", "measured", "all"):
        raise fail("links", "--view", "use effective, declared, measured or all")
    _show("links", url, token, as_json, lambda c: c.links(view), links_table)


def gpus(url: str | None = UrlOpt, token: str | None = TokenOpt, as_json: bool = JsonOpt) -> None:
    """List GPU inventory per cluster."""
    _show("gpus", url, token, as_json, lambda c: c.gpus(), gpus_table)


def register(app: typer.Typer) -> None:
    """Attach the admin tables."""
    app.command("clusters")(clusters)
    app.command("links")(links)
    app.command("gpus")(gpus)
