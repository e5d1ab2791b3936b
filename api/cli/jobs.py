"""`cpn quote|submit|jobs|job|cancel|usage|pricing`: the tenant's commands, over REST.

Job specs are YAML or JSON files with the API's schema; they are validated here first so a
typo costs one line and no request.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from api.cli import contexts
from api.cli.errors import FAILED, fail
from api.cli.output import OutputOpt, chosen, print_tables
from api.cli.output import emit as emit_as

if TYPE_CHECKING:
    from rich.table import Table

    from api.client import Client
    from wire.spec import JobSpec

UrlOpt = typer.Option(None, "--url", envvar="CPN_URL", help="Control plane URL.")
TokenOpt = typer.Option(None, "--token", envvar="CPN_TOKEN", help="API key (tenant or admin).")
JsonOpt = typer.Option(False, "--json", help="Print JSON instead of tables.")
STATES = ("PENDING", "SCHEDULED", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED", "RESCHEDULING")
TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")
EXIT_CODES = {"SUCCEEDED": 0, "FAILED": 3, "CANCELLED": 4}  # --wait; 1 is an API error
STYLE = {"SUCCEEDED": "green", "RUNNING": "cyan", "FAILED": "red", "CANCELLED": "yellow"}


def load_spec(cmd: str, path: Path) -> JobSpec:
    """The job spec in a YAML or JSON file, or one line naming what is wrong (exit 2)."""
    import yaml
    from pydantic import ValidationError

    from wire.spec import JobSpec

    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise fail(cmd, str(path), f"cannot read it ({reason}); check the path") from None
    try:
        data = json.loads(text) if path.suffix.lower() == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        kind = "JSON" if path.suffix.lower() == ".json" else "YAML"
        where = " ".join(str(exc).split())
        raise fail(cmd, str(path), f"not valid {kind}: {where}") from None
    if not isinstance(data, dict):
        raise fail(
            cmd,
            str(path),
            "a job spec is a mapping of fields (name, task, gpus, steps, ...), "
            f"not {type(data).__name__}",
        )
    try:
        return JobSpec.model_validate(data)
    except ValidationError as exc:
        raise fail(cmd, str(path), validation_summary(exc.errors())) from None


def validation_summary(errors: list[Any]) -> str:
    """Every bad field with what would fix it, on one line."""
    parts = []
    for e in errors:
        field = ".".join(str(p) for p in e["loc"]) or "spec"
        message = str(e["msg"]).removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            message = "unknown field: check its spelling or remove it"
        elif e["type"] == "missing":
            message = "required: add it"
        parts.append(f"{field}: {message}")
    return "; ".join(parts)


def api_error_line(exc: Any) -> str:
    """`<status> <detail>` and the fields the server named."""
    if not exc.status:
        return str(exc.detail)
    fields = [f"{e.get('field')}: {e.get('message')}" for e in exc.errors if isinstance(e, dict)]
    return f"{exc.status} {exc.detail}" + (f" ({'; '.join(fields)})" if fields else "")


@contextmanager
def connected(cmd: str, url: str | None, token: str | None) -> Iterator[Client]:
    """A client whose API errors end the command with one line and exit code 1."""
    from api.client import ApiError

    try:
        with contexts.client(url, token) as client:
            yield client
    except ApiError as exc:
        raise fail(cmd, None, api_error_line(exc), FAILED) from None


def emit(data: Any) -> None:
    print(json.dumps(data, indent=2))


def _table(title: str, columns: tuple[str, ...]) -> Table:
    from rich.table import Table

    table = Table(title=title)
    for col in columns:
        table.add_column(col)
    return table


def _state(state: str) -> str:
    style = STYLE.get(state)
    return f"[{style}]{state}[/]" if style else state


def _duration(seconds: float) -> str:
    seconds = float(seconds)
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.1f}min"
    return f"{seconds / 3600:.1f}h"


def _placement(items: list[dict[str, Any]] | None) -> str:
    return ", ".join(f"{p['cluster']}:{p['gpus']}" for p in items or []) or "-"


def _gpus(job: dict[str, Any]) -> str:
    lo, hi = job["gpus_min"], job["gpus_max"]
    return str(lo) if lo == hi else f"{lo}-{hi}"


def quote_table(quote: dict[str, Any]) -> Table:
    table = _table(
        f"Quote {quote['id']} (expires {quote['expires_at'][:19]}Z)",
        ("option", "placement (cluster:GPUs)", "compression", "sync", "time", "WAN GB", "price"),
    )
    for o in quote["options"]:
        price = o["price"]
        table.add_row(
            str(o["objective"]),
            _placement(o["placement"]),
            str(o["compression"]),
            str(o["sync"]),
            _duration(o["estimate"]["total_time_s"]),
            f"{o['estimate']['wan_gb']:.2f}",
            f"{price['total']:.2f} {price.get('currency', '')}".strip() + _parties(price),
        )
    return table


def _parties(price: dict[str, Any]) -> str:
    """Each provider's part of a quoted price, when a provider's offer is in it."""
    parties = price.get("parties") or []
    if not any(p.get("provider") for p in parties):
        return ""
    return (
        " ("
        + ", ".join(f"{p.get('provider') or 'operator'} {p['amount']:.2f}" for p in parties)
        + ")"
    )


def jobs_table(jobs: list[dict[str, Any]], with_tenant: bool, wide: bool = False) -> Table:
    cols = ("id", "name", "state", "GPUs", "class", "created", "reason")
    more = ("priority", "attempts", "placement", "started", "finished") if wide else ()
    table = _table("Jobs", ("tenant", *cols, *more) if with_tenant or wide else (*cols, *more))
    for j in jobs:
        row = [
            j["id"],
            j["name"],
            _state(j["state"]),
            _gpus(j),
            j["qos_class"],
            j["created_at"][:19],
            j["reason"],
        ]
        if wide:
            row += [
                f"{j['priority']}" + (", preemptible" if j["preemptible"] else ""),
                str(j["attempts"]),
                _placement((j.get("placement") or {}).get("placement")),
                (j["started_at"] or "-")[:19],
                (j["finished_at"] or "-")[:19],
            ]
        table.add_row(*([j["tenant_id"], *row] if with_tenant or wide else row))
    return table


def _parallel(par: dict[str, Any] | None) -> str:
    """The plan's parallelism: the mode, a pipeline's stages in order, and a split's width."""
    if not par:
        return "-"
    stages = par.get("stages") or []
    if not stages:
        return str(par.get("mode", "data"))
    width = stages[0].get("replicas", 1)
    split = par.get("tensor", 1)
    rows = list(zip(*(s.get("replica_clusters") or () for s in stages), strict=False))
    laid = (
        " | ".join(" -> ".join(row) for row in rows) + f" ({len(rows)} whole pipelines)"
        if rows and len(rows[0]) == len(stages)
        else " -> ".join(s["cluster"] for s in stages) + (f" (x{width} each)" if width > 1 else "")
    )
    return (
        f"{par['mode']}: "
        + laid
        + (f", layers split over {split} GPUs" if split > 1 else "")
        + f", {par.get('micro_batches')} micro-batches"
    )


