"""Request and response bodies of the admin API (pydantic at the edge)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Generic, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, Json

from agents.protocol import PROBE_URL_HELP, BoundedUTC, PlainText, ProbeUrl, StrictScalars
from wire.jobs import JobOut
from wire.plan import HeldPlan, JobPlan
from wire.spec import QosClass

T = TypeVar("T")

NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
Name = Field(
    pattern=NAME_PATTERN,
    min_length=1,
    max_length=63,
    description="DNS-label style: lowercase letters, digits and '-', at most 63 characters.",
)


class _In(StrictScalars):
    model_config = ConfigDict(extra="forbid")


class Page(BaseModel, Generic[T]):
    items: list[T]
    total: int
    limit: int
    offset: int


class GpuOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    model: str
    memory_gib: float
    count: int
    allocatable: int
    in_use: int
    utilization: float | None


LABELS_HELP = (
    "Free-form labels; the planner reads intra_bandwidth_gbps (Gbit/s between the cluster's "
    "GPUs, a number above 0) and gpu_tflops (peak TFLOPS of one GPU, for models cpn lacks, "
    "a number above 0), which are checked when written."
)


LabelKey = Annotated[PlainText, Field(min_length=1, max_length=63)]
LabelValue = Annotated[PlainText, Field(max_length=256)]
Labels = dict[LabelKey, LabelValue]


PIN_HELP = (
    "Pin the probe URL peers are told for this cluster, over the one its agent reports: "
    + PROBE_URL_HELP
    + "."
)


class ClusterIn(_In):
    name: str = Name
    region: PlainText = Field(min_length=1, max_length=63)
    labels: Labels = Field(default_factory=dict, max_length=64, description=LABELS_HELP)
    pinned_probe_url: ProbeUrl | None = Field(default=None, description=PIN_HELP)


class ClusterPatch(_In):
    region: PlainText | None = Field(default=None, min_length=1, max_length=63)
    labels: Labels | None = Field(default=None, max_length=64, description=LABELS_HELP)
    pinned_probe_url: ProbeUrl | None = Field(
        default=None, description=PIN_HELP + " Send null to unpin."
    )


class ClusterOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: str
    name: str
    region: str
    labels: dict[str, str]
    state: str
    cordoned: bool
    draining: bool
    lease_expires_at: datetime | None
    last_heartbeat_at: datetime | None
    probe_url: str | None = Field(description="The probe URL the cluster's agent reports.")
    pinned_probe_url: str | None = Field(
        description="The admin's pin; when set, peers are told it instead of probe_url."
    )
    discovery: str | None
    version: int
    gpus: list[GpuOut]


class TransitionOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    from_state: str
    to_state: str
    reason: str
    at: datetime


class LinkIn(_In):
    src: PlainText = Field(min_length=1, max_length=63, description="Source cluster name.")
    dst: PlainText = Field(min_length=1, max_length=63, description="Destination cluster name.")
    bandwidth_gbps: float = Field(gt=0, le=100_000)
    rtt_ms: float = Field(ge=0, le=600_000)
    loss: float = Field(default=0.0, ge=0, le=1)
    egress_price_per_gb: float = Field(default=0.0, ge=0, le=1_000)
    symmetric: bool = Field(default=True, description="Also declare dst -> src with same values.")
    pinned: bool = Field(
        default=False, description="Count this declared link even over measurements."
    )


class LinkPatch(_In):
    bandwidth_gbps: float | None = Field(default=None, gt=0, le=100_000)
    rtt_ms: float | None = Field(default=None, ge=0, le=600_000)
    loss: float | None = Field(default=None, ge=0, le=1)
    egress_price_per_gb: float | None = Field(default=None, ge=0, le=1_000)
    pinned: bool | None = None


class LinkOut(BaseModel):
    id: str
    src: str
    dst: str
    source: Literal["declared", "measured"]
    bandwidth_gbps: float = Field(
        description="Capacity: declared, or the most the agent's recent probes carried."
    )
    free_gbps: float | None = Field(
        default=None,
        description="Measured links: what the newest probe carried beside the traffic on the "
        "path then (capacity less what others send); the planner plans on the capacity less "
        "cpn's own reservations.",
    )
    rtt_ms: float
    loss: float
    egress_price_per_gb: float
    measured_at: datetime
    pinned: bool


class PortHolderOut(BaseModel):
    job_id: str
    tenant_id: str
    reserved_gbps: float = Field(description="The job's plan's average WAN rate here.")


class PortOut(BaseModel):
    """A cluster's uplink or downlink: declared capacity, what jobs reserved, what is free."""

    cluster: str
    direction: Literal["up", "down"]
    capacity_gbps: float | None = Field(
        description="The `uplink_gbps` / `downlink_gbps` label; null: undeclared (no limit)."
    )
    measured_gbps: float | None = Field(
        default=None,
        description="The most the agents' probes carried over it; where 90 % of it is below "
        "the capacity, jobs are planned on that instead. Null: not measured.",
    )
    reserved_gbps: float
    free_gbps: float | None = Field(
        description="What the planner may still reserve: the capacity (or what was measured, "
        "where less) less reservations, and no more than keeps the holders' bursts within 5 % "
        "of their planned step time; null: no limit."
    )
    holders: list[PortHolderOut] = Field(description="Jobs holding part of it, largest first.")


