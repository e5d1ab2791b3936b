"""SQLAlchemy 2 typed models: the control plane's persistent state.

Migrations in `migrations/` must match these exactly (a test autogenerates against them).
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from decimal import Decimal
from enum import StrEnum
from typing import Any, TypeVar

from pydantic import BaseModel
from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    Numeric,
    SmallInteger,
    String,
    UniqueConstraint,
    false,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import TypeDecorator

from grammar.states import ClusterState, JobState
from wire.plan import HeldPlan, JobPlan, QuoteOptions


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


S = TypeVar("S", bound=StrEnum)


class StateType(TypeDecorator[S]):
    """A state (`JobState`, `ClusterState`), stored as its name in a plain string column and
    read back as the enum; a name the enum does not know is refused on the way in."""

    impl = String
    cache_ok = True

    def __init__(self, enum: type[S], length: int = 16) -> None:
        super().__init__(length)
        self.enum = enum

    def process_bind_param(self, value: str | None, dialect: Any) -> str | None:
        return None if value is None else self.enum(value).value

    def process_result_value(self, value: str | None, dialect: Any) -> S | None:
        return None if value is None else self.enum(value)


class ModelJSON(TypeDecorator[Any]):
    """A pydantic value stored as JSON and read back as that type, so a row is parsed once,
    when loaded, instead of its keys being read back by hand wherever it is used."""

    impl = JSON
    cache_ok = True

    def __init__(self, model: type[BaseModel]) -> None:
        super().__init__()
        self.model = model

    def process_bind_param(self, value: Any, dialect: Any) -> Any:
        if value is None:
            return None
        if not isinstance(value, self.model):
            value = self.model.model_validate(value)
        return value.model_dump(mode="json", exclude_computed_fields=True)

    def process_result_value(self, value: Any, dialect: Any) -> Any:
        return None if value is None else self.model.model_validate(value)


ELLIPSIS = "\u2026"
REASON_MAX = 512
"""Length of a job's state reason (`Job.reason`)."""
MESSAGE_MAX = 2048
"""Length of a job event's message (`JobEvent.message`)."""


def bounded(text: str, limit: int) -> str:
    """`text` cut to at most `limit` characters, the cut marked with an ellipsis."""
    return text if len(text) <= limit else text[: max(0, limit - 1)] + ELLIPSIS


class BoundedString(TypeDecorator[str]):
    """A VARCHAR(n) that stores an over-long value cut (with an ellipsis) instead of refusing it.

    State reasons and event messages carry free text nobody bounds (errors, planner reasons,
    tenants' names inside them); PostgreSQL would refuse one that is too long and abort the
    whole transaction it came in (a placement pass, a settlement). Cut at bind time, so every
    write path (ORM or Core) goes through `bounded`.
    """

    impl = String
    cache_ok = True

    def __init__(self, length: int) -> None:
        super().__init__(length)
        self.length = length

    def process_bind_param(self, value: str | None, dialect: Any) -> str | None:
        return None if value is None else bounded(value, self.length)


def utcnow() -> datetime:
    return datetime.now(UTC)


def new_id() -> str:
    return str(uuid.uuid4())


class Base(DeclarativeBase):
    type_annotation_map = {datetime: UTCDateTime(), dict[str, Any]: JSON}


