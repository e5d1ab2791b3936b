"""The plan: what the planner decided for a job, as one typed value.

One model serves every place a decision travels: each option of a quote, the option a
submission holds (`HeldPlan`), the placement the reconcile loop reserved GPUs for (stored on
the job), and what the launcher reads back (compression, sync, the predicted step). Its JSON
form is what the REST API shows and what the database stores; rows stored before this model
existed parse with defaults (a job's plan had no objective and no price; revision 0016
renamed the shares that quote options stored as `placement`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, computed_field

import scheduler
from wire.spec import CompressionValue, SyncValue

_PAIR = WithJsonSchema({"type": "array", "items": {"type": "number"}, "minItems": 2, "maxItems": 2})
"""A (low, high) pair as OpenAPI 3.1 tools read it (`items`, not only `prefixItems`)."""


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
    region: str | None = Field(
        default=None, description="The cluster's region when planned (absent in older plans)."
    )


class PlannedLink(_Value):
    """A WAN link between two of the plan's clusters, as the planner saw it."""

    src: str
    dst: str
    bandwidth_gbps: float
    rtt_ms: float
    paced: bool = Field(
        default=False,
        description="It crosses an uplink or downlink whose capacity an admin declared: it "
        "was planned at its free share there, and the run's sends over it are paced to that "
        "bandwidth on real links too (as on emulated ones), and on average to the plan's "
        "`wan_kbps`, so the job takes no more.",
    )


class PlanEstimate(_Value):
    """What the cost model predicts for the plan (seconds, bytes, money)."""

    step_time_s: float = Field(description="Seconds per optimiser step.")
    total_time_s: float = Field(description="Seconds for the whole run: set-up and all steps.")
    wan_bytes: int = Field(description="Bytes the job sends over WAN links in all.")
    cost: float | None = Field(default=None, description="Total price; absent in older quotes.")
    compute_s: float | None = Field(default=None, description="Compute seconds per step.")
    intra_s: float | None = Field(default=None, description="In-cluster all-reduce per step.")
    wan_s: float | None = Field(default=None, description="WAN exchange seconds per step.")
    overhead_s: float | None = None
    effective_steps: float | None = Field(default=None, description="Steps the run takes.")
    setup_s: float = Field(
        default=0.0,
        description="Seconds outside the steps (launch, set-up, checkpoints, evaluation, the "
        "drain), fitted from observed runs; included in total_time_s and the cost.",
    )
    total_time_range_s: Annotated[tuple[float, float], _PAIR] | None = Field(
        default=None,
        description="Where the run time lands, low and high: the estimate times what finished "
        "runs took over theirs (10th and 90th percentiles; a prior before any).",
    )
    quality_cost: float = Field(
        default=0.0,
        description="What the compression and sync cost in model quality: the fraction of "
        "extra steps they would need to match lossless every-step training (0.1 = 10 %).",
    )
    ring: tuple[str, ...] = Field(default=(), description="Order of clusters on the WAN ring.")
    tree: dict[str, str] = Field(
        default_factory=dict,
        description="Each non-root cluster's parent when the clusters all-reduce over a tree "
        "(faster than the ring where latency dominates); empty: the ring.",
    )
    batch_shares: dict[str, float] = Field(
        default_factory=dict,
        description="Each cluster's fraction of the global batch, the split the run makes: "
        "by GPU throughput, or equal per GPU under the sync modes that let fast clusters run "
        "ahead (partial, async-ps). Absent in older plans: equal per worker.",
    )
    step_overhead_s: float = Field(
        default=0.0, description="Observed per-step overhead included in step_time_s."
    )
    ps_push_s: float | None = Field(
        default=None,
        description="Under async-ps: the fixed cost of a push to its server counted in "
        "step_time_s (fitted from finished async-ps runs; absent otherwise).",
    )
    relay_ticks: dict[str, int] = Field(
        default_factory=dict,
        description="Under async-ps across regions: every how many steps each region's server "
        "sends its progress to the global one (the ticks one exchange lasts), which the run "
        "keeps to; empty otherwise.",
    )

    @computed_field  # type: ignore[prop-decorator]
    @property
    def wan_gb(self) -> float:
        return self.wan_bytes / 1e9


PARTY_HELP = "The provider whose offer it is; absent: the operator's price."