class GpuRow(GpuOut):
    cluster: str
    cluster_state: str


class GpuTotal(BaseModel):
    model: str
    count: int
    allocatable: int
    in_use: int
    clusters: int


def _unique(values: list[QosClass]) -> list[QosClass]:
    return list(dict.fromkeys(values))


PriorityCeiling = Annotated[
    int,
    Field(
        ge=-1000,
        le=1000,
        description="The highest qos.priority the tenant's jobs may ask for; a quote or job "
        "above it is refused (403). Queue order and preemption never count a job higher.",
    ),
]
QosClasses = Annotated[
    list[QosClass],
    Field(
        min_length=1,
        max_length=3,
        description="QoS classes the tenant's jobs may use (default standard and spot: "
        "guaranteed, never preempted, is granted by an admin).",
    ),
    AfterValidator(_unique),
]


def _default_classes() -> list[QosClass]:
    return ["standard", "spot"]


class TenantIn(_In):
    name: str = Name
    gpu_quota: int | None = Field(default=None, ge=0, le=10_000_000)
    budget: float | None = Field(default=None, ge=0, le=1e9, description="Spending limit.")
    priority_ceiling: PriorityCeiling = 0
    qos_classes: QosClasses = Field(default_factory=_default_classes)


class TenantPatch(_In):
    gpu_quota: int | None = Field(default=None, ge=0, le=10_000_000)
    budget: float | None = Field(default=None, ge=0, le=1e9, description="Spending limit.")
    priority_ceiling: PriorityCeiling = 0
    qos_classes: QosClasses = Field(default_factory=_default_classes)


class TenantOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: str
    name: str
    gpu_quota: int | None
    budget: float | None
    priority_ceiling: int
    qos_classes: list[str]
    created_at: datetime


class ApiKeyIn(_In):
    role: Literal["admin", "tenant", "agent", "provider"]
    scope: PlainText | None = Field(
        default=None,
        max_length=63,
        description="Tenant id for a tenant key, cluster name for an agent key, provider id or "
        "name for a provider key; none for admin.",
    )
    name: PlainText = Field(default="", max_length=128)
    expires_at: BoundedUTC | None = Field(
        default=None,
        description="When the key stops working (ISO 8601 with a UTC offset, in the future); "
        "none: until revoked.",
    )


class ApiKeyOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: str
    name: str
    prefix: str = Field(
        description="Up to 8 characters of the key after `cpn_<role>_`, to tell keys apart; "
        "empty for a key given through CPN_ADMIN_TOKEN."
    )
    role: str
    scope: str | None
    created_at: datetime
    revoked_at: datetime | None
    expires_at: datetime | None = None


