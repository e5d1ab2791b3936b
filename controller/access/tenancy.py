"""Priority is granted, not chosen: what a tenant's jobs may ask for, and what they count as.

An admin sets each tenant's priority ceiling and the QoS classes it may use
(`Tenant.priority_ceiling`, `Tenant.qos_classes`; defaults 0 and standard + spot, so the
never-preempted guaranteed class is a grant too). A quote or a submission beyond them is a 403
problem naming the field and the grant. Queue order and preemption count the *granted*
priority: the job's own, capped by its tenant's ceiling now, so lowering a ceiling lowers that
tenant's queued and running jobs with it, and a job never outranks what its tenant was granted.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from sqlalchemy import ColumnElement, bindparam, case, select
from sqlalchemy.orm import Session

from controller.store.models import Job, Provider, Tenant
from controller.values.errors import Forbidden
from wire.spec import QoSSpec


class Grant(Protocol):
    """What a quote or a submission reads of its tenant: a `Tenant` row is one."""

    @property
    def id(self) -> str: ...
    @property
    def gpu_quota(self) -> int | None: ...
    @property
    def priority_ceiling(self) -> int: ...
    @property
    def qos_classes(self) -> Sequence[str]: ...


@dataclass(frozen=True, slots=True)
class TenantGrant:
    id: str
    gpu_quota: int | None
    priority_ceiling: int
    qos_classes: tuple[str, ...]


_LIVE_GRANTS = select(
    Tenant.id, Tenant.gpu_quota, Tenant.priority_ceiling, Tenant.qos_classes
).where(Tenant.id.in_(bindparam("ids", expanding=True)), Tenant.deleted_at.is_(None))


def live_grants(session: Session, tenant_ids: Iterable[str]) -> dict[str, TenantGrant]:
    """The grants of those tenants not deleted (a tenant missing: none such), read as Core rows
    on the session's connection: the ORM's identity load of the whole row was ~15 % of a
    submission's CPU (py-spy), and a submission or quote only reads these four values."""
    rows = session.connection().execute(_LIVE_GRANTS, {"ids": list(tenant_ids)})
    return {
        r.id: TenantGrant(r.id, r.gpu_quota, r.priority_ceiling, tuple(r.qos_classes)) for r in rows
    }


def live_grant(session: Session, tenant_id: str) -> TenantGrant | None:
    """The grant of a tenant not deleted (None: no such tenant)."""
    return live_grants(session, (tenant_id,)).get(tenant_id)


def check_grant(tenant: Grant, qos: QoSSpec) -> None:
    """Forbidden (403) naming `qos.qos_class` or `qos.priority` when `qos` asks for more than
    the tenant was granted."""
    allowed = list(tenant.qos_classes)
    if qos.qos_class not in allowed:
        raise Forbidden(
            f"qos.qos_class {qos.qos_class!r} is not granted to this tenant, which may use "
            f"{', '.join(allowed) or 'no class'}; choose one of those, or ask an admin to grant "
            f"{qos.qos_class}",
            field="qos.qos_class",
        )
    if qos.priority > tenant.priority_ceiling:
        ceiling = tenant.priority_ceiling
        raise Forbidden(
            f"qos.priority {qos.priority} is above this tenant's priority ceiling {ceiling}; "
            f"ask for at most {ceiling}, or ask an admin to raise the ceiling",
            field="qos.priority",
        )


def granted(priority: int, ceiling: int) -> int:
    """The priority a job counts as: what it asked for, never above its tenant's ceiling."""
    return min(priority, ceiling)


def granted_priority() -> ColumnElement[int]:
    """`granted` in SQL, for queries that join `Job` with its `Tenant`."""
    return case(
        (Job.priority > Tenant.priority_ceiling, Tenant.priority_ceiling), else_=Job.priority
    )


def find_tenant(session: Session, ref: str, *, lock: bool = False) -> Tenant | None:
    """The tenant `ref` names: its id, else its name (names are unique, deleted ones too, so
    a name never names two; an id is tried first). With `lock`, the row is locked for update."""
    for column in (Tenant.id, Tenant.name):
        query = select(Tenant).where(column == ref)
        tenant = session.scalars(query.with_for_update() if lock else query).first()
        if tenant is not None:
            return tenant
    return None


def find_provider(session: Session, ref: str, *, lock: bool = False) -> Provider | None:
    """The provider `ref` names: its id, else its name (as `find_tenant`)."""
    for column in (Provider.id, Provider.name):
        query = select(Provider).where(column == ref)
        provider = session.scalars(query.with_for_update() if lock else query).first()
        if provider is not None:
            return provider
    return None
