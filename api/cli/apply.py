"""`cpn apply -f FILE` and `cpn get KIND [NAME]`: admin state kept in YAML files, over REST.

The documents and the plan are pure (`api.cli.manifests`); this module reads the server's
state, prints the plan and sends its requests. `cpn get KIND -o yaml` writes documents that
`cpn apply -f` takes back unchanged, so `cpn get all -o yaml > infra.yaml` is a backup and a
starting point for GitOps.
"""

from __future__ import annotations

import json
import sys
from datetime import datetime
from typing import TYPE_CHECKING, Any

import typer

from api.cli import contexts
from api.cli.errors import BAD_INPUT, FAILED, fail

if TYPE_CHECKING:
    from api.cli.manifests import Current, Doc, Parsed, Step
    from api.client import Client

UrlOpt = typer.Option(None, "--url", envvar="CPN_URL", help="Control plane URL.")
TokenOpt = typer.Option(None, "--token", envvar="CPN_TOKEN", help="Admin API key.")

STYLE = {"created": "green", "changed": "yellow", "unchanged": "dim"}
KIND_NAMES = {
    "cluster": ("Cluster",),
    "link": ("Link",),
    "tenant": ("Tenant",),
    "gpuprice": ("GpuPrice",),
    "egressprice": ("EgressPrice",),
    "price": ("GpuPrice", "EgressPrice"),
    "all": ("Cluster", "Link", "Tenant", "GpuPrice", "EgressPrice"),
}


def read_current(
    client: Client, kinds: set[str], times: set[datetime | None] | None = None
) -> Current:
    """What the server holds of these kinds (clusters always: documents refer to them), and
    the prices in force now and at each of `times`."""
    from api.cli.manifests import Current
    from api.schemas import ClusterOut, LinkOut, PricingOut, TenantOut

    clusters = {c["name"]: ClusterOut.model_validate(c) for c in client.clusters()}
    links: dict[tuple[str, str], LinkOut] = {}
    if "Link" in kinds:
        for raw in client.links("declared"):
            link = LinkOut.model_validate(raw)
            links[(link.src, link.dst)] = link
    tenants = {}
    if "Tenant" in kinds:
        tenants = {t["name"]: TenantOut.model_validate(t) for t in client.paginate("/v1/tenants")}
    pricing = {}
    if kinds & {"GpuPrice", "EgressPrice"}:
        for at in {None} | (times or set()):
            body = client.get("/v1/pricing", at=None if at is None else at.isoformat())
            pricing[at] = PricingOut.model_validate(body)
    return Current(clusters, links, tenants, pricing)


