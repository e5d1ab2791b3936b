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


class LinkPatch(_In):
    bandwidth_gbps: float | None = Field(default=None, gt=0, le=100_000)
    rtt_ms: float | None = Field(default=None, ge=0, le=600_000)
    loss: float | None = Field(default=None, ge=0, le=1)
    egress_price_per_gb: float | None = Field(default=None, ge=0, le=1_000)


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
    budget: float | None = Field(default=None, ge=0)


class TenantPatch(_In):
    gpu_quota: int | None = Field(default=None, ge=0, le=10_000_000)
    budget: float | None = Field(default=None, ge=0)


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
