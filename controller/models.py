"""SQLAlchemy 2 typed models: the control plane's persistent state.

Migrations in `migrations/` must match these exactly (a test autogenerates against them).
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    Numeric,
    String,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import TypeDecorator


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC datetimes on every backend (SQLite drops the offset otherwise)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given; cpn stores UTC-aware times only")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def utcnow() -> datetime:
    return datetime.now(UTC)


def new_id() -> str:
    return str(uuid.uuid4())


class Base(DeclarativeBase):
    type_annotation_map = {datetime: UTCDateTime(), dict[str, Any]: JSON}


class Cluster(Base):
    """A datacenter cluster; its state follows the agent's lease (see controller.leases)."""

    __tablename__ = "clusters"

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    name: Mapped[str] = mapped_column(String(63), unique=True)
    region: Mapped[str] = mapped_column(String(63))
    labels: Mapped[dict[str, Any]] = mapped_column(default=dict)
    state: Mapped[str] = mapped_column(String(16), default="PENDING", index=True)
    cordoned: Mapped[bool] = mapped_column(Boolean, default=False)
    draining: Mapped[bool] = mapped_column(Boolean, default=False)
    lease_expires_at: Mapped[datetime | None]
    last_heartbeat_at: Mapped[datetime | None]
    probe_url: Mapped[str | None] = mapped_column(String(512))
    agent_version: Mapped[str | None] = mapped_column(String(64))
    discovery: Mapped[str | None] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)
    version: Mapped[int] = mapped_column(Integer, default=1)

    gpus: Mapped[list[GpuInventory]] = relationship(
        back_populates="cluster", cascade="all, delete-orphan", order_by="GpuInventory.model"
    )

    __mapper_args__ = {"version_id_col": version}


class ClusterTransition(Base):
    """Every state change of a cluster, with why."""

    __tablename__ = "cluster_transitions"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    cluster_id: Mapped[str] = mapped_column(
        ForeignKey("clusters.id", ondelete="CASCADE"), index=True
    )
    from_state: Mapped[str] = mapped_column(String(16))
    to_state: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str] = mapped_column(String(256))
    at: Mapped[datetime] = mapped_column(default=utcnow)


class GpuInventory(Base):
    """GPUs of one model in one cluster: what exists, what is offered, what is in use."""

    __tablename__ = "gpu_inventory"
    __table_args__ = (UniqueConstraint("cluster_id", "model", name="uq_gpu_cluster_model"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    cluster_id: Mapped[str] = mapped_column(ForeignKey("clusters.id", ondelete="CASCADE"))
    model: Mapped[str] = mapped_column(String(128))
    memory_gib: Mapped[float] = mapped_column(Float)
    count: Mapped[int] = mapped_column(Integer)
    allocatable: Mapped[int] = mapped_column(Integer)
    in_use: Mapped[int] = mapped_column(Integer, default=0)
    utilization: Mapped[float | None] = mapped_column(Float)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)

    cluster: Mapped[Cluster] = relationship(back_populates="gpus")


class Link(Base):
    """A directed WAN link; declared by an admin or measured by the source cluster's agent.

    Both kinds are kept side by side; the measured one, when present, is what counts.
    """

    __tablename__ = "links"
    __table_args__ = (
        UniqueConstraint("src_cluster_id", "dst_cluster_id", "source", name="uq_link_pair_source"),
    )

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    src_cluster_id: Mapped[str] = mapped_column(
        ForeignKey("clusters.id", ondelete="CASCADE"), index=True
    )
    dst_cluster_id: Mapped[str] = mapped_column(
        ForeignKey("clusters.id", ondelete="CASCADE"), index=True
    )
    source: Mapped[str] = mapped_column(String(16))  # "declared" | "measured"
    bandwidth_gbps: Mapped[float] = mapped_column(Float)
    rtt_ms: Mapped[float] = mapped_column(Float)
    loss: Mapped[float] = mapped_column(Float, default=0.0)
    egress_price_per_gb: Mapped[float] = mapped_column(Float, default=0.0)
    measured_at: Mapped[datetime] = mapped_column(default=utcnow)

    src: Mapped[Cluster] = relationship(foreign_keys=[src_cluster_id], lazy="joined")
    dst: Mapped[Cluster] = relationship(foreign_keys=[dst_cluster_id], lazy="joined")


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    name: Mapped[str] = mapped_column(String(63), unique=True)
    gpu_quota: Mapped[int | None] = mapped_column(Integer)
    budget: Mapped[float | None] = mapped_column(Numeric(14, 4, asdecimal=False))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class ApiKey(Base):
    """A bearer key, stored as its SHA-256 only; shown once when created.

    `scope` binds the key: a tenant key to its tenant id, an agent key to its cluster name.
    """

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    name: Mapped[str] = mapped_column(String(128), default="")
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))
    role: Mapped[str] = mapped_column(String(16))  # admin | tenant | agent
    scope: Mapped[str | None] = mapped_column(String(63))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[datetime | None]


class AuditLog(Base):
    """Append-only record of admin actions: who did what to which object."""

    __tablename__ = "audit_log"
    __table_args__ = (Index("ix_audit_target", "target_type", "target_id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
    actor_key_id: Mapped[str | None] = mapped_column(String(36))
    action: Mapped[str] = mapped_column(String(64))
    target_type: Mapped[str] = mapped_column(String(32))
    target_id: Mapped[str] = mapped_column(String(64))
    detail: Mapped[dict[str, Any]] = mapped_column(default=dict)
