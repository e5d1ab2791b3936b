"""`cpn train`: run a data-parallel job across (emulated) clusters without the control plane."""

from __future__ import annotations

import json
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import typer

from api.cli.errors import FAILED, fail
from grammar import (
    COMPRESSION_HELP,
    SYNC_HELP,
    Compression,
    Sync,
    SyncKind,
    parse_compression,
    parse_sync,
)
from grammar.parallel import Parallelism, parse_parallelism, parse_stages

if TYPE_CHECKING:
    from training.spec import TrainSpec

_V = TypeVar("_V", Compression, Sync)

AUTO_COMPRESSION_SYNCS = (SyncKind.AUTO, SyncKind.EVERY_STEP, SyncKind.LOCAL_SGD)
"""The sync kinds under which the runtime picks `--compression auto` (`training.auto`)."""

_FLAGS = {
    "outer_lr": "--outer-lr",
    "outer_momentum": "--outer-momentum",
    "slowdown": "--slowdown",
    "data": "--data",
    "regions": "--links (regions)",
}
"""Spec fields whose errors name the flag that sets them."""


class Artefact(StrEnum):
    best = "best"
    last = "last"


def _concrete(value: _V) -> _V:
    """Sync and compression as given: `auto` is the runtime's policy (`training.auto`)."""
    return value


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
        ("final loss (training)", f"{report.final_loss:.4f}"),
        ("final eval loss", f"{report.final_eval_loss:.4f}"),
        ("final accuracy", f"{report.final_accuracy * 100:.2f} %"),
        ("wall time", f"{report.wall_s:.2f} s"),
        ("compute time", f"{report.compute_s:.2f} s"),
        ("communication time", f"{report.comm_s:.2f} s"),
        ("WAN bytes (total)", f"{report.wan_bytes_total:,}"),
        ("  of which start-up", f"{report.wan_setup_bytes:,}"),
        ("compression ratio", f"{report.compression_ratio:.1f}x"),
        ("WAN", "emulated" if report.wan_emulated else "not shaped"),
        ("restarts", str(report.restarts)),
    ]
    rows += [(f"  {src}->{dst}", f"{n:,} B") for (src, dst), n in sorted(report.wan_bytes.items())]
    art = report.artefact
    if art:
        which = "best evaluation's" if art["which"] == "best" else "last step's"
        rows.append(("model", f"the {which}, step {art['step']}: {art['where']}"))
    if report.warning:
        rows.append(("warning", report.warning))
    if report.resumed_from_step is not None:
        rows.append(("resumed from step", str(report.resumed_from_step)))
    if report.steps_by_cluster and len(set(report.steps_by_cluster.values())) > 1:
        by = ", ".join(f"{c}:{n}" for c, n in report.steps_by_cluster.items())
        rows.append(("local steps by cluster", by))
    if report.data == "local":
        rows.append(("data", "local (only model updates crossed the WAN)"))
    for d in getattr(report, "auto_decisions", []):  # --sync/--compression auto
        rows.append((f"auto at step {d.step}", f"{d.sync} {d.compression}: {d.why}"))
    # what the sync mode says of itself: streaming's late fragments and drain, gossip's degree
    rows += [(f"sync: {k}", f"{v:.4g}") for k, v in sorted(report.sync_stats.items())]
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
        help='JSON/YAML link table file: {"links":[{"a":..,"b":..,"mbps":..,"rtt_ms":..}]}, '
        'optionally with "regions":{CLUSTER:REGION,...} (async-ps: a server per region).',
    ),
    compression: str = typer.Option(
        "none",
        "--compression",
        help=f"Compression between clusters; {COMPRESSION_HELP} (auto: picked at run time "
        "from measured compute and bandwidth; with --sync auto, every-step or local-sgd:H).",
    ),
    sync: str = typer.Option(
        "every-step",
        "--sync",
        help=f"Sync between clusters; {SYNC_HELP} (auto: picked at run time, re-decided "
        "when the measured bandwidth changes).",
    ),
    steps: int = typer.Option(100, "--steps", min=1, help="Training steps."),
    batch_size: int | None = typer.Option(None, "--batch-size", min=1, help="Global batch size."),
    lr: float | None = typer.Option(None, "--lr", min=0.0, help="Inner learning rate."),
    seed: int = typer.Option(0, "--seed"),
    outer_lr: float | None = typer.Option(
        None,
        "--outer-lr",
        help="Outer learning rate of local-sgd/streaming (> 0); default 0.7, 1.0 on local data.",
    ),
    outer_momentum: float | None = typer.Option(
        None,
        "--outer-momentum",
        help="Outer momentum of local-sgd/streaming, in [0, 1) (0: none); default 0.9, 0 on "
        "local data.",
    ),
    nesterov: bool = typer.Option(
        True, "--nesterov/--no-nesterov", help="Nesterov's outer momentum (with a momentum > 0)."
    ),
    checkpoint_dir: str | None = typer.Option(
        None, "--checkpoint-dir", help="Directory, file:// or s3:// URI for checkpoints."
    ),
    checkpoint_every: int = typer.Option(
        0, "--checkpoint-every", min=0, help="Checkpoint every N steps (0: only at the end)."
    ),
    artefact: Artefact = typer.Option(
        Artefact.best,
        "--artefact",
        help="The model the run leaves in --checkpoint-dir: best (its best evaluation's, "
        "best.pt) or last (the final step's checkpoint).",
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
    parallel: str = typer.Option(
        "data",
        "--parallel",
        help="data (whole model per worker), pipeline (one stage per worker, activations "
        "cross clusters, --compression applies to them), hybrid (pipeline across clusters, "
        "data parallel inside each stage's cluster) or tensor (one cluster whose workers "
        "split each layer, --tensor of them a group).",
    ),
    tensor: int | None = typer.Option(
        None,
        "--tensor",
        min=1,
        help="Workers each layer is split over inside a cluster (tensor parallelism): with "
        "--parallel tensor, default all of the cluster's; with pipeline or hybrid, each stage "
        "replica's (3D). The task's model must say how it splits (builtin:char-gpt).",
    ),
    stages: str | None = typer.Option(
        None,
        "--stages",
        help="Pipeline stages: N (balanced by compute) or @C1,C2,... (pieces where stages "
        "start); default one per worker (pipeline) or per cluster (hybrid).",
    ),
    whole_pipelines: bool = typer.Option(
        False,
        "--whole-pipelines",
        help="hybrid: each replica a whole pipeline of --stages consecutive workers, on "
        "clusters of its own (3D across datacenters); the stages' gradients all-reduce across "
        "the WAN instead of inside each stage's cluster.",
    ),
    micro_batches: int = typer.Option(
        4, "--micro-batches", min=1, help="Micro-batches per step (pipeline, hybrid)."
    ),
    schedule: str = typer.Option("1f1b", "--schedule", help="Pipeline schedule: gpipe or 1f1b."),
    data_mode: str = typer.Option(
        "shared",
        "--data",
        help="shared (every cluster draws from all samples) or local (each cluster reads only "
        "its own; the built-in tasks split non-IID by label).",
    ),
    slowdown: str | None = typer.Option(
        None,
        "--slowdown",
        help="CLUSTER:FACTOR,... make that cluster's compute FACTOR times slower (emulated "
        "heterogeneous clusters), e.g. c:4.",
    ),
) -> None:
    """Train one data-parallel job over clusters of Ray workers, compressed across the WAN."""
    from training.spec import TrainSpec, parse_clusters, parse_slowdown
    from training.tasks import check_entry
    from training.wan import load_links_file, load_regions_file

    try:
        cluster_map = parse_clusters(clusters)
    except ValueError as exc:
        raise fail("train", "--clusters", str(exc)) from None
    try:
        sync_value = _concrete(parse_sync(sync))
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--sync") from None
    try:
        compression_value = _concrete(parse_compression(compression))
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--compression") from None
    if compression_value.is_auto and sync_value.kind not in AUTO_COMPRESSION_SYNCS:
        raise fail(
            "train",
            "--compression",
            f"auto needs --sync auto, every-step or local-sgd:H (not {sync_value}); or give a "
            "concrete value such as int8",
        )
    try:
        check_entry(task)
    except ValueError as exc:
        raise fail("train", "--task", str(exc)) from None
    if rtt_ms is not None and link_mbps is None:
        raise fail("train", "--rtt-ms", "needs --link-mbps: give both, or neither")
    if plot is not None and plot.suffix.lower() != ".png":
        raise fail("train", "--plot", "write a .png path")
    try:
        slow = parse_slowdown(slowdown) if slowdown else {}
    except ValueError as exc:
        raise fail("train", "--slowdown", str(exc)) from None
    link_list = []
    regions: dict[str, str] = {}  # none declared: one region (a flat parameter server)
    if links is not None:
        try:
            link_list = load_links_file(links)
            regions = load_regions_file(links)
        except ValueError as exc:
            raise fail("train", "--links", str(exc)) from None
    spec = TrainSpec(
        task=task,
        clusters=cluster_map,
        compression=compression_value,
        sync=sync_value,
        steps=steps,
        seed=seed,
        batch_size=batch_size,
        lr=lr,
        links=link_list,
        link_mbps=link_mbps,
        rtt_ms=(rtt_ms or 0.0) if link_mbps is not None else None,
        checkpoint=checkpoint_dir,
        checkpoint_every=checkpoint_every,
        artefact=artefact.value,
        resume=resume,
        eval_every=eval_every,
        ray_address=ray_address,
        gloo_ifname=gloo_ifname,
        gpus_per_worker=gpus_per_worker,
        outer_lr=outer_lr,
        outer_momentum=outer_momentum,
        outer_nesterov=nesterov,
        slowdown=slow,
        data=data_mode,
        regions=regions,
    )
    try:
        spec.validate()
    except ValueError as exc:
        field, _, msg = str(exc).partition(": ")
        raise fail("train", _FLAGS.get(field, field), msg or str(exc)) from None
    try:
        mode = parse_parallelism(parallel)
    except ValueError as exc:
        raise fail("train", "--parallel", str(exc)) from None
    if mode is Parallelism.AUTO:
        raise fail("train", "--parallel", "auto needs the planner: give data, pipeline or hybrid")
    if whole_pipelines and mode is not Parallelism.HYBRID:
        raise fail("train", "--whole-pipelines", "needs --parallel hybrid")
    if mode is not Parallelism.DATA:
        _train_pipeline(
            spec, mode, stages, micro_batches, schedule, as_json, tensor, whole_pipelines
        )
        return
    if stages is not None:
        raise fail("train", "--stages", "needs --parallel pipeline or hybrid")
    if tensor is not None and tensor > 1:
        raise fail("train", "--tensor", "needs --parallel tensor, pipeline or hybrid")

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
        raise fail("train", field, msg or str(exc)) from None
    except RuntimeError as exc:
        raise fail("train", "run", str(exc), FAILED) from None
    if plot is not None:
        plot_accuracy(report.history, plot, f"{task} {compression_value} {sync_value}")
    if as_json:
        data = report.to_dict()
        print(json.dumps(data))
    else:
        from rich.console import Console

        Console().print(_report_table(report))


