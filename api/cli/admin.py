"""`cpn clusters`, `cpn links`, `cpn ports`, `cpn gpus`: admin tables, read over REST like
any client; `cpn cordon|uncordon|drain CLUSTER` (kubectl's verbs); `cpn admin keys
create|list|revoke`: API keys."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

import typer
from rich.console import Console
from rich.table import Table

from api.cli import contexts
from api.cli.errors import FAILED, fail
from api.cli.output import OutputOpt, chosen, emit, print_tables

UrlOpt = typer.Option(None, "--url", envvar="CPN_URL", help="Control plane URL.")
TokenOpt = typer.Option(None, "--token", envvar="CPN_TOKEN", help="Admin API key.")
JsonOpt = typer.Option(False, "--json", help="Print JSON instead of a table.")


def clusters_table(clusters: list[dict[str, Any]], wide: bool = False) -> Table:
    table = Table(title="Clusters")
    more = ("draining", "labels", "probe URL") if wide else ()
    for col in ("name", "region", "state", "cordoned", "GPUs", "last heartbeat", *more):
        table.add_column(col)
    for c in clusters:
        gpus = ", ".join(f"{g['count']}x {g['model']}" for g in c["gpus"]) or "-"
        seen = (c["last_heartbeat_at"] or "-")[11:19] or "-"
        style = {"READY": "green", "SUSPECT": "yellow", "DOWN": "red"}.get(c["state"], "")
        row = [
            c["name"],
            c["region"],
            f"[{style}]{c['state']}[/]" if style else c["state"],
            "yes" if c["cordoned"] else "no",
            gpus,
            seen,
        ]
        if wide:
            labels = ", ".join(f"{k}={v}" for k, v in sorted((c.get("labels") or {}).items()))
            row += ["yes" if c.get("draining") else "no", labels or "-", c.get("probe_url") or "-"]
        table.add_row(*row)
    return table


def links_table(links: list[dict[str, Any]], wide: bool = False) -> Table:
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


def ports_table(ports: list[dict[str, Any]], wide: bool = False) -> Table:
    table = Table(title="WAN ports (uplinks and downlinks)")
    for col in ("cluster", "way", "capacity Gbit/s", "measured", "reserved", "free", "jobs"):
        table.add_column(col)

    def gbps(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    for p in ports:
        shown = p["holders"] if wide else p["holders"][:3]
        jobs = ", ".join(
            f"{h['job_id'] if wide else h['job_id'][:8]} {h['reserved_gbps']:.3f}" for h in shown
        )
        more = len(p["holders"]) - len(shown)
        table.add_row(
            p["cluster"],
            p["direction"],
            gbps(p["capacity_gbps"]),
            gbps(p.get("measured_gbps")),
            gbps(p["reserved_gbps"]),
            gbps(p["free_gbps"]),
            (jobs + (f" +{more} more" if more > 0 else "")) or "-",
        )
    return table


def gpus_table(gpus: list[dict[str, Any]], wide: bool = False) -> Table:
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
    fmt: str,
    fetch: Callable[[Any], list[dict[str, Any]]],
    render: Callable[[list[dict[str, Any]], bool], Table],
) -> None:
    from api.client import ApiError

    try:
        with contexts.client(url, token) as client:
            rows = fetch(client)
    except ApiError as exc:
        raise fail(cmd, None, str(exc), FAILED) from None
    if fmt in ("table", "wide"):
        print_tables(render(rows, fmt == "wide"), fmt)
    else:
        emit(rows, fmt)


def clusters(
    url: str | None = UrlOpt,
    token: str | None = TokenOpt,
    as_json: bool = JsonOpt,
    output: str | None = OutputOpt,
) -> None:
    """List clusters with their state and GPUs."""
    fmt = chosen("clusters", output, as_json)
    _show("clusters", url, token, fmt, lambda c: c.clusters(), clusters_table)


def links(
    url: str | None = UrlOpt,
    token: str | None = TokenOpt,
    as_json: bool = JsonOpt,
    view: str = typer.Option("effective", help="effective | declared | measured | all"),
    output: str | None = OutputOpt,
) -> None:
    """List WAN links between clusters."""
    fmt = chosen("links", output, as_json)
    if view not in ("effective", "declared", "measured", "all"):
        raise fail("links", "--view", "use effective, declared, measured or all")
    _show("links", url, token, fmt, lambda c: c.links(view), links_table)


def ports(
    url: str | None = UrlOpt,
    token: str | None = TokenOpt,
    as_json: bool = JsonOpt,
    output: str | None = OutputOpt,
) -> None:
    """List each datacenter's uplink and downlink: capacity, reserved, free, which jobs."""
    fmt = chosen("ports", output, as_json)
    _show("ports", url, token, fmt, lambda c: c.ports(), ports_table)


def gpus(
    url: str | None = UrlOpt,
    token: str | None = TokenOpt,
    as_json: bool = JsonOpt,
    output: str | None = OutputOpt,
) -> None:
    """List GPU inventory per cluster."""
    fmt = chosen("gpus", output, as_json)
    _show("gpus", url, token, fmt, lambda c: c.gpus(), gpus_table)


_FLAG_VERBS = {
    "cordon": ("cordoned", "no new work is placed on it; what runs there goes on"),
    "uncordon": ("uncordoned", "new work may be placed on it again"),
    "drain": ("draining", "cordoned, and the controller moves what runs there elsewhere"),
}