class GpuCharge(_Value):
    cluster: str
    gpu_model: str | None = None
    gpus: int
    gpu_hours: float
    price_per_gpu_hour: float
    amount: float
    provider: str | None = Field(default=None, description=PARTY_HELP)


class EgressCharge(_Value):
    src: str
    dst: str
    gb: float
    price_per_gb: float
    amount: float
    provider: str | None = Field(
        default=None, description=PARTY_HELP + " Egress is the source cluster's owner's."
    )


class BandwidthCharge(_Value):
    """WAN rate a plan reserves on a cluster's ports, held for the whole run."""

    cluster: str
    gbps: float
    hours: float
    price_per_gbps_hour: float
    amount: float
    provider: str | None = Field(default=None, description=PARTY_HELP)


class PartyShare(_Value):
    """What one party's resources come to in a quote: a provider, or the operator (None)."""

    provider: str | None = None
    amount: float


class PriceBreakdown(_Value):
    """The estimated price, by cluster (GPU-hours), by WAN link (egress) and by cluster port
    (reserved bandwidth)."""

    total: float
    gpu: tuple[GpuCharge, ...] = ()
    egress: tuple[EgressCharge, ...] = ()
    bandwidth: tuple[BandwidthCharge, ...] = ()
    currency: str = "USD"

    @computed_field  # type: ignore[prop-decorator]
    @property
    def parties(self) -> tuple[PartyShare, ...]:
        """Each party's part of the total (the operator's first), from the lines."""
        by: dict[str | None, float] = {}
        lines: list[GpuCharge | EgressCharge | BandwidthCharge] = [
            *self.gpu,
            *self.egress,
            *self.bandwidth,
        ]
        for line in lines:
            by[line.provider] = by.get(line.provider, 0.0) + line.amount
        order = sorted(by, key=lambda p: (p is not None, p or ""))
        return tuple(PartyShare(provider=p, amount=round(by[p], 6)) for p in order)


class StageShare(_Value):
    """One pipeline stage: its cluster and how many data-parallel replicas it has there (each
    `Parallel.tensor` GPUs), or, for whole pipeline replicas on clusters of their own, each
    replica's cluster."""

    cluster: str
    replicas: int = 1
    replica_clusters: tuple[str, ...] = Field(
        default=(),
        description="The cluster of each replica, in replica order, when the replicas are "
        "whole pipelines on clusters of their own (their gradients all-reduce over the WAN); "
        "empty: every replica on `cluster`.",
    )


class Parallel(_Value):
    """How the model is spread over the plan's GPUs, and why."""

    mode: Literal["data", "pipeline", "hybrid", "tensor"] = "data"
    stages: tuple[StageShare, ...] = Field(
        default=(),
        description="Pipeline stages in order (absent for data parallelism; a tensor job's "
        "one stage is the whole model).",
    )
    tensor: int = Field(
        default=1,
        ge=1,
        description="GPUs of one cluster each stage replica's layers are split over (tensor "
        "parallelism; 1: none). Above 1 with several stages, 3D parallelism.",
    )
    micro_batches: int | None = None
    micro_overhead_s: float | None = Field(
        default=None,
        description="The fixed cost of one micro-batch on one stage the estimate counted "
        "(s), as fitted from finished pipeline runs; absent in older plans (0).",
    )
    all_reduce_overhead_s: float | None = Field(
        default=None,
        description="The fixed cost of one all-reduce inside a cluster (a tensor split's, a "
        "stage's replicas') the estimate counted (s), as fitted from finished tensor-parallel "
        "runs; absent where the plan makes none.",
    )
    all_reduces: int | None = Field(
        default=None,
        description="The all-reduces inside a cluster a step of a tensor split makes on its "
        "busiest stage (the split's, and its replicas' one), as the estimate counted them; "
        "absent unsplit or where the model's blocks are not known.",
    )
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
    links: tuple[PlannedLink, ...] = Field(
        default=(),
        description="The WAN links between its clusters that it was planned over, one a pair "
        "(the run emulates these where the WAN is emulated; absent in older plans).",
    )
    wan_kbps: dict[str, int] = Field(
        default_factory=dict,
        description="What the plan reserves of each cluster's uplink and downlink, kbit/s: "
        "its average WAN rate there (its bytes over its run time). Where a link is paced the "
        "run's sends average no more (absent for one cluster and in older plans).",
    )

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