class Provider(Base):
    """A resource provider: a party that owns clusters, offers them at its own prices and is
    credited for what runs on them, less the platform's fee (`controller.money.settlement`)."""

    __tablename__ = "providers"
    __table_args__ = (CheckConstraint("fee_rate >= 0 AND fee_rate < 1", name="ck_provider_fee"),)

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    name: Mapped[str] = mapped_column(String(63), unique=True)
    fee_rate: Mapped[Decimal] = mapped_column(Numeric(7, 6))
    """The platform's share of every charge for this provider's resources, in [0, 1)."""
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Cluster(Base):
    """A datacenter cluster; its state follows the agent's lease (see controller.network.leases)."""

    __tablename__ = "clusters"

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    name: Mapped[str] = mapped_column(String(63), unique=True)
    region: Mapped[str] = mapped_column(String(63))
    labels: Mapped[dict[str, Any]] = mapped_column(default=dict)
    state: Mapped[ClusterState] = mapped_column(
        StateType(ClusterState), default=ClusterState.PENDING, index=True
    )
    cordoned: Mapped[bool] = mapped_column(Boolean, default=False)
    draining: Mapped[bool] = mapped_column(Boolean, default=False)
    lease_expires_at: Mapped[datetime | None]
    last_heartbeat_at: Mapped[datetime | None]
    probe_url: Mapped[str | None] = mapped_column(String(512))
    # An admin's pin: peers are told this URL instead of the one the agent reports.
    pinned_probe_url: Mapped[str | None] = mapped_column(String(512))
    agent_version: Mapped[str | None] = mapped_column(String(64))
    discovery: Mapped[str | None] = mapped_column(String(16))
    provider_id: Mapped[str | None] = mapped_column(
        ForeignKey("providers.id", ondelete="RESTRICT"), index=True
    )
    """The party that owns it and posts its offers (None: the operator's own cluster, priced
    by admins)."""
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)
    version: Mapped[int] = mapped_column(Integer, default=1)

    gpus: Mapped[list[ClusterGpus]] = relationship(
        back_populates="cluster", cascade="all, delete-orphan", order_by="ClusterGpus.model"
    )

    __mapper_args__ = {"version_id_col": version}


class ClusterTransition(Base):
    """Every state change of a cluster, with why."""

    __tablename__ = "cluster_transitions"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    cluster_id: Mapped[str] = mapped_column(
        ForeignKey("clusters.id", ondelete="CASCADE"), index=True
    )
    from_state: Mapped[ClusterState] = mapped_column(StateType(ClusterState))
    to_state: Mapped[ClusterState] = mapped_column(StateType(ClusterState))
    reason: Mapped[str] = mapped_column(BoundedString(256))
    at: Mapped[datetime] = mapped_column(default=utcnow)


