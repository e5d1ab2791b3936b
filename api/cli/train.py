"""`cpn train`: run a data-parallel job across (emulated) clusters without the control plane."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import typer


def _fail(field: str, message: str, code: int = 2) -> typer.Exit:
    print(f"cpn train: error: {field}: {message}", file=sys.stderr)
    return typer.Exit(code)


def _report_table(report: Any) -> Any:
    from rich.table import Table

    table = Table(title=f"cpn train: {report.task}", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    clusters = ",".join(f"{c}:{n}" for c, n in report.clusters.items())
    rows = [
        ("clusters", clusters),
        ("compression", report.compression),
        ("sync", report.sync),
        ("steps", str(report.steps)),
        ("final loss", f"{report.final_loss:.4f}"),
        ("final accuracy", f"{report.final_accuracy * 100:.2f} %"),
        ("wall time", f"{report.wall_s:.2f} s"),
        ("compute time", f"{report.compute_s:.2f} s"),
        ("communication time", f"{report.comm_s:.2f} s"),
        ("WAN bytes (total)", f"{report.wan_bytes_total:,}"),
        ("compression ratio", f"{report.compression_ratio:.1f}x"),
        ("WAN", "emulated" if report.wan_emulated else "not shaped"),
        ("restarts", str(report.restarts)),
    ]
    rows += [(f"  {link}", f"{n:,} B") for link, n in sorted(report.wan_bytes.items())]
    if report.resumed_from_step is not None:
        rows.append(("resumed from step", str(report.resumed_from_step)))
    for k, v in rows:
        table.add_row(k, v)
    return table


def plot_accuracy(history: list[dict[str, Any]], path: Path, title: str) -> None:
    """Accuracy against wall time, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [(h["wall_s"], h["accuracy"]) for h in history if h.get("accuracy") is not None]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker=".")
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("eval accuracy (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def train(
    task: str = typer.Option(
        "builtin:mnist1d-mlp",
        "--task",
        help="builtin:NAME (mnist1d-mlp, mnist1d-cnn, digits-cnn, "
        "char-transformer) or module:function returning a Task.",
    ),
    clusters: str = typer.Option("a:1,b:1", "--clusters", help="NAME:WORKERS,... e.g. a:2,b:2,c:2"),
    link_mbps: float | None = typer.Option(
        None, "--link-mbps", min=1e-6, help="Emulate every inter-cluster link at this bandwidth."
    ),
    rtt_ms: float | None = typer.Option(
        None, "--rtt-ms", min=0.0, help="Round-trip time of emulated links (with --link-mbps)."
    ),
    links: Path | None = typer.Option(
        None,
        "--links",
        help='JSON/YAML link table file: {"links":[{"a":..,"b":..,"mbps":..,"rtt_ms":..}]}',
    ),
    compression: str = typer.Option(
        "none",
        "--compression",
        help="none, fp16, bf16, int8, int8:minmax, topk:D, powersgd:R, sign",
    ),
    sync: str = typer.Option(
        "every-step", "--sync", help="every-step, local-sgd:H, stale:S or adaptive"
    ),
    steps: int = typer.Option(100, "--steps", min=1, help="Training steps."),
    batch_size: int | None = typer.Option(None, "--batch-size", min=1, help="Global batch size."),
    lr: float | None = typer.Option(None, "--lr", min=0.0, help="Inner learning rate."),
    seed: int = typer.Option(0, "--seed"),
    checkpoint_dir: str | None = typer.Option(
        None, "--checkpoint-dir", help="Directory or file:// URI for checkpoints."
    ),
    checkpoint_every: int = typer.Option(
        0, "--checkpoint-every", min=0, help="Checkpoint every N steps (0: only at the end)."
    ),
    resume: bool = typer.Option(False, "--resume", help="Resume from the newest checkpoint."),
    eval_every: int = typer.Option(0, "--eval-every", min=0, help="Evaluate every N steps."),
    ray_address: str | None = typer.Option(
        None,
        "--ray-address",
        envvar="CPN_RAY_ADDRESS",
        help="Join this Ray cluster instead of a local one.",
    ),
    gloo_ifname: str | None = typer.Option(
        None,
        "--gloo-ifname",
        envvar="CPN_GLOO_IFNAME",
        help="Network interface for gloo (default lo locally).",
    ),
    gpus_per_worker: float = typer.Option(0.0, "--gpus-per-worker", min=0.0),
    as_json: bool = typer.Option(
        False, "--json", help="Print the final report as one JSON object."
    ),
    plot: Path | None = typer.Option(None, "--plot", help="Save accuracy against wall time (PNG)."),
) -> None:
    """Train one data-parallel job over clusters of Ray workers, compressed across the WAN."""
    from training.spec import TrainSpec, parse_clusters, parse_sync
    from training.tasks import check_entry
    from training.wan import load_links_file

    try:
        cluster_map = parse_clusters(clusters)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--clusters") from None
    try:
        parse_sync(sync)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--sync") from None
    try:
        check_entry(task)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--task") from None
    if rtt_ms is not None and link_mbps is None:
        raise typer.BadParameter("--rtt-ms needs --link-mbps", param_hint="--rtt-ms")
    if plot is not None and plot.suffix.lower() != ".png":
        raise typer.BadParameter("write a .png path", param_hint="--plot")
    link_list = []
    if links is not None:
        try:
            link_list = load_links_file(links)
        except ValueError as exc:
            raise _fail("--links", str(exc)) from None
    from training.compression import make_compressor

    if parse_sync(sync).kind != "adaptive":
        try:
            make_compressor(compression)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--compression") from None
    spec = TrainSpec(
        task=task,
        clusters=cluster_map,
        compression=compression,
        sync=sync,
        steps=steps,
        seed=seed,
        batch_size=batch_size,
        lr=lr,
        links=link_list,
        link_mbps=link_mbps,
        rtt_ms=(rtt_ms or 0.0) if link_mbps is not None else None,
        checkpoint=checkpoint_dir,
        checkpoint_every=checkpoint_every,
        resume=resume,
        eval_every=eval_every,
        ray_address=ray_address,
        gloo_ifname=gloo_ifname,
        gpus_per_worker=gpus_per_worker,
    )
    try:
        spec.validate()
    except ValueError as exc:
        field, _, msg = str(exc).partition(": ")
        raise _fail(field, msg or str(exc)) from None

    import training

    try:
        if as_json:
            report = training.run(spec)
        else:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            with Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total}"),
                TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(),
                console=Console(stderr=True),
            ) as bar:
                tid = bar.add_task("train", total=steps, info="starting workers")

                def show(p: Any) -> None:
                    acc = f"acc {p.accuracy * 100:.1f}%" if p.accuracy is not None else ""
                    bar.update(
                        tid,
                        completed=p.step,
                        info=f"loss {p.loss:.3f} {acc} WAN {p.wan_bytes_total / 1e6:.1f} MB "
                        f"({p.compression})",
                    )

                report = training.run(spec, on_progress=show)
    except ValueError as exc:
        field, _, msg = str(exc).partition(": ")
        raise _fail(field, msg or str(exc)) from None
    except RuntimeError as exc:
        raise _fail("run", str(exc), code=1) from None
    if plot is not None:
        plot_accuracy(report.history, plot, f"{task} {compression} {sync}")
    if as_json:
        data = report.to_dict()
        print(json.dumps(data))
    else:
        from rich.console import Console

        Console().print(_report_table(report))


def register(app: typer.Typer) -> None:
    """Attach this module's commands to the root CLI app."""
    app.command("train")(train)