def _read_text(cmd: str, filename: str) -> str:
    if filename == "-":
        return sys.stdin.read()
    try:
        with open(filename, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise fail(cmd, filename, f"cannot read it ({reason}); check the path") from None


def _api_line(exc: Any) -> str:
    from api.cli.jobs import api_error_line

    return api_error_line(exc)


def _times(docs: list[Parsed]) -> set[datetime | None]:
    return {getattr(p.doc, "effective_from", None) for p in docs}


def _print_step(console: Any, step: Step, dry_run: bool) -> None:
    from rich.markup import escape

    style = STYLE[step.action.value]
    console.print(f"[{style}]{escape(step.line(dry_run))}[/]")


def apply(
    filename: str = typer.Option(
        ..., "-f", "--filename", help="YAML file of documents (---between them); - is stdin."
    ),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Print what would change (old → new); write nothing."
    ),
    url: str | None = UrlOpt,
    token: str | None = TokenOpt,
) -> None:
    """Make clusters, links, tenants (quota, budget) and prices what FILE says.

    Kinds: Cluster, Link, Tenant, GpuPrice, EgressPrice; their fields are the admin API's.

    Idempotent: the same file again changes nothing and says `unchanged`.

    Fields a document leaves out keep their values; nothing is deleted."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from api.cli.manifests import ManifestError, parse, plan
    from api.client import ApiError

    text = _read_text("apply", filename)
    try:
        docs = parse(text)
    except ManifestError as exc:
        raise fail("apply", f"{filename}: {exc.where}", exc.message) from None
    if not docs:
        raise fail("apply", filename, "no documents in it; each needs a kind (Cluster, ...)")
    kinds = {p.doc.kind for p in docs}
    console = Console(highlight=False, soft_wrap=True)
    with contexts.client(url, token) as client:
        try:
            current = read_current(client, kinds, _times(docs))
        except ApiError as exc:
            raise fail("apply", None, _api_line(exc), FAILED) from None
        try:
            steps = plan(docs, current)
        except ManifestError as exc:
            raise fail("apply", f"{filename}: {exc.where}", exc.message, BAD_INPUT) from None
        if dry_run:
            for step in steps:
                _print_step(console, step, dry_run=True)
            _summary(console, steps, dry_run=True)
            return
        progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            console=Console(stderr=True),
            transient=True,
            disable=not console.is_terminal,  # a bar only for a person watching
        )
        with progress:
            bar = progress.add_task("applying", total=len(steps))
            for step in steps:
                for request in step.requests:
                    try:
                        client.request(
                            request.method, request.path, json=request.body, headers=request.headers
                        )
                    except ApiError as exc:
                        progress.stop()
                        where = f"{filename}: {step.parsed.where}"
                        raise fail("apply", where, _api_line(exc), FAILED) from None
                _print_step(progress.console if console.is_terminal else console, step, False)
                progress.advance(bar)
    _summary(console, steps, dry_run=False)


def _summary(console: Any, steps: list[Step], dry_run: bool) -> None:
    counts = {a: sum(1 for s in steps if s.action.value == a) for a in STYLE}
    line = ", ".join(f"{n} {a}" for a, n in counts.items())
    if dry_run:
        line = f"dry run: {line}; nothing was written"
    console.print(line)


def _kinds(kind: str) -> tuple[str, ...]:
    key = kind.lower().replace("-", "").replace("_", "")
    found = KIND_NAMES.get(key) or KIND_NAMES.get(key.removesuffix("s"))
    if found is None:
        raise fail(
            "get",
            "KIND",
            f"{kind!r} is not a kind; use cluster, link, tenant, gpuprice, egressprice, price "
            "or all",
        )
    return found


def get(
    kind: str = typer.Argument(
        ..., help="cluster | link | tenant | gpuprice | egressprice | price | all (plural too)."
    ),
    name: str | None = typer.Argument(
        None, help="Only this one: a name, src->dst for links, cluster/model/class for GPU prices."
    ),
    output: str = typer.Option(
        "table", "-o", "--output", help="table | yaml | json; yaml is what `cpn apply -f` reads."
    ),
    url: str | None = UrlOpt,
    token: str | None = TokenOpt,
) -> None:
    """Show admin state as documents; `-o yaml` round-trips through `cpn apply -f`."""
    from api.cli.manifests import documents_of, dump_yaml
    from api.client import ApiError

    kinds = _kinds(kind)
    if output not in ("table", "wide", "yaml", "json"):
        raise fail("get", "--output", f"{output!r}: use table, wide, yaml or json")
    try:
        with contexts.client(url, token) as client:
            current = read_current(client, set(kinds))
    except ApiError as exc:
        raise fail("get", None, _api_line(exc), FAILED) from None
    docs = [d for d in documents_of(current, kinds) if name is None or d.ident() == name]
    if name is not None and not docs:
        raise fail("get", "NAME", f"no {' or '.join(kinds)} named {name!r}", FAILED)
    if output == "yaml":
        sys.stdout.write(dump_yaml(docs))
    elif output == "json":
        print(json.dumps([d.document() for d in docs], indent=2))
    else:
        _tables(docs, wide=output == "wide")


def _tables(docs: list[Doc], wide: bool = False) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from api.cli.manifests import show

    console = Console(width=100_000, soft_wrap=True) if wide else Console()
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for d in docs:
        body = d.document()
        by_kind.setdefault(str(body.pop("kind")), []).append(body)
    for kind, rows in by_kind.items():
        columns = list(dict.fromkeys(k for r in rows for k in r if k != "apiVersion"))
        table = Table(title=f"{kind} ({len(rows)})")
        for col in columns:
            table.add_column(col)
        for r in rows:
            table.add_row(*(escape(show(r.get(c, "-"))) for c in columns))
        console.print(table)
    if not by_kind:
        console.print("nothing")


def register(app: typer.Typer) -> None:
    """Attach `apply` and `get`."""
    app.command("apply")(apply)
    app.command("get")(get)