def job_table(job: dict[str, Any]) -> Table:
    from rich.table import Table

    table = Table(title=f"Job {job['id']}", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value")
    spec = job["spec"]
    held = (job.get("held_price") or {}).get("price", {})
    rows = [
        ("name", job["name"]),
        ("tenant", job["tenant_id"]),
        ("state", _state(job["state"])),
        ("reason", job["reason"]),
        ("task", str(spec.get("task"))),
        ("steps", str(spec.get("steps"))),
        ("GPUs", _gpus(job)),
        (
            "QoS",
            f"{job['qos_class']}, priority {job['priority']}"
            + (", preemptible" if job["preemptible"] else ""),
        ),
        ("placement", _placement((job.get("placement") or {}).get("placement"))),
        ("parallelism", _parallel((job.get("placement") or {}).get("parallel"))),
        ("held price", f"{held['total']:.2f} (quote {job['quote_id']})" if held else "-"),
        ("attempts", str(job["attempts"])),
        ("created", job["created_at"][:19]),
        ("started", (job["started_at"] or "-")[:19]),
        ("finished", (job["finished_at"] or "-")[:19]),
        ("expected end", (job.get("ends_at") or "-")[:19] if not job["finished_at"] else "-"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table


def events_table(events: list[dict[str, Any]]) -> Table:
    table = _table("Recent events", ("id", "at", "kind", "change", "message"))
    for e in events:
        change = f"{e['from_state'] or '-'} -> {e['to_state']}" if e["to_state"] else ""
        message = e["message"] or (json.dumps(e["data"]) if e["data"] else "")
        table.add_row(str(e["id"]), e["at"][11:19], e["kind"], change, message)
    return table


def _show(fmt: str, data: Any, render: Callable[[Any, bool], Table | list[Table]]) -> None:
    """JSON or YAML as they are; a table (`wide`: more columns, nothing cut) as `render` draws."""
    if fmt not in ("table", "wide"):
        emit_as(data, fmt)
        return
    print_tables(render(data, fmt == "wide"), fmt)


def quote(
    file: Path = typer.Argument(..., help="Job spec, YAML or JSON.", show_default=False),
    url: str | None = UrlOpt,
    token: str | None = TokenOpt,
    as_json: bool = JsonOpt,
    output: str | None = OutputOpt,
) -> None:
    """Price a job: the fastest, the cheapest and (with a deadline) the cheapest in time."""
    fmt = chosen("quote", output, as_json)
    spec = load_spec("quote", file)
    with connected("quote", url, token) as client:
        answer = client.quote(spec).model_dump(mode="json")
    _show(fmt, answer, lambda q, _wide: quote_table(q))
    if fmt in ("table", "wide"):
        print(f"hold this price: cpn submit {file} --quote {answer['id']} --option <option>")


def submit(
    file: Path = typer.Argument(..., help="Job spec, YAML or JSON.", show_default=False),
    wait: bool = typer.Option(False, "--wait", help="Follow the job until it ends."),
    idempotency_key: str | None = typer.Option(
        None, "--idempotency-key", help="Retrying with the same key returns the same job."
    ),
    quote_id: str | None = typer.Option(None, "--quote", help="Hold this quote's price."),
    option: str | None = typer.Option(
        None, "--option", help="Which option of the quote: time, cost, cost-within-deadline."
    ),
    url: str | None = UrlOpt,
    token: str | None = TokenOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Submit a job (exit codes with --wait: 0 SUCCEEDED, 3 FAILED, 4 CANCELLED, 1 API error)."""
    import uuid

    if idempotency_key is not None and not 0 < len(idempotency_key) <= 128:
        raise fail("submit", "--idempotency-key", "give 1 to 128 characters")
    if option is not None and option not in ("time", "cost", "cost-within-deadline"):
        raise fail("submit", "--option", "use time, cost or cost-within-deadline")
    spec = load_spec("submit", file)
    if quote_id is not None or option is not None:
        spec = spec.model_copy(
            update={
                k: v for k, v in (("quote_id", quote_id), ("quote_option", option)) if v is not None
            }
        )
    key = idempotency_key or f"cpn-{uuid.uuid4()}"
    with connected("submit", url, token) as client:
        job = client.submit(spec, key).model_dump(mode="json")
        if not as_json:
            print(
                f"job {job['id']} {job['state']}: {job['reason']} (idempotency key {key})",
                flush=True,
            )
        if wait:
            job = follow(client, job)
    if as_json:
        emit(job)
    if wait:
        code = EXIT_CODES.get(job["state"], 1)
        if code:
            print(f"cpn submit: job {job['id']} {job['state']}: {job['reason']}", file=sys.stderr)
        raise typer.Exit(code)


def follow(client: Client, job: dict[str, Any]) -> dict[str, Any]:
    """Show a progress bar driven by the job's event stream; return the job once it ended."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    steps = int(job["spec"].get("steps") or 0) or None
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
    )
    with progress:
        bar = progress.add_task(f"{job['name']} {job['state']}", total=steps)
        state = job["state"]
        for event in client.events(job["id"]):
            data = event.get("data") or {}
            if event["kind"] == "state" and event.get("to_state"):
                state = event["to_state"]
                progress.console.print(f"{event['at'][11:19]} {state}: {event['message']}")
            if isinstance(data.get("steps"), int) and data["steps"] > 0:
                progress.update(bar, total=data["steps"])
            if isinstance(data.get("step"), int):
                progress.update(bar, completed=data["step"])
            loss = data.get("loss")
            detail = f" loss {loss:.4f}" if isinstance(loss, (int, float)) else ""
            progress.update(bar, description=f"{job['name']} {state}{detail}")
            if state == "SUCCEEDED":
                progress.update(bar, completed=progress.tasks[0].total or 0)
    return client.job(job["id"]).model_dump(mode="json")


def jobs(
    state: str | None = typer.Option(None, "--state", help="Only jobs in this state."),
    limit: int = typer.Option(50, "--limit", min=1, max=100_000, help="At most this many."),
    url: str | None = UrlOpt,
    token: str | None = TokenOpt,
    as_json: bool = JsonOpt,
    output: str | None = OutputOpt,
) -> None:
    """List your jobs, newest first (admins: everyone's)."""
    fmt = chosen("jobs", output, as_json)
    if state is not None and state.upper() not in STATES:
        raise fail("jobs", "--state", f"use one of {', '.join(STATES)}")
    with connected("jobs", url, token) as client:
        rows = [
            j.model_dump(mode="json")
            for j in client.jobs(state.upper() if state else None, limit=limit)
        ]
    tenants = {j["tenant_id"] for j in rows}
    _show(fmt, rows, lambda r, wide: jobs_table(r, with_tenant=len(tenants) > 1, wide=wide))


def job(
    job_id: str = typer.Argument(
        ..., help="Job id, or its start as tables print it.", show_default=False
    ),
    events: int = typer.Option(10, "--events", min=0, max=500, help="Recent events to show."),
    follow_job: bool = typer.Option(
        False,
        "--follow",
        "-f",
        help="Then follow it until it ends (exit codes as submit --wait: 0, 3, 4).",
    ),
    url: str | None = UrlOpt,
    token: str | None = TokenOpt,
    as_json: bool = JsonOpt,
    output: str | None = OutputOpt,
) -> None:
    """Show one job and its most recent events; with -f, follow it to its end."""
    fmt = chosen("job", output, as_json)
    with connected("job", url, token) as client:
        detail = client.job(job_id).model_dump(mode="json")
        if follow_job:
            detail = follow(client, detail)
        full = detail["id"]  # a short id resolved once
        recent: list[Any] = []
        if events:
            total = client.get(f"/v1/jobs/{full}/events", limit=1)["total"]
            recent = client.get(
                f"/v1/jobs/{full}/events", limit=events, offset=max(0, total - events)
            )["items"]
    _show(
        fmt,
        {"job": detail, "events": recent},
        lambda d, _wide: (
            [job_table(d["job"]), events_table(d["events"])] if d["events"] else job_table(d["job"])
        ),
    )
    if follow_job:
        code = EXIT_CODES.get(detail["state"], 1)
        if code:
            print(f"cpn job: job {full} {detail['state']}: {detail['reason']}", file=sys.stderr)
        raise typer.Exit(code)


def cancel(
    job_id: str = typer.Argument(
        ..., help="Job id, or its start as tables print it.", show_default=False
    ),
    url: str | None = UrlOpt,
    token: str | None = TokenOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Cancel a job that has not ended; its GPUs are released at once."""
    with connected("cancel", url, token) as client:
        done = client.cancel(job_id).model_dump(mode="json")
    if as_json:
        emit(done)
    else:
        print(f"job {done['id']} {done['state']}: {done['reason']}")


def usage(
    tenant: str | None = typer.Option(
        None, "--tenant", help="Tenant id or name (required for admin keys; tenants: your own)."
    ),
    url: str | None = UrlOpt,
    token: str | None = TokenOpt,
    as_json: bool = JsonOpt,
    output: str | None = OutputOpt,
) -> None:
    """Metered GPU time and WAN traffic, and the ledger's total."""
    fmt = chosen("usage", output, as_json)
    with connected("usage", url, token) as client:
        try:
            tenant_id = tenant or client.tenant_id()
        except LookupError as exc:
            raise fail("usage", "--tenant", f"{exc} (cpn usage --tenant ID)") from None
        metered = client.usage(tenant_id)
        ledger = client.ledger(tenant_id)
    data = {"usage": metered, "ledger": {"total": ledger["total"], "entries": ledger["items"]}}
    _show(fmt, data, lambda d, _wide: usage_tables(d))


def usage_tables(data: dict[str, Any]) -> list[Table]:
    metered, ledger = data["usage"], data["ledger"]
    rows = _table(
        f"Usage of tenant {metered.get('tenant_name') or metered['tenant_id']}: "
        f"{metered['gpu_seconds'] / 3600:.4f} GPU-hours, "
        f"{metered['wan_bytes'] / 1e9:.3f} WAN GB",
        ("kind", "cluster", "to", "GPU model", "class", "quantity"),
    )
    for r in metered["rows"]:
        rows.add_row(
            r["kind"],
            r["cluster"],
            r["dst_cluster"] or "",
            r["gpu_model"] or "",
            r["qos_class"] or "",
            f"{r['quantity']:g}",
        )
    charges = _table(
        f"Ledger: {len(ledger['entries'])} entries, total {ledger['total']}",
        ("job", "kind", "description", "quantity", "unit price", "amount"),
    )
    for e in ledger["entries"][-20:]:
        charges.add_row(
            e["job_id"], e["kind"], e["description"], e["quantity"], e["unit_price"], e["amount"]
        )
    return [rows, charges]


def pricing_tables(p: dict[str, Any]) -> list[Table]:
    """The catalogue as tables: GPU-hours, egress and reserved bandwidth, with who offers
    each price (`cpn pricing`, `cpn providers offers`)."""
    gpu = _table(
        "GPU prices per hour",
        ("cluster", "GPU model", "class", "price", "since", "offered by"),
    )
    for g in p["gpu"]:
        gpu.add_row(
            g["cluster"],
            g["gpu_model"],
            g["qos_class"],
            f"{g['price_per_gpu_hour']:.4f}",
            g["effective_from"][:19],
            g.get("provider") or "operator",
        )
    egress = _table("Egress prices per GB", ("from", "to", "price", "since", "offered by"))
    for e in p["egress"]:
        egress.add_row(
            e["src"],
            e["dst"],
            f"{e['price_per_gb']:.4f}",
            e["effective_from"][:19],
            e.get("provider") or "operator",
        )
    tables = [gpu, egress]
    if p.get("bandwidth"):
        bw = _table(
            "Reserved bandwidth per Gbit/s-hour", ("cluster", "price", "since", "offered by")
        )
        for b in p["bandwidth"]:
            bw.add_row(
                b["cluster"],
                f"{b['price_per_gbps_hour']:.4f}",
                b["effective_from"][:19],
                b.get("provider") or "operator",
            )
        tables.append(bw)
    return tables


def pricing(
    url: str | None = UrlOpt,
    token: str | None = TokenOpt,
    as_json: bool = JsonOpt,
    output: str | None = OutputOpt,
) -> None:
    """The prices that apply now: per GPU-hour by cluster, model and class; egress per GB."""
    fmt = chosen("pricing", output, as_json)
    with connected("pricing", url, token) as client:
        prices = client.pricing()

    _show(fmt, prices, lambda p, _wide: pricing_tables(p))


def logs(
    job_id: str = typer.Argument(
        ..., help="Job id, or its start as tables print it.", show_default=False
    ),
    follow: bool = typer.Option(
        False, "--follow", "-f", help="Keep printing lines as they come, until the job ends."
    ),
    source: str | None = typer.Option(
        None, "--worker", help="Only this worker's lines (CLUSTER/RANK, e.g. eu-west/0), or driver."
    ),
    tail: int | None = typer.Option(
        None, "--tail", min=0, max=20_000, help="Only the last N lines (before following)."
    ),
    url: str | None = UrlOpt,
    token: str | None = TokenOpt,
    as_json: bool = typer.Option(False, "--json", help="One JSON object a line."),
) -> None:
    """Print what a job's workers wrote to stdout and stderr, and what its run's driver said
    (`kubectl logs`: -f follows)."""
    with connected("logs", url, token) as client:
        full = client.job(job_id).id  # a short id resolved once
        path = f"/v1/jobs/{full}/logs"
        params = {"source": source}
        skip = 0
        if tail is not None:
            total = client.get(path, limit=1, **params)["total"]
            skip = max(0, total - tail)
        last = 0
        for line in _pages(client, path, skip, params):
            last = line["id"]
            _print_line(line, as_json)
        if follow:
            for streamed in client.logs(full, source=source, after=last):
                _print_line(streamed.model_dump(mode="json"), as_json)


def _pages(client: Client, path: str, skip: int, params: dict[str, Any]) -> Iterator[Any]:
    """The lines of a job's log from the `skip`-th on, page after page (by the last line's
    id, so lines written or trimmed meanwhile shift nothing)."""
    page = client.get(path, limit=500, offset=skip, **params)
    while page["items"]:
        yield from page["items"]
        page = client.get(path, limit=500, after=page["items"][-1]["id"], **params)


def _print_line(line: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(line), flush=True)
    else:
        print(f"{line['at'][11:19]} {line['source']} | {line['text']}", flush=True)


def register(app: typer.Typer) -> None:
    """Attach the tenant commands."""
    for name, command in (
        ("quote", quote),
        ("submit", submit),
        ("jobs", jobs),
        ("job", job),
        ("cancel", cancel),
        ("logs", logs),
        ("usage", usage),
        ("pricing", pricing),
    ):
        app.command(name)(command)
