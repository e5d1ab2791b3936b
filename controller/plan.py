"""The plan: what the planner decided for a job, as one typed value.

One model serves every place a decision travels: each option of a quote, the option a
submission holds (`HeldPlan`), the placement the reconcile loop reserved GPUs for (stored on
the job), and what the launcher reads back (compression, sync, the predicted step). Its JSON
form is what the REST API shows and what the database stores; rows stored before this model
existed parse with defaults (a quote option named its shares `placement`; a job's plan had
no objective and no price).
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import suppress
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, computed_field, model_validator

import scheduler
from controller.jobspec import CompressionValue, JobSpec, SyncValue
from controller.tasks import builtin_work
from grammar.parallel import parse_stages
from scheduler.memory import Layer, ModelProfile, gpu_memory_bytes, memory
from training.pipeline.split import place


class _Value(BaseModel):
    model_config = ConfigDict(frozen=True)


class Share(_Value):
    """GPUs of one cluster in a plan."""

    cluster: str = Field(description="Cluster name.")
    gpus: int
    gpu_model: str | None = Field(
        default=None,
        description="GPU model, as the cluster's inventory names it (absent in older quotes).",
    )


class PlanEstimate(_Value):
    """What the cost model predicts for the plan (seconds, bytes, money)."""

    step_time_s: float = Field(description="Seconds per optimiser step.")
    total_time_s: float = Field(description="Seconds for all steps.")
    wan_bytes: int = Field(description="Bytes the job sends over WAN links in all.")
    cost: float | None = Field(default=None, description="Total price; absent in older quotes.")
    compute_s: float | None = Field(default=None, description="Compute seconds per step.")
    intra_s: float | None = Field(default=None, description="In-cluster all-reduce per step.")
    wan_s: float | None = Field(default=None, description="WAN exchange seconds per step.")
    overhead_s: float | None = None
    effective_steps: float | None = Field(
        default=None, description="Steps times the compressor's and sync mode's efficiency."
    )
    ring: tuple[str, ...] = Field(default=(), description="Order of clusters on the WAN ring.")
    step_overhead_s: float = Field(
        default=0.0, description="Observed per-step overhead included in step_time_s."
    )

    @computed_field  # type: ignore[prop-decorator]
    @property
    def wan_gb(self) -> float:
        return self.wan_bytes / 1e9


class GpuCharge(_Value):
    cluster: str
    gpu_model: str | None = None
    gpus: int
    gpu_hours: float
    price_per_gpu_hour: float
    amount: float


class EgressCharge(_Value):
    src: str
    dst: str
    gb: float
    price_per_gb: float
    amount: float


class PriceBreakdown(_Value):
    """The estimated price, by cluster (GPU-hours) and by WAN link (egress)."""

    total: float
    gpu: tuple[GpuCharge, ...] = ()
    egress: tuple[EgressCharge, ...] = ()
    currency: str = "USD"


class StageShare(_Value):
    """One pipeline stage: its cluster and how many data-parallel replicas it has there."""

    cluster: str
    replicas: int = 1


class Parallel(_Value):
    """How the model is spread over the plan's GPUs, and why."""

    mode: Literal["data", "pipeline", "hybrid"] = "data"
    stages: tuple[StageShare, ...] = Field(
        default=(), description="Pipeline stages in order (absent for data parallelism)."
    )
    micro_batches: int | None = None
    bubble: float | None = Field(
        default=None, description="The schedule's idle share, (S-1)/(M+S-1)."
    )
    model_gb: float | None = Field(
        default=None,
        description="Parameters, gradients and optimizer state of the whole model (GB).",
    )
    gpu_gb: dict[str, float] = Field(
        default_factory=dict, description="Usable memory of one GPU per cluster (GB)."
    )
    reason: str = ""