class ClusterGpus(Base):
    """GPUs of one model in one cluster: what exists, what is offered, what is in use.

    `in_use` is the controller's (the GPUs of open allocations); the rest is the agent's, with
    one exception that keeps the books whole: `count` never drops below `in_use`, because GPUs
    that jobs hold stay on the books until those jobs end, whatever the agent reports. A model
    the agent stops reporting while in use is kept `missing` (nothing allocatable) until its
    allocations end. The CHECKs make the database refuse any write that breaks this.
    """

    __tablename__ = "gpu_inventory"
    __table_args__ = (
        UniqueConstraint("cluster_id", "model", name="uq_gpu_cluster_model"),
        CheckConstraint("in_use >= 0", name="ck_gpu_in_use_nonnegative"),
        CheckConstraint("allocatable >= 0", name="ck_gpu_allocatable_nonnegative"),
        CheckConstraint("allocatable <= count", name="ck_gpu_allocatable_within_count"),
        CheckConstraint("in_use <= count", name="ck_gpu_in_use_within_count"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    cluster_id: Mapped[str] = mapped_column(ForeignKey("clusters.id", ondelete="CASCADE"))
    model: Mapped[str] = mapped_column(String(128))
    memory_gib: Mapped[float] = mapped_column(Float)
    count: Mapped[int] = mapped_column(Integer)
    allocatable: Mapped[int] = mapped_column(Integer)
    in_use: Mapped[int] = mapped_column(Integer, default=0)
    missing: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    utilization: Mapped[float | None] = mapped_column(Float)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)

    cluster: Mapped[Cluster] = relationship(back_populates="gpus")


class Link(Base):
    """A directed WAN link; declared by an admin or measured by the source cluster's agent.

    Both kinds are kept side by side; the measured one, when present, is what counts, unless
    an admin pinned the declared one (probes that cannot see the real WAN, planned links).
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
    """Its capacity: declared, or the most the agent's recent probes carried."""
    free_gbps: Mapped[float | None] = mapped_column(Float, nullable=True, default=None)
    """Measured only: what the newest probe carried beside the path's traffic then."""
    rtt_ms: Mapped[float] = mapped_column(Float)
    loss: Mapped[float] = mapped_column(Float, default=0.0)
    egress_price_per_gb: Mapped[float] = mapped_column(Float, default=0.0)
    measured_at: Mapped[datetime] = mapped_column(default=utcnow)
    pinned: Mapped[bool] = mapped_column(Boolean, default=False)

    src: Mapped[Cluster] = relationship(foreign_keys=[src_cluster_id], lazy="joined")
    dst: Mapped[Cluster] = relationship(foreign_keys=[dst_cluster_id], lazy="joined")


DEFAULT_QOS_CLASSES = ("standard", "spot")
"""QoS classes a new tenant may use: guaranteed (never preempted) is an admin's grant."""


class Tenant(Base):
    """A customer of the compute network.

    Priority is granted, not chosen: its jobs may ask for at most `priority_ceiling` and only
    the QoS classes in `qos_classes`, both set by an admin (see controller.access.tenancy).
    """

    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    name: Mapped[str] = mapped_column(String(63), unique=True)
    gpu_quota: Mapped[int | None] = mapped_column(Integer)
    budget: Mapped[float | None] = mapped_column(Numeric(14, 4, asdecimal=False))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    priority_ceiling: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    qos_classes: Mapped[list[str]] = mapped_column(
        JSON,
        default=lambda: list(DEFAULT_QOS_CLASSES),
        server_default='["standard", "spot"]',
    )
    deleted_at: Mapped[datetime | None]
    """Soft delete: the tenant is gone from lists and cannot submit; its jobs, usage and
    ledger stay (the money trail is never deleted)."""
    charged_micros: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    """Its ledger's total in micro-dollars, added to with every entry (revision 0018)."""
    held_micros: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    """The sum of its jobs' `held_micros`: the estimates its jobs holding GPUs are yet to
    cost (`controller.money.budget`)."""


class ApiKey(Base):
    """A bearer key, stored as its SHA-256 only; shown once when created.

    `scope` binds the key: a tenant key to its tenant id, an agent key to its cluster name.
    `prefix` is at most 8 characters of a generated key's random part (empty for a key given
    through CPN_ADMIN_TOKEN, whose text cpn never stores); `from_env` marks that key, so a new
    CPN_ADMIN_TOKEN revokes the one it replaced. A key past `expires_at` fails like a revoked one.
    """

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    name: Mapped[str] = mapped_column(String(128), default="")
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(8))
    role: Mapped[str] = mapped_column(String(16))  # admin | tenant | agent
    scope: Mapped[str | None] = mapped_column(String(63))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[datetime | None]
    expires_at: Mapped[datetime | None]
    from_env: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())


class ConsoleSignIn(Base):
    """A web console sign-in. The browser holds a random id in an HttpOnly cookie; the row is
    keyed by that id's SHA-256 (the table holds no usable cookie) and names the API key by its
    hash (no usable key either). In the database, not in a process, so every worker of a
    `cpn serve` and every replica sees the same sign-ins and a sign-out ends them everywhere."""

    __tablename__ = "console_sessions"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    key_hash: Mapped[str] = mapped_column(String(64), index=True)
    csrf: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(index=True)


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


# ---- service layer: prices, quotes, jobs, metering, ledger ---------------------------------

Money = Numeric(18, 6)
"""Money and priced quantities are decimals: ledger totals must reconcile to the last digit."""

QOS_CLASSES = ("guaranteed", "standard", "spot")


