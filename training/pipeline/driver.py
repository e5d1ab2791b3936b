"""The driver of a pipeline (or hybrid) run: one stage actor per stage replica, pinned to its
stage's cluster like data-parallel workers, stepped in segments, summed into a report.

With a checkpoint root, every stage saves its own shard (`training.pipeline.checkpoint`) and a
run resumes from the newest step all stages have. No restarts inside a run: a lost stage
fails it, and the control plane re-places the stage and launches the run again, which
resumes from the stage checkpoints (`controller.loop.restage`)."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from training.pipeline.schedule import bubble_fraction
from training.pipeline.spec import PipelineReport, PipelineSpec, StageResult
from training.pipeline.split import Placement
from training.placement import cluster_resource
from training.ray_actors import check_capacity, ensure_ray, kill, wait_all
from training.results import WanBytes
from training.spec import TrainSpec


class StagePool:
    """Idle stage actors per cluster, kept between runs: starting one (a process importing
    torch) costs seconds, and any run can use any actor pinned to the right cluster."""

    def __init__(self) -> None:
        self._idle: dict[str, list[Any]] = {}

    def take(self, cluster: str) -> Any | None:
        found = self._idle.get(cluster)
        return found.pop() if found else None

    def give(self, cluster: str, actor: Any) -> None:
        self._idle.setdefault(cluster, []).append(actor)

    def close(self) -> None:
        for actors in self._idle.values():
            for a in actors:
                kill(a)
        self._idle.clear()


def summarize(
    spec: PipelineSpec, results: list[StageResult], cuts: tuple[int, ...]
) -> tuple[list[float], list[float], list[int], WanBytes, int, float]:
    """Per stage (slowest replica) compute, wait and params; link bytes, raw bytes, and the
    measured idle share (1 - compute / step time, averaged over stage replicas)."""
    stages = spec.placement.stages
    compute = [0.0] * stages
    wait = [0.0] * stages
    params = [0] * stages
    wan = WanBytes()
    raw = 0
    idle = []
    for r in results:
        compute[r.stage] = max(compute[r.stage], r.compute_s)
        wait[r.stage] = max(wait[r.stage], r.wait_s)
        params[r.stage] = r.params
        wan = wan + r.wan
        raw += r.raw_bytes
        if r.steps_s > 0:
            idle.append(max(0.0, 1.0 - r.compute_s / r.steps_s))
    measured = sum(idle) / len(idle) if idle else 0.0
    return compute, wait, params, wan, raw, measured


def run_pipeline(
    spec: PipelineSpec,
    on_segment: Callable[[int, float | None], None] | None = None,
    keep: list[Any] | None = None,
    pool: StagePool | None = None,
    on_results: Callable[[int, list[StageResult]], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> PipelineReport:
    """Train `spec` to the end; the report. ValueError for a bad spec. With `keep` (a list),
    the actors are left alive and appended to it in rank order (tests read their
    parameters); with a `pool`, actors come from it when it has them and go back to it after
    the run (closed, unless kept too); else they are killed. `on_results` gets every
    segment's stage results (cumulative counters: the controller meters them);
    `should_stop` is asked between segments (the controller's cancel and preemption)."""
    import ray

    from training.pipeline.checkpoint import prepare, with_run
    from training.pipeline.stage import StageWorker
    from training.tasks import check_entry

    check_entry(spec.train.task)
    spec.validate()
    if spec.placement.tensor > 1:  # before any actor starts: say which split cannot be
        from training.tasks import load_task
        from training.tensor_parallel import check_split

        check_split(load_task(spec.train.task).model(), spec.placement.tensor)
    found = prepare(
        spec.train.checkpoint,
        spec.placement.stages,
        spec.train.run_id,
        spec.train.epoch,
        spec.train.resume,
    )
    spec = replace(spec, train=with_run(spec.train, found))
    t = spec.train
    started, local = ensure_ray(t)
    ifname = t.gloo_ifname or os.environ.get("CPN_GLOO_IFNAME") or ("lo" if local else None)
    run_id = uuid.uuid4().hex[:8]
    p = spec.placement
    remote: Any = ray.remote(StageWorker)
    actors: list[Any] = []
    kept = False
    try:
        check_capacity(t)
        reused = []
        for rank in range(p.world):
            actor = pool.take(p.cluster_of(rank)) if pool is not None else None
            if actor is not None:
                reused.append(actor.reinit.remote(spec, rank, ifname))
            else:
                actor = remote.options(
                    name=f"cpn-{run_id}-s{p.stage_of(rank)}r{p.replica_of(rank)}"
                    f"t{p.tensor_of(rank)}",
                    num_cpus=0,
                    num_gpus=0,
                    resources={cluster_resource(p.cluster_of(rank)): 1.0},
                    max_restarts=0,
                ).remote(spec, rank, ifname)
            actors.append(actor)
        wait_all(reused)
        master, port = ray.get(actors[0].address.remote(), timeout=300)
        cuts: tuple[int, ...] = wait_all(
            [a.setup.remote(master, port, found.step) for a in actors]
        )[0]
        seg = t.eval_every or max(1, t.steps // 10)
        t0 = time.perf_counter()
        step = found.step or 0
        history: list[dict[str, float | None]] = []
        results: list[StageResult] = []
        loss: float | None = None
        while step < t.steps:
            step = min(step + seg, t.steps)
            results = wait_all([a.run.remote(step) for a in actors])
            loss = next((r.loss for r in results if r.loss is not None), None)
            history.append({"wall_s": time.perf_counter() - t0, "step": step, "loss": loss})
            if on_segment is not None:
                on_segment(step, loss)
            if on_results is not None:
                on_results(step, results)
            if should_stop is not None and should_stop():
                break
        evals = wait_all([a.evaluate.remote() for a in actors])
        results = wait_all([a.result.remote() for a in actors])  # the eval pass's bytes too
        wall = time.perf_counter() - t0
        final = next((e for e in evals if e is not None), None)
        compute, wait, params, wan, raw, measured = summarize(spec, results, cuts)
        if keep is not None:
            keep.extend(actors)
        else:
            ray.get([a.close.remote() for a in actors], timeout=60)
        # a process that split layers keeps DTensor's caches of the meshes it ran, which a
        # later run's equal-looking mesh would hit (torch keys them by shape, not by group)
        if pool is not None and p.tensor == 1:
            for rank, a in enumerate(actors):
                pool.give(p.cluster_of(rank), a)
        kept = keep is not None or (pool is not None and p.tensor == 1)
    except ray.exceptions.RayError as exc:
        _check_fences(t, p.stages)  # a later attempt took over: StaleRun, not a failure
        raise RuntimeError(f"pipeline training failed: {exc}") from exc
    finally:
        if not kept:
            for a in actors:
                kill(a)
        if started and not kept:
            ray.shutdown()
    return PipelineReport(
        task=t.task,
        parallel=parallel_name(p),
        stage_clusters=list(p.stage_clusters),
        replicas=p.replicas,
        pipelines=[list(row) for row in p.pipelines],
        tensor=p.tensor,
        cuts=list(cuts),
        micro_batches=spec.micro_batches,
        schedule=str(spec.schedule),
        activations=str(spec.activations),
        steps=step,
        final_loss=float(loss) if loss is not None else float("nan"),
        final_accuracy=final[1] if final is not None else float("nan"),
        final_eval_loss=final[0] if final is not None else float("nan"),
        wall_s=wall,
        stage_compute_s=compute,
        stage_wait_s=wait,
        stage_params=params,
        activation_bytes=wan,
        compression_ratio=raw / wan.total if wan.total else 1.0,
        bubble_fraction=bubble_fraction(p.stages, spec.micro_batches),
        measured_bubble=measured,
        wan_emulated=t.emulated,
        history=history,
        resumed_from_step=found.step,
    )


def parallel_name(p: Placement) -> str:
    """What a placement runs, by name: tensor (one stage, its layers split), pipeline,
    hybrid (stages with data-parallel replicas), 3d (stages with split layers)."""
    if p.tensor > 1:
        return "tensor" if p.stages == 1 else "3d"
    return "hybrid" if p.replicas > 1 else "pipeline"


def _check_fences(t: TrainSpec, stages: int) -> None:
    """StaleRun when a later attempt of this run has started on a stage's store."""
    if not t.checkpoint:
        return
    from training.checkpoint import open_store
    from training.pipeline.checkpoint import stage_uri

    for s in range(stages):
        open_store(stage_uri(t.checkpoint, s)).check_fence(t.epoch)