class JobPlan(_Value):
    """Clusters and GPUs, compression, sync mode, parallelism, estimate, price, and why."""

    objective: scheduler.Objective | None = Field(
        default=None, description="What the planner optimised (absent in older job plans)."
    )
    clusters: tuple[Share, ...] = Field(description="GPUs per cluster.")
    compression: CompressionValue
    sync: SyncValue
    estimate: PlanEstimate
    price: PriceBreakdown | None = Field(
        default=None, description="Estimated price; absent in older job plans."
    )
    explanation: tuple[str, ...] = Field(default=(), description="Why the planner chose this.")
    parallel: Parallel = Field(
        default_factory=Parallel,
        description="Data, pipeline or hybrid parallelism (data in older plans).",
    )

    @model_validator(mode="before")
    @classmethod
    def _older_quote_shape(cls, data: Any) -> Any:
        """Quote options stored before this model named their shares `placement`."""
        if isinstance(data, dict) and "clusters" not in data and "placement" in data:
            return {**data, "clusters": data["placement"]}
        return data

    @computed_field(  # type: ignore[prop-decorator]
        description="The same shares as `clusters`, under the name quote options first used."
    )
    @property
    def placement(self) -> tuple[Share, ...]:
        return self.clusters

    @property
    def gpus(self) -> int:
        return sum(s.gpus for s in self.clusters)

    def assignments(
        self, origins: Mapping[str, tuple[str, str]]
    ) -> tuple[scheduler.Assignment, ...]:
        """The plan in the scheduler's names: `origins` maps a snapshot cluster to its
        (cluster, GPU model); a share without a GPU model already has the snapshot's name. A
        share whose GPUs the snapshot no longer offers gets a name the planner refuses."""
        names = {origin: name for name, origin in origins.items()}
        return tuple(
            scheduler.Assignment(
                names.get((s.cluster, s.gpu_model), f"{s.cluster}/{s.gpu_model}")
                if s.gpu_model
                else s.cluster,
                s.gpus,
            )
            for s in self.clusters
        )


class HeldPlan(JobPlan):
    """The quote option a job was submitted with: its placement and price are held."""

    quote_id: str


class QuoteOptions(_Value):
    """A quote's options, as stored: fastest, cheapest, cheapest within the deadline."""

    options: tuple[JobPlan, ...]


def parallel_of(
    spec: JobSpec,
    shares: tuple[Share, ...],
    snapshot: scheduler.Snapshot,
    origins: Mapping[str, tuple[str, str]],
) -> Parallel:
    """The parallelism of a job on `shares`: the spec's when it fixes one; under `auto`, the
    memory model's (`scheduler.memory`): data parallel when the whole model (parameters,
    gradients, Adam state) fits one GPU of some share, else a pipeline of one stage per GPU.
    A hybrid whose shares cannot give every stage equal replicas runs as that pipeline."""
    params = spec.work.params if spec.work is not None else builtin_work(spec.task).params
    whole = memory(ModelProfile((Layer("model", params, 0.0, 0.0, 0.0),)), 0, 1, 1, 1).total
    names = {origin: name for name, origin in origins.items()}
    gpu: dict[str, float] = {}
    for s in shares:
        c = snapshot.by_name.get(names.get((s.cluster, s.gpu_model or ""), s.cluster))
        if c is not None:
            with suppress(ValueError):  # a GPU model of unknown memory: no memory verdict
                gpu[s.cluster] = round(gpu_memory_bytes(c) / 1e9, 3)
    model_gb = round(whole / 1e9, 6)
    mode = spec.parallelism
    reason = f"the spec asks for {mode} parallelism"
    if mode == "auto":
        fits = [c for c, gb in gpu.items() if whole <= gb * 1e9]
        gpus = sum(s.gpus for s in shares)
        if fits or len(gpu) < len(shares) or gpus < 2:
            mode = "data"
            reason = (
                f"the whole model needs {model_gb:.3g} GB a GPU, which fits "
                f"{', '.join(fits) or 'no known GPU model'}: data parallel moves no activations"
            )
        else:
            mode = "pipeline"
            reason = (
                f"the whole model needs {model_gb:.3g} GB a GPU, more than the largest "
                f"({max(gpu.values()):.3g} GB usable): a pipeline of {gpus} stages, one a GPU"
            )
    if mode == "data":
        return Parallel(mode="data", model_gb=model_gb, gpu_gb=gpu, reason=reason)
    clusters: dict[str, int] = {}
    for s in shares:
        clusters[s.cluster] = clusters.get(s.cluster, 0) + s.gpus
    split = parse_stages(spec.pipeline.stages) if spec.pipeline.stages is not None else None
    try:
        layout = place(clusters, split.count if split else None, mode == "hybrid")
    except ValueError as exc:  # hybrid's equal widths not met by these shares
        layout = place(clusters, None, False)
        mode = "pipeline"
        reason += f"; as a pipeline of one stage a GPU, since {exc}"
    stages = tuple(StageShare(cluster=c, replicas=layout.replicas) for c in layout.stage_clusters)
    micro = spec.pipeline.micro_batches
    return Parallel(
        mode="hybrid" if mode == "hybrid" else "pipeline",
        stages=stages,
        micro_batches=micro,
        bubble=round((len(stages) - 1) / (micro + len(stages) - 1), 6),
        model_gb=model_gb,
        gpu_gb=gpu,
        reason=reason,
    )