class GpuPrice(Base):
    """Price per GPU-hour of one GPU model in one cluster for one QoS class, from a moment on.

    Effective-dated and append-only: the price at time t is the row with the latest
    `effective_from` <= t, so a change applies to new work without rewriting history.
    """

    __tablename__ = "gpu_prices"
    __table_args__ = (
        Index("ix_gpu_price_lookup", "cluster_id", "gpu_model", "qos_class", "effective_from"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    cluster_id: Mapped[str] = mapped_column(ForeignKey("clusters.id", ondelete="CASCADE"))
    gpu_model: Mapped[str] = mapped_column(String(128))
    qos_class: Mapped[str] = mapped_column(String(16))
    price_per_gpu_hour: Mapped[Decimal] = mapped_column(Money)
    effective_from: Mapped[datetime]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    provider_id: Mapped[str | None] = mapped_column(ForeignKey("providers.id"))
    """Who posted it: the cluster's provider (an offer), or None (an admin's price)."""
    gpus: Mapped[int | None] = mapped_column(Integer)
    """The most GPUs of the model the offer sells at once (None: all the cluster has)."""
    until: Mapped[datetime | None]
    """When the offer stops taking new placements (None: until a later row replaces it);
    a run placed before goes on at its price."""
    min_hours: Mapped[Decimal | None] = mapped_column(Numeric(10, 6))
    """The offer's minimum term: a run placed at it pays for at least this many hours of each
    GPU it holds (None: none)."""


class EgressPrice(Base):
    """Price per GB leaving `src` towards `dst`, effective-dated like GPU prices."""

    __tablename__ = "egress_prices"
    __table_args__ = (
        Index("ix_egress_price_lookup", "src_cluster_id", "dst_cluster_id", "effective_from"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    src_cluster_id: Mapped[str] = mapped_column(ForeignKey("clusters.id", ondelete="CASCADE"))
    dst_cluster_id: Mapped[str] = mapped_column(ForeignKey("clusters.id", ondelete="CASCADE"))
    price_per_gb: Mapped[Decimal] = mapped_column(Money)
    effective_from: Mapped[datetime]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    provider_id: Mapped[str | None] = mapped_column(ForeignKey("providers.id"))
    """Who posted it: the source cluster's provider (an offer), or None (an admin's price)."""


class BandwidthPrice(Base):
    """Price per Gbit/s-hour of WAN rate reserved on a cluster's ports (its uplink and
    downlink, issue 49), effective-dated like GPU prices; posted by its owner (issue 52)."""

    __tablename__ = "bandwidth_prices"
    __table_args__ = (Index("ix_bandwidth_price_lookup", "cluster_id", "effective_from"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    cluster_id: Mapped[str] = mapped_column(ForeignKey("clusters.id", ondelete="CASCADE"))
    price_per_gbps_hour: Mapped[Decimal] = mapped_column(Money)
    effective_from: Mapped[datetime]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    provider_id: Mapped[str | None] = mapped_column(ForeignKey("providers.id"))


class Sla(Base):
    """What a provider promises of one of its clusters from a moment on: the cluster's uptime
    and its uplink's bandwidth, and the share of a job's charges there refunded when a run
    gets less (`controller.money.sla`). Effective-dated like prices."""

    __tablename__ = "slas"
    __table_args__ = (
        Index("ix_sla_lookup", "cluster_id", "effective_from"),
        CheckConstraint("uptime IS NULL OR (uptime > 0 AND uptime <= 1)", name="ck_sla_uptime"),
        CheckConstraint("credit_rate > 0 AND credit_rate <= 1", name="ck_sla_credit"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    cluster_id: Mapped[str] = mapped_column(ForeignKey("clusters.id", ondelete="CASCADE"))
    provider_id: Mapped[str] = mapped_column(ForeignKey("providers.id"))
    uptime: Mapped[Decimal | None] = mapped_column(Numeric(7, 6))
    uplink_gbps: Mapped[float | None] = mapped_column(Float)
    credit_rate: Mapped[Decimal] = mapped_column(Numeric(7, 6))
    effective_from: Mapped[datetime]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Quote(Base):
    """Options the planner offered for a spec; a job submitted with its id holds the price."""

    __tablename__ = "quotes"

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    options: Mapped[QuoteOptions] = mapped_column(ModelJSON(QuoteOptions))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[datetime]
    accepted_by: Mapped[str | None] = mapped_column(String(36))
    """The job that accepted it: a quote prices one spec, once (revision 0017)."""


class Job(Base):
    """A tenant's training job; `state` moves only through controller.jobs.lifecycle."""

    __tablename__ = "jobs"
    __table_args__ = (
        UniqueConstraint("tenant_id", "idempotency_key", name="uq_job_idempotency"),
        Index("ix_jobs_queue", "state", "priority", "created_at"),
        Index("ix_jobs_tenant_created", "tenant_id", "created_at", "id"),
        Index("ix_jobs_created", "created_at", "id"),  # the all-tenant list (admins)
        # the queue cap, per submission; and a budget check's jobs past their estimated end
        Index("ix_jobs_tenant_state_ends", "tenant_id", "state", "ends_at"),
    )

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(128))
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    state: Mapped[JobState] = mapped_column(StateType(JobState), default=JobState.PENDING)
    reason: Mapped[str] = mapped_column(BoundedString(REASON_MAX), default="")
    priority: Mapped[int] = mapped_column(Integer, default=0)
    qos_class: Mapped[str] = mapped_column(String(16), default="standard")
    preemptible: Mapped[bool] = mapped_column(Boolean, default=False)
    gpus_min: Mapped[int] = mapped_column(Integer)
    gpus_max: Mapped[int] = mapped_column(Integer)
    run_s: Mapped[float | None] = mapped_column(Float)
    """Its size (`scheduler.reference_run_s`), for the queue order; None before revision 0012."""
    idempotency_key: Mapped[str | None] = mapped_column(String(128))
    request_hash: Mapped[str] = mapped_column(String(64), default="")
    quote_id: Mapped[str | None] = mapped_column(String(36))
    held_price: Mapped[HeldPlan | None] = mapped_column(ModelJSON(HeldPlan))
    placement: Mapped[JobPlan | None] = mapped_column(ModelJSON(JobPlan))
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    owner: Mapped[str | None] = mapped_column(String(64), index=True)
    preempted_by: Mapped[str | None] = mapped_column(String(36))
    checkpoint_step: Mapped[int | None] = mapped_column(BigInteger)
    fence: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    """The fencing epoch of the job's current run: bumped by every launch and adoption; a
    run's progress, settlement and checkpoints carry the one it started with and are refused
    once it moved on."""
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    ends_at: Mapped[datetime | None]
    """When its current placement is expected to end (placed + the plan's run time), for the
    hold for faster GPUs (`scheduler.waiting`); None before revision 0013."""
    held_micros: Mapped[int | None] = mapped_column(BigInteger)
    """What its placement's estimate holds of its tenant's budget while it holds GPUs, in
    micro-dollars; None once its run ended on the books (`controller.money.budget.hold`)."""
    version: Mapped[int] = mapped_column(Integer, default=1)

    __mapper_args__ = {"version_id_col": version}


class JobCount(Base):
    """How many jobs each tenant has, kept by database triggers (revision 0015) on every
    insert and delete of `jobs`, so the job list's `total` is a sum over a few rows instead of
    a count over all of the tenant's jobs, which grew with them into most of a read's
    database CPU (measured: bench/results/api-throughput.md).

    A tenant's count is the sum of its rows: on PostgreSQL each connection adds to its own
    stripe (its backend's pid modulo 16), so two transactions inserting a tenant's jobs
    at once wait on one row until the first commits only when their stripes agree (1 in 16);
    SQLite, one writer, uses stripe 0.
    A stripe may go negative (a delete counted on another stripe than its insert)."""

    __tablename__ = "job_counts"

    tenant_id: Mapped[str] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True
    )
    stripe: Mapped[int] = mapped_column(SmallInteger, primary_key=True, autoincrement=False)
    n: Mapped[int] = mapped_column(BigInteger)


class JobEvent(Base):
    """What happened to a job: state changes with their reason, progress, errors."""

    __tablename__ = "job_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    at: Mapped[datetime] = mapped_column(default=utcnow)
    kind: Mapped[str] = mapped_column(String(16))  # state | progress | error | info
    from_state: Mapped[JobState | None] = mapped_column(StateType(JobState))
    to_state: Mapped[JobState | None] = mapped_column(StateType(JobState))
    message: Mapped[str] = mapped_column(BoundedString(MESSAGE_MAX), default="")
    data: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)


LOG_LINE_MAX = 2100
"""A stored log line's characters (a worker cuts its lines at 2,000 and says so)."""


class JobLog(Base):
    """One line of a job's log: what a worker printed, or what the run's driver said
    (`training.logs`); the newest `controller.loop.progress.LOGS_KEPT` lines of a job are kept."""

    __tablename__ = "job_logs"
    __table_args__ = (Index("ix_job_logs_job", "job_id", "id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    at: Mapped[datetime] = mapped_column(default=utcnow)
    source: Mapped[str] = mapped_column(String(64))
    """`cluster/rank` of a worker, or `driver`."""
    stream: Mapped[str] = mapped_column(String(8))
    text: Mapped[str] = mapped_column(BoundedString(LOG_LINE_MAX), default="")


class JobMetric(Base):
    """One progress report of a job's workers."""

    __tablename__ = "job_metrics"
    __table_args__ = (Index("ix_job_metrics_job_step", "job_id", "step"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    at: Mapped[datetime] = mapped_column(default=utcnow)
    step: Mapped[int] = mapped_column(BigInteger)
    loss: Mapped[float | None] = mapped_column(Float)
    accuracy: Mapped[float | None] = mapped_column(Float)
    step_time_s: Mapped[float | None] = mapped_column(Float)
    compute_time_s: Mapped[float | None] = mapped_column(Float)
    comm_time_s: Mapped[float | None] = mapped_column(Float)
    wan_bytes: Mapped[int] = mapped_column(BigInteger, default=0)


class Allocation(Base):
    """GPUs of one cluster reserved for one job, from `started_at` until `ended_at`."""

    __tablename__ = "allocations"
    __table_args__ = (
        Index("ix_alloc_open", "cluster_id", "ended_at"),
        CheckConstraint("gpus > 0", name="ck_allocation_gpus_positive"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    cluster_id: Mapped[str] = mapped_column(ForeignKey("clusters.id", ondelete="CASCADE"))
    gpu_model: Mapped[str] = mapped_column(String(128))
    gpus: Mapped[int] = mapped_column(Integer)
    qos_class: Mapped[str] = mapped_column(String(16))
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    ended_at: Mapped[datetime | None]
    metered_until: Mapped[datetime | None]
    billed_from: Mapped[datetime | None]
    """When the job's run on these GPUs started (it became RUNNING): billing counts from
    here, not from the reservation. None: it never ran, nothing is billed."""
    paused_at: Mapped[datetime | None]
    """Billing stopped here (metered up to it): the replica running the job died and no run
    is alive until another replica relaunches it. None: not paused."""
    paused_s: Mapped[Decimal] = mapped_column(Money, default=Decimal(0), server_default="0")
    """Seconds between `billed_from` and `metered_until` that were not billed (pauses):
    GPU usage = gpus x (metered_until - billed_from - paused_s)."""
    wan_kbps: Mapped[int | None] = mapped_column(BigInteger)
    """The WAN bandwidth the job's plan sends (and receives) from this cluster, in kbit/s,
    reserved on the cluster's uplink and downlink while the allocation is open (`WanPort`);
    None or 0: the plan crosses no WAN from here (revision 0019)."""


class WanPort(Base):
    """What is reserved of one datacenter's uplink or downlink: the sum of the open
    allocations' `wan_kbps` there. Its capacity is the cluster's `uplink_gbps` /
    `downlink_gbps` label, declared by an admin; a reservation is one conditional UPDATE
    (`reserved_kbps + n <= capacity`), so several replicas never over-commit it."""

    __tablename__ = "wan_ports"
    __table_args__ = (CheckConstraint("reserved_kbps >= 0", name="ck_wan_port_nonnegative"),)

    cluster_id: Mapped[str] = mapped_column(
        ForeignKey("clusters.id", ondelete="CASCADE"), primary_key=True
    )
    direction: Mapped[str] = mapped_column(String(4), primary_key=True)  # up | down
    reserved_kbps: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")


class Usage(Base):
    """Metered usage: GPU-seconds of an allocation over a period, or WAN bytes over a link."""

    __tablename__ = "usage"
    __table_args__ = (Index("ix_usage_tenant", "tenant_id", "period_start"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    # No ON DELETE CASCADE on the money tables: deleting a tenant or a job never erases what it
    # used or was charged (tenants are soft-deleted; a hard delete is refused by these keys).
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), index=True)
    kind: Mapped[str] = mapped_column(String(16))  # gpu_seconds|wan_bytes|held_credit|sla_credit
    cluster: Mapped[str] = mapped_column(String(63))  # the GPU cluster, or the link's source
    dst_cluster: Mapped[str | None] = mapped_column(String(63))
    gpu_model: Mapped[str | None] = mapped_column(String(128))
    qos_class: Mapped[str | None] = mapped_column(String(16))
    quantity: Mapped[Decimal] = mapped_column(Money)
    period_start: Mapped[datetime]
    period_end: Mapped[datetime]
    priced: Mapped[bool] = mapped_column(Boolean, default=False, index=True)


class LedgerEntry(Base):
    """An append-only charge: metered quantity times the price in effect for its period.

    Append-only in the database too: triggers on both backends refuse UPDATE and DELETE (and
    TRUNCATE on PostgreSQL), see migration 0005; a usage row is charged at most once.
    """

    __tablename__ = "ledger"
    __table_args__ = (
        Index("ix_ledger_tenant", "tenant_id", "id"),
        UniqueConstraint("usage_id", name="uq_ledger_usage"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), index=True)
    usage_id: Mapped[int] = mapped_column(ForeignKey("usage.id"))
    kind: Mapped[str] = mapped_column(String(16))  # gpu|egress|credit (held overrun)|sla_credit
    description: Mapped[str] = mapped_column(String(256))
    quantity: Mapped[Decimal] = mapped_column(Money)  # GPU-hours or GB
    unit_price: Mapped[Decimal] = mapped_column(Money)
    amount: Mapped[Decimal] = mapped_column(Money)
    period_start: Mapped[datetime]
    period_end: Mapped[datetime]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Posting(Base):
    """One side of a ledger entry in the double-entry books: the tenant's debit (negative), a
    provider's credit and the platform's. The postings of an entry sum to zero exactly; like
    the ledger they are append-only in the database (migration 0021)."""

    __tablename__ = "postings"
    __table_args__ = (
        Index("ix_postings_party", "account", "party_id", "id"),
        CheckConstraint("account IN ('tenant', 'provider', 'platform')", name="ck_posting_account"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    ledger_id: Mapped[int] = mapped_column(ForeignKey("ledger.id"), index=True)
    account: Mapped[str] = mapped_column(String(16))  # tenant | provider | platform
    party_id: Mapped[str | None] = mapped_column(String(36))  # the tenant's or provider's id
    cluster: Mapped[str] = mapped_column(String(63))  # whose resources (or "platform")
    kind: Mapped[str] = mapped_column(String(16))  # the entry's: gpu | egress | credit
    amount: Mapped[Decimal] = mapped_column(Money)
    at: Mapped[datetime]  # the entry's period end: statements group by it
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Payout(Base):
    """Money paid out to a provider (an admin's record; append-only like the ledger): a
    provider's balance is its credits less its payouts, and a payout never exceeds it."""

    __tablename__ = "payouts"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    provider_id: Mapped[str] = mapped_column(ForeignKey("providers.id"), index=True)
    amount: Mapped[Decimal] = mapped_column(Money)
    reference: Mapped[str] = mapped_column(String(128), default="")
    at: Mapped[datetime] = mapped_column(default=utcnow)


class Replica(Base):
    """A running controller (`cpn serve`); it owns the jobs it launched while it stays seen."""

    __tablename__ = "replicas"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    host: Mapped[str] = mapped_column(String(255), default="")
    pid: Mapped[int] = mapped_column(Integer, default=0)
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    seen_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)


class StepObservation(Base):
    """Observed compute time of training steps per GPU model: the cost model's calibration."""

    __tablename__ = "step_observations"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    gpu_model: Mapped[str] = mapped_column(String(128), index=True)
    gpus: Mapped[int] = mapped_column(Integer)
    flops: Mapped[float] = mapped_column(Float)
    compute_s: Mapped[float] = mapped_column(Float)
    predicted_s: Mapped[float | None] = mapped_column(Float)
    at: Mapped[datetime] = mapped_column(default=utcnow)