class ApiKeyCreated(ApiKeyOut):
    token: str = Field(description="The key itself. Shown once: store it now.")


class AuditOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    at: datetime
    actor_key_id: str | None
    action: str
    target_type: str
    target_id: str
    detail: dict[str, object]


class LinkReportAck(BaseModel):
    stored: int


# ---- service layer -------------------------------------------------------------------------


class GpuPriceIn(_In):
    cluster: PlainText = Field(min_length=1, max_length=63)
    gpu_model: PlainText = Field(min_length=1, max_length=128)
    qos_class: Literal["guaranteed", "standard", "spot"]
    price_per_gpu_hour: float = Field(ge=0, le=100_000)
    effective_from: BoundedUTC | None = Field(
        default=None, description="UTC time it applies from; now when left out; never the past."
    )
    gpus: int | None = Field(
        default=None,
        ge=1,
        le=1_000_000,
        description="The most GPUs of the model sold at once at this price; all when left out.",
    )
    until: BoundedUTC | None = Field(
        default=None,
        description="When the offer stops taking new placements (runs placed before go on at "
        "its price); open when left out.",
    )
    min_hours: float | None = Field(
        default=None,
        gt=0,
        le=8760,
        description="Minimum term: a run placed at this price pays for at least this many "
        "hours of each GPU it holds; none when left out.",
    )


class EgressPriceIn(_In):
    src: PlainText = Field(min_length=1, max_length=63)
    dst: PlainText = Field(min_length=1, max_length=63)
    price_per_gb: float = Field(ge=0, le=1_000)
    effective_from: BoundedUTC | None = Field(
        default=None, description="UTC time it applies from; now when left out; never the past."
    )
    symmetric: bool = True


class GpuPriceOut(BaseModel):
    cluster: str
    gpu_model: str
    qos_class: str
    price_per_gpu_hour: float
    effective_from: datetime
    gpus: int | None = Field(default=None, description="The most GPUs sold at once; null: all.")
    until: datetime | None = Field(default=None, description="Takes placements until; null: open.")
    min_hours: float | None = Field(default=None, description="Minimum term in hours; null: none.")
    provider: str | None = Field(
        default=None, description="The provider whose offer it is; null: the operator's price."
    )


class EgressPriceOut(BaseModel):
    src: str
    dst: str
    price_per_gb: float
    effective_from: datetime
    provider: str | None = Field(
        default=None, description="The provider whose offer it is; null: the operator's price."
    )


class BandwidthPriceIn(_In):
    cluster: PlainText = Field(min_length=1, max_length=63)
    price_per_gbps_hour: float = Field(
        ge=0, le=100_000, description="Per Gbit/s of WAN rate a job holds on the cluster's ports."
    )
    effective_from: BoundedUTC | None = Field(
        default=None, description="UTC time it applies from; now when left out; never the past."
    )


class BandwidthPriceOut(BaseModel):
    cluster: str
    price_per_gbps_hour: float
    effective_from: datetime
    provider: str | None = Field(
        default=None, description="The provider whose offer it is; null: the operator's price."
    )


class PricingOut(BaseModel):
    at: datetime
    gpu: list[GpuPriceOut]
    egress: list[EgressPriceOut]
    bandwidth: list[BandwidthPriceOut] = Field(
        default_factory=list,
        description="Prices of WAN rate reserved on a cluster's ports, per Gbit/s-hour.",
    )


class JobRow(JobOut):
    """`JobOut` read straight off the `jobs` columns, for the list: the JSON columns as their
    text and the times as ISO text (`api.job_list._columns`), parsed in one pydantic
    pass instead of by SQLAlchemy's per-value processors and then validated again, which cost
    several times what the driver's own fetch did (measured: bench/results/api-throughput.md).
    It answers exactly as `JobOut` does (`tests/service/test_jobs_api.py`)."""

    spec: Json[dict[str, object]]  # type: ignore[assignment]
    """The stored spec's JSON, handed through unparsed: a stored spec is `JobSpec`'s own dump,
    so the answer is the one `JobOut` gives, without validating every row's spec again."""
    held_price: Json[HeldPlan | None] | None = Field(
        description="The quote option the job was submitted with."
    )
    placement: Json[JobPlan | None] | None = Field(
        description="The plan its GPUs are reserved for."
    )