def _placement(
    clusters: dict[str, int],
    split: Any,
    mode: Parallelism,
    tensor: int | None,
    whole: bool = False,
) -> Any:
    """Where the stage replicas go: `tensor` workers of one cluster a replica (all of the one
    cluster's under --parallel tensor); `whole` pipeline replicas on clusters of their own.
    ValueError `field: message`."""
    from training.pipeline import Placement, place

    if mode is Parallelism.TENSOR:
        if len(clusters) != 1 or (split is not None and split.count > 1):
            raise ValueError(
                "tensor: --parallel tensor runs the whole model in one cluster; give one "
                "cluster (or --parallel pipeline --tensor N for stages of split layers)"
            )
        ((name, workers),) = clusters.items()
        width = tensor or workers
        if workers % width:
            raise ValueError(f"tensor: {workers} worker(s) do not make groups of {width}")
        return Placement((name,), workers // width, width)
    width = tensor or 1
    if any(n % width for n in clusters.values()):
        raise ValueError(
            f"tensor: every cluster's workers must make groups of {width}: {dict(clusters)}"
        )
    groups = {c: n // width for c, n in clusters.items()}
    laid = place(groups, split.count if split else None, mode is Parallelism.HYBRID, whole)
    return Placement(laid.stage_clusters, laid.replicas, width, laid.pipelines)


def _train_pipeline(
    spec: TrainSpec,
    mode: Parallelism,
    stages: str | None,
    micro: int,
    schedule: str,
    as_json: bool,
    tensor: int | None = None,
    whole: bool = False,
) -> None:
    """`--parallel pipeline|hybrid|tensor`: stage actors on the clusters, activations over the
    WAN, each stage replica's layers split over `tensor` workers of its cluster (`whole`:
    hybrid replicas are whole pipelines on clusters of their own)."""
    from training.pipeline import PipelineSpec, Schedule, run_pipeline

    unsupported = [
        ("--sync", spec.sync.kind is not SyncKind.EVERY_STEP),
        ("--compression", spec.compression.is_auto),
        ("--gpus-per-worker", spec.gpus_per_worker > 0),
        ("--slowdown", bool(spec.slowdown)),
        ("--data", spec.data != "shared"),
    ]
    for flag, given in unsupported:
        if given:
            raise fail("train", flag, f"not supported yet with --parallel {mode}; leave it out")

    try:
        split = parse_stages(stages) if stages is not None else None
    except ValueError as exc:
        raise fail("train", "--stages", str(exc)) from None
    try:
        order = Schedule(schedule.strip().lower())
    except ValueError:
        raise fail("train", "--schedule", f"{schedule!r}: use gpipe or 1f1b") from None
    try:
        placement = _placement(spec.clusters, split, mode, tensor, whole)
        pspec = PipelineSpec(
            spec,
            placement,
            micro_batches=micro,
            schedule=order,
            cuts=split.cuts if split else None,
            activations=spec.compression,
        )
        pspec.validate()
    except ValueError as exc:
        field, _, msg = str(exc).partition(": ")
        flag = {"stages": "--stages", "compression": "--compression", "tensor": "--tensor"}.get(
            field, field
        )
        raise fail("train", flag, msg or str(exc)) from None
    try:
        report = run_pipeline(pspec)
    except ValueError as exc:
        field, _, msg = str(exc).partition(": ")
        flags = {"stages": "--stages", "checkpoint": "--checkpoint-dir", "tensor": "--tensor"}
        raise fail("train", flags.get(field, field), msg or str(exc)) from None
    except RuntimeError as exc:
        raise fail("train", "run", str(exc), FAILED) from None
    if as_json:
        print(json.dumps(report.to_dict()))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"cpn train --parallel {report.parallel}: {report.task}", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    rows = [
        ("stages", " -> ".join(report.stage_clusters)),
        ("replicas per stage", str(report.replicas)),
        *((f"  pipeline {r}", " -> ".join(row)) for r, row in enumerate(report.pipelines)),
        ("layers split over", f"{report.tensor} worker(s) a replica"),
        ("cut points", ",".join(map(str, report.cuts)) or "-"),
        ("schedule", f"{report.schedule}, {report.micro_batches} micro-batches"),
        ("activations", report.activations),
        ("steps", str(report.steps)),
        ("final loss (training)", f"{report.final_loss:.4f}"),
        ("final eval loss", f"{report.final_eval_loss:.4f}"),
        ("final accuracy", f"{report.final_accuracy * 100:.2f} %"),
        ("wall time", f"{report.wall_s:.2f} s"),
        ("bubble (schedule)", f"{report.bubble_fraction * 100:.1f} %"),
        ("idle (measured)", f"{report.measured_bubble * 100:.1f} %"),
        ("activation bytes (WAN)", f"{report.activation_bytes.total:,}"),
        ("compression ratio", f"{report.compression_ratio:.1f}x"),
        ("WAN", "emulated" if report.wan_emulated else "not shaped"),
    ]
    if report.resumed_from_step is not None:
        rows.append(("resumed from step", str(report.resumed_from_step)))
    rows += [
        (f"  stage {i} ({c})", f"compute {s:.2f} s, waited {w:.2f} s, {n:,} params")
        for i, (c, s, w, n) in enumerate(
            zip(
                report.stage_clusters,
                report.stage_compute_s,
                report.stage_wait_s,
                report.stage_params,
                strict=True,
            )
        )
    ]
    rows += [(f"  {a}->{b}", f"{n:,} B") for (a, b), n in sorted(report.activation_bytes.items())]
    for k, v in rows:
        table.add_row(k, v)
    Console().print(table)


def register(app: typer.Typer) -> None:
    """Attach this module's commands to the root CLI app."""
    app.command("train")(train)
