"""`cpn providers`: resource providers over REST. Admins create them, give them clusters and
record payouts; a provider (its own key) reads its clusters, offers and statement as `me`,
and posts offers with `cpn apply` or `POST /v1/pricing/gpu|egress` on its own clusters."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

import typer
from rich.console import Console
from rich.table import Table

from api.cli.admin import JsonOpt, TokenOpt, UrlOpt
from api.cli.jobs import pricing_tables
from api.cli.output import OutputOpt, chosen, emit, print_tables

ProviderArg = typer.Argument(
    "me", help="The provider's name or id; `me` with a provider's own key.", show_default=True
)


def _path(provider: str, tail: str = "") -> str:
    return f"/v1/providers/{quote(provider, safe='')}{tail}"


def providers_table(items: list[dict[str, Any]], wide: bool = False) -> Table:
    table = Table(title="Providers")
    for col in ("name", "fee", "clusters", "owed", *(("id", "since") if wide else ())):
        table.add_column(col)
    for p in items:
        row = [p["name"], f"{p['fee_rate']:.2%}", ", ".join(p["clusters"]) or "-", p["balance"]]
        if wide:
            row += [p["id"], p["created_at"][:19]]
        table.add_row(*row)
    return table


def statement_tables(st: dict[str, Any]) -> list[Table]:
    since = (st["start"] or "the start")[:19]
    lines = Table(title=f"Statement of {st['provider']}: {since} to {st['end'][:19]}")
    for col in ("cluster", "kind", "tenants paid", "platform fee", "net"):
        lines.add_column(col, justify="right" if col != "cluster" else "left")
    for x in st["lines"]:
        lines.add_row(x["cluster"], x["kind"], x["gross"], x["fee"], x["net"])
    lines.add_row("total", "", st["gross"], st["fee"], st["net"], style="bold")
    totals = Table(title="Payouts and balance")
    for col in ("paid in the period", "owed now"):
        totals.add_column(col, justify="right")
    totals.add_row(st["paid"], st["balance"])
    return [lines, totals]


def clusters_table(items: list[dict[str, Any]], wide: bool = False) -> Table:
    table = Table(title="Clusters and their use")
    for col in ("name", "region", "state", "GPUs", "in use", "utilisation"):
        table.add_column(col)
    for c in items:
        gpus = ", ".join(f"{g['allocatable']}x {g['model']}" for g in c["gpus"]) or "-"
        used = sum(g["in_use"] for g in c["gpus"])
        util = "-" if c["utilization"] is None else f"{c['utilization']:.0%}"
        table.add_row(c["name"], c["region"], c["state"], gpus, str(used), util)
    return table


def _get(cmd: str, url: str | None, token: str | None, path: str, **params: Any) -> Any:
    from api.cli.jobs import connected

    with connected(cmd, url, token) as client:
        return client.get(path, **params)


def _print(fmt: str, data: Any, tables: Any) -> None:
    if fmt in ("table", "wide"):
        print_tables(tables, fmt)
    else:
        emit(data, fmt)


def list_providers(
    url: str | None = UrlOpt,
    token: str | None = TokenOpt,
    as_json: bool = JsonOpt,
    output: str | None = OutputOpt,
) -> None:
    """Every provider, its fee, its clusters and what it is owed (admins)."""
    from api.cli.jobs import connected

    fmt = chosen("providers list", output, as_json)
    with connected("providers list", url, token) as client:
        items = list(client.paginate("/v1/providers"))
    _print(fmt, items, providers_table(items, fmt == "wide"))


def create(
    name: str = typer.Argument(..., help="DNS-label style name."),
    fee: float = typer.Option(0.1, "--fee", min=0.0, max=0.999999, help="Platform's share."),
    cluster: list[str] = typer.Option([], "--cluster", help="A cluster it owns (repeat)."),
    url: str | None = UrlOpt,
    token: str | None = TokenOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Create a provider (admins); mint its key with `cpn admin keys create --role provider
    --scope NAME`."""
    from api.cli.jobs import connected

    with connected("providers create", url, token) as client:
        made = client.post("/v1/providers", {"name": name, "fee_rate": fee, "clusters": cluster})
    if as_json:
        print(json.dumps(made, indent=2))
    else:
        Console().print(providers_table([made]))


def assign(
    provider: str = typer.Argument(..., help="The provider's name or id."),
    cluster: list[str] = typer.Argument(None, help="Every cluster it owns from now on."),
    url: str | None = UrlOpt,
    token: str | None = TokenOpt,
) -> None:
    """Set the clusters a provider owns (admins): those not listed go back to the operator."""
    from api.cli.jobs import connected

    with connected("providers assign", url, token) as client:
        made = client.request("PUT", _path(provider, "/clusters"), json={"clusters": cluster or []})
    Console().print(providers_table([made]))


def statement(
    provider: str = ProviderArg,
    start: str | None = typer.Option(None, "--start", help="From (ISO 8601 with an offset)."),
    end: str | None = typer.Option(None, "--end", help="Until, excluded (default: now)."),
    url: str | None = UrlOpt,
    token: str | None = TokenOpt,
    as_json: bool = JsonOpt,
    output: str | None = OutputOpt,
) -> None:
    """What a provider earned in a period, by cluster and kind: what tenants paid, the
    platform's fee, net; its payouts and what it is owed now."""
    fmt = chosen("providers statement", output, as_json)
    st = _get(
        "providers statement", url, token, _path(provider, "/statement"), start=start, end=end
    )
    _print(fmt, st, statement_tables(st))


def clusters(
    provider: str = ProviderArg,
    url: str | None = UrlOpt,
    token: str | None = TokenOpt,
    as_json: bool = JsonOpt,
    output: str | None = OutputOpt,
) -> None:
    """A provider's clusters, their GPUs and how many are in use now."""
    fmt = chosen("providers clusters", output, as_json)
    items = _get("providers clusters", url, token, _path(provider, "/clusters"))
    _print(fmt, items, clusters_table(items))


def offers(
    provider: str = ProviderArg,
    url: str | None = UrlOpt,
    token: str | None = TokenOpt,
    as_json: bool = JsonOpt,
    output: str | None = OutputOpt,
) -> None:
    """The prices of a provider's clusters in effect now and later: its offers."""
    fmt = chosen("providers offers", output, as_json)
    data = _get("providers offers", url, token, _path(provider, "/offers"))
    _print(fmt, data, pricing_tables(data))


def pay(
    provider: str = typer.Argument(..., help="The provider's name or id."),
    amount: str = typer.Argument(..., help="Dollars, an exact decimal: 125.50."),
    reference: str = typer.Option("", "--reference", help="The transfer's reference."),
    url: str | None = UrlOpt,
    token: str | None = TokenOpt,
) -> None:
    """Record a payout to a provider (admins); never more than it is owed."""
    from api.cli.jobs import connected

    with connected("providers pay", url, token) as client:
        made = client.post(_path(provider, "/payouts"), {"amount": amount, "reference": reference})
    Console().print(f"paid {made['amount']} to {provider} (payout {made['id']})", highlight=False)


def register(app: typer.Typer) -> None:
    group = typer.Typer(
        help="Resource providers: their clusters, offers, statements and payouts.",
        no_args_is_help=True,
    )
    group.command("list")(list_providers)
    group.command("create")(create)
    group.command("assign")(assign)
    group.command("statement")(statement)
    group.command("clusters")(clusters)
    group.command("offers")(offers)
    group.command("pay")(pay)
    app.add_typer(group, name="providers")
