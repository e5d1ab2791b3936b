"""Request and response bodies of the admin API (pydantic at the edge)."""

from __future__ import annotations

from datetime import datetime
from typing import Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

T = TypeVar("T")

NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
Name = Field(
    pattern=NAME_PATTERN,
    min_length=1,
    max_length=63,
    description="DNS-label style: lowercase letters, digits and '-', at most 63 characters.",
)


class _In(BaseModel):
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


class ClusterIn(_In):
    name: str = Name
    region: str = Field(min_length=1, max_length=63)
    labels: dict[str, str] = Field(default_factory=dict, max_length=64)


class ClusterPatch(_In):
    region: str | None = Field(default=None, min_length=1, max_length=63)
    labels: dict[str, str] | None = Field(default=None, max_length=64)


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
    probe_url: str | None
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
    src: str = Field(min_length=1, max_length=63, description="Source cluster name.")
    dst: str = Field(min_length=1, max_length=63, description="Destination cluster name.")
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
    bandwidth_gbps: float
    rtt_ms: float
    loss: float
    egress_price_per_gb: float
    measured_at: datetime
    pinned: bool


class GpuRow(GpuOut):
    cluster: str
    cluster_state: str


class GpuTotal(BaseModel):
    model: str
    count: int
    allocatable: int
    in_use: int
    clusters: int


class TenantIn(_In):
    name: str = Name
    gpu_quota: int | None = Field(default=None, ge=0, le=10_000_000)
    budget: float | None = Field(default=None, ge=0, le=1e9, description="Spending limit.")


class TenantPatch(_In):
    gpu_quota: int | None = Field(default=None, ge=0, le=10_000_000)
    budget: float | None = Field(default=None, ge=0, le=1e9, description="Spending limit.")


class TenantOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: str
    name: str
    gpu_quota: int | None
    budget: float | None
    created_at: datetime


class ApiKeyIn(_In):
    role: Literal["admin", "tenant", "agent"]
    scope: str | None = Field(
        default=None,
        max_length=63,
        description="Tenant id for a tenant key, cluster name for an agent key; none for admin.",
    )
    name: str = Field(default="", max_length=128)


class ApiKeyOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: str
    name: str
    prefix: str
    role: str
    scope: str | None
    created_at: datetime
    revoked_at: datetime | None


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
    cluster: str = Field(min_length=1, max_length=63)
    gpu_model: str = Field(min_length=1, max_length=128)
    qos_class: Literal["guaranteed", "standard", "spot"]
    price_per_gpu_hour: float = Field(ge=0, le=100_000)
    effective_from: datetime | None = Field(
        default=None, description="UTC time it applies from; now when left out; never the past."
    )


class EgressPriceIn(_In):
    src: str = Field(min_length=1, max_length=63)
    dst: str = Field(min_length=1, max_length=63)
    price_per_gb: float = Field(ge=0, le=1_000)
    effective_from: datetime | None = None
    symmetric: bool = True


class GpuPriceOut(BaseModel):
    cluster: str
    gpu_model: str
    qos_class: str
    price_per_gpu_hour: float
    effective_from: datetime


class EgressPriceOut(BaseModel):
    src: str
    dst: str
    price_per_gb: float
    effective_from: datetime


class PricingOut(BaseModel):
    at: datetime
    gpu: list[GpuPriceOut]
    egress: list[EgressPriceOut]


class QuoteOut(BaseModel):
    id: str
    created_at: datetime
    expires_at: datetime
    options: list[dict[str, object]]


class JobOut(BaseModel):
    id: str
    tenant_id: str
    name: str
    state: str
    reason: str
    priority: int
    qos_class: str
    preemptible: bool
    gpus_min: int
    gpus_max: int
    spec: dict[str, object]
    quote_id: str | None
    held_price: dict[str, object] | None
    placement: dict[str, object] | None
    attempts: int
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    version: int

    model_config = ConfigDict(from_attributes=True)


class JobEventOut(BaseModel):
    id: int
    at: datetime
    kind: str
    from_state: str | None
    to_state: str | None
    message: str
    data: dict[str, object]

    model_config = ConfigDict(from_attributes=True)


class JobMetricOut(BaseModel):
    step: int
    at: datetime
    loss: float | None
    accuracy: float | None
    step_time_s: float | None
    compute_time_s: float | None
    comm_time_s: float | None
    wan_bytes: int

    model_config = ConfigDict(from_attributes=True)


class UsageRow(BaseModel):
    kind: str
    cluster: str
    dst_cluster: str | None
    gpu_model: str | None
    qos_class: str | None
    quantity: float


class UsageOut(BaseModel):
    tenant_id: str
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