class UsageRow(BaseModel):
    kind: str
    cluster: str
    dst_cluster: str | None
    gpu_model: str | None
    qos_class: str | None
    quantity: float


class UsageOut(BaseModel):
    tenant_id: str
    tenant_name: str
    gpu_seconds: float
    wan_bytes: int
    rows: list[UsageRow]


class LedgerEntryOut(BaseModel):
    id: int
    job_id: str
    kind: str
    description: str
    quantity: str
    unit_price: str
    amount: str
    period_start: datetime
    period_end: datetime
    created_at: datetime


class LedgerOut(BaseModel):
    tenant_id: str
    total: str = Field(description="Sum of all entries, as an exact decimal string.")
    items: list[LedgerEntryOut]
    total_items: int
    limit: int
    offset: int


DecimalAmount = Annotated[
    str,
    Field(
        pattern=r"^[0-9]{1,12}(\.[0-9]{1,6})?$",
        description='Dollars as an exact decimal string, at most 6 decimals: "125.50".',
    ),
]


class ProviderIn(_In):
    name: str = Name
    fee_rate: float = Field(
        default=0.1,
        ge=0,
        lt=1,
        description="The platform's share of every charge for the provider's resources.",
    )
    clusters: list[Annotated[PlainText, Field(min_length=1, max_length=63)]] = Field(
        default_factory=list, max_length=256, description="Names of the clusters it owns."
    )


class ProviderClustersIn(_In):
    clusters: list[Annotated[PlainText, Field(min_length=1, max_length=63)]] = Field(
        max_length=256,
        description="Every cluster the provider owns from now on; clusters it owned and that "
        "are not listed go back to the operator.",
    )


class ProviderOut(BaseModel):
    id: str
    name: str
    fee_rate: float
    clusters: list[str]
    balance: str = Field(description="What the platform owes it now: credits less payouts.")
    created_at: datetime


class ProviderGpusOut(BaseModel):
    model: str
    count: int
    allocatable: int
    in_use: int


class ProviderClusterOut(BaseModel):
    name: str
    region: str
    state: str
    cordoned: bool
    gpus: list[ProviderGpusOut]
    utilization: float | None = Field(
        description="GPUs in use over GPUs allocatable now; null without allocatable GPUs."
    )


class StatementLineOut(BaseModel):
    cluster: str
    kind: str = Field(description="gpu or egress")
    gross: str = Field(description="What tenants paid for it.")
    fee: str = Field(description="The platform's share.")
    net: str = Field(description="Credited to the provider.")


class StatementOut(BaseModel):
    provider: str
    start: datetime | None
    end: datetime
    lines: list[StatementLineOut]
    gross: str
    fee: str
    net: str
    paid: str = Field(description="Payouts within the period.")
    balance: str = Field(description="Owed now: every credit to date less every payout to date.")


class PayoutIn(_In):
    amount: DecimalAmount
    reference: PlainText = Field(default="", max_length=128)


class PayoutOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    amount: str
    reference: str
    at: datetime


class SlaIn(_In):
    cluster: PlainText = Field(min_length=1, max_length=63)
    uptime: float | None = Field(
        default=None, gt=0, le=1, description="The fraction of the time the cluster is up."
    )
    uplink_gbps: float | None = Field(
        default=None, gt=0, le=100_000, description="What the cluster's uplink carries."
    )
    credit_rate: float = Field(
        gt=0,
        le=1,
        description="The share of a run's charges on the cluster refunded when it gets less.",
    )
    effective_from: BoundedUTC | None = Field(
        default=None, description="UTC time it applies from; now when left out; never the past."
    )


class SlaOut(BaseModel):
    cluster: str
    uptime: float | None
    uplink_gbps: float | None
    credit_rate: float
    effective_from: datetime