def plan_of(
    result: scheduler.Plan,
    snapshot: scheduler.Snapshot,
    origins: Mapping[str, tuple[str, str]],
    qos_class: str,
    spec: JobSpec | None = None,
) -> JobPlan:
    """The typed plan of a planner decision, priced by cluster and by WAN link.

    `origins` maps the snapshot's cluster names to (cluster, GPU model): a cluster offering
    several GPU models is one scheduler cluster per model. With the job's `spec`, the plan
    records its parallelism (`parallel_of`).
    """
    est = result.estimate
    hours = est.total_time_s / 3600

    def origin(name: str) -> tuple[str, str | None]:
        return origins.get(name, (name, None))

    gpu = []
    shares = []
    for a in result.placement:
        cluster, model = origin(a.cluster)
        price = snapshot.by_name[a.cluster].price(qos_class)
        shares.append(Share(cluster=cluster, gpus=a.gpus, gpu_model=model))
        gpu.append(
            GpuCharge(
                cluster=cluster,
                gpu_model=model,
                gpus=a.gpus,
                gpu_hours=round(a.gpus * hours, 6),
                price_per_gpu_hour=price,
                amount=round(a.gpus * hours * price, 6),
            )
        )
    egress = []
    ring = est.ring
    if len(ring) > 1 and est.wan_bytes:
        per_edge = est.wan_bytes / len(ring)
        for a_name, b_name in zip(ring, [*ring[1:], ring[0]], strict=True):
            link = snapshot.link(a_name, b_name)
            price_gb = link.egress_price_per_gb if link else 0.0
            egress.append(
                EgressCharge(
                    src=origin(a_name)[0],
                    dst=origin(b_name)[0],
                    gb=round(per_edge / 1e9, 9),
                    price_per_gb=price_gb,
                    amount=round(per_edge / 1e9 * price_gb, 6),
                )
            )
    parallel = Parallel() if spec is None else parallel_of(spec, tuple(shares), snapshot, origins)
    return JobPlan(
        objective=result.objective,
        clusters=tuple(shares),
        parallel=parallel,
        compression=result.compression,
        sync=result.sync,
        estimate=PlanEstimate(
            step_time_s=est.step_time_s,
            total_time_s=est.total_time_s,
            wan_bytes=est.wan_bytes,
            cost=est.cost,
            compute_s=est.compute_s,
            intra_s=est.intra_s,
            wan_s=est.wan_s,
            overhead_s=est.overhead_s,
            effective_steps=est.effective_steps,
            ring=tuple(est.ring),
            step_overhead_s=est.step_overhead_s,
        ),
        price=PriceBreakdown(total=round(est.cost, 6), gpu=tuple(gpu), egress=tuple(egress)),
        explanation=tuple(result.explanation)
        + ((parallel.reason,) if parallel.mode != "data" else ()),
    )