def _flag(verb: str) -> Callable[..., None]:
    done, meaning = _FLAG_VERBS[verb]

    def command(
        name: str = typer.Argument(..., help="Cluster name.", show_default=False),
        url: str | None = UrlOpt,
        token: str | None = TokenOpt,
        as_json: bool = JsonOpt,
    ) -> None:
        from api.client import ApiError

        try:
            with contexts.client(url, token) as client:
                cluster = client.post(f"/v1/clusters/{quote(name, safe='')}/{verb}")
        except ApiError as exc:
            raise fail(verb, None, str(exc), FAILED) from None
        if as_json:
            print(json.dumps(cluster, indent=2))
        else:
            print(f"cluster {cluster['name']} {done} ({cluster['state']}): {meaning}")

    command.__doc__ = f"{verb.capitalize()} a cluster: {meaning} (admins)."
    return command


ROLES = ("admin", "tenant", "agent", "provider")


def keys_table(keys: list[dict[str, Any]], wide: bool = False) -> Table:
    table = Table(title="API keys")
    for col in ("id", "name", "prefix", "role", "scope", "created", "expires", "revoked"):
        # Ids are copied into `revoke`: wrapped whole, never cut short.
        table.add_column(col, overflow="fold" if col in ("id", "scope") else "ellipsis")
    for k in keys:
        revoked = k["revoked_at"]
        table.add_row(
            k["id"],
            k["name"] or "-",
            k["prefix"],
            k["role"],
            k["scope"] or "-",
            k["created_at"][:19],
            (k.get("expires_at") or "-")[:19],
            f"[red]{revoked[:19]}[/]" if revoked else "-",
        )
    return table


def keys_create(
    role: str = typer.Option(..., "--role", help="admin | tenant | agent | provider."),
    scope: str | None = typer.Option(
        None, "--scope", help="Tenant id or name (tenant keys), cluster name (agent keys)."
    ),
    name: str = typer.Option("", "--name", help="A label to recognise the key by."),
    expires_at: str | None = typer.Option(
        None, "--expires-at", help="ISO 8601 time with an offset; none: until revoked."
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print only the token."),
    url: str | None = UrlOpt,
    token: str | None = TokenOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Mint an API key. Its token is shown this once: cpn keeps only a hash."""
    from api.cli.jobs import connected

    if role not in ROLES:
        raise fail("admin keys create", "--role", f"{role!r}: use admin, tenant, agent or provider")
    with connected("admin keys create", url, token) as client:
        key = client.create_api_key(role, scope, name, expires_at)
    if quiet:
        print(key["token"])
    elif as_json:
        print(json.dumps(key, indent=2))
    else:
        console = Console()
        console.print(keys_table([key]))
        console.print(f"token: {key['token']}", highlight=False, soft_wrap=True)
        console.print("[yellow]shown once: store it now; cpn keeps only its hash[/]")


def keys_list(
    role: str | None = typer.Option(None, "--role", help="Only keys of this role."),
    url: str | None = UrlOpt,
    token: str | None = TokenOpt,
    as_json: bool = JsonOpt,
    output: str | None = OutputOpt,
) -> None:
    """List API keys (never their secrets), revoked ones with their revocation time."""
    fmt = chosen("admin keys list", output, as_json)
    if role is not None and role not in ROLES:
        raise fail("admin keys list", "--role", f"{role!r}: use admin, tenant, agent or provider")
    _show(
        "admin keys list",
        url,
        token,
        fmt,
        lambda c: list(c.paginate("/v1/api-keys", role=role)),
        keys_table,
    )


def key_id_of(keys: list[dict[str, Any]], ref: str) -> str:
    """The id of the one live key `ref` names: its id, the start of its id, its name or its
    token's prefix; LookupError saying why (none, or which several) otherwise."""
    live = [k for k in keys if not k["revoked_at"]]
    for matches in (
        [k for k in keys if k["id"] == ref],
        [k for k in live if k["id"].startswith(ref)],
        [k for k in live if k["name"] == ref],
        [k for k in live if k["prefix"] == ref],
    ):
        if len(matches) == 1:
            return str(matches[0]["id"])
        if len(matches) > 1:
            named = ", ".join(f"{k['id'][:8]} ({k['name'] or k['role']})" for k in matches[:5])
            raise LookupError(f"{ref!r} names {len(matches)} keys ({named}); give more of the id")
    raise LookupError(f"no live key with id, name or prefix {ref!r} (cpn admin keys list)")


def keys_revoke(
    key: str = typer.Argument(
        ..., help="The key's id, the start of it, its name or its prefix (cpn admin keys list)."
    ),
    url: str | None = UrlOpt,
    token: str | None = TokenOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Revoke a key at once; it stays listed with its revocation time."""
    from api.cli.jobs import connected

    with connected("admin keys revoke", url, token) as client:
        try:
            key_id = key_id_of(list(client.paginate("/v1/api-keys")), key)
        except LookupError as exc:
            raise fail("admin keys revoke", "KEY", str(exc)) from None
        revoked = client.request("DELETE", f"/v1/api-keys/{key_id}")
    if as_json:
        print(json.dumps(revoked, indent=2))
    else:
        Console().print(f"revoked {revoked['id']} ({revoked['role']}, prefix {revoked['prefix']})")


def register(app: typer.Typer) -> None:
    """Attach the admin tables and `cpn admin keys`."""
    app.command("clusters")(clusters)
    app.command("links")(links)
    app.command("gpus")(gpus)
    app.command("ports")(ports)
    for verb in _FLAG_VERBS:
        app.command(verb)(_flag(verb))
    keys = typer.Typer(help="Mint, list and revoke API keys.", no_args_is_help=True)
    keys.command("create")(keys_create)
    keys.command("list")(keys_list)
    keys.command("revoke")(keys_revoke)
    admin = typer.Typer(help="Administration: API keys.", no_args_is_help=True)
    admin.add_typer(keys, name="keys")
    app.add_typer(admin, name="admin")
