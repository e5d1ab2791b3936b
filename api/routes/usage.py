"""Metered usage and the ledger of a tenant (its own key, or an admin)."""

from __future__ import annotations

from decimal import Decimal

from fastapi import APIRouter
from sqlalchemy import func, select

from api.deps import ReaderDep, SessionDep
from api.pagination import PageDep
from api.schemas import LedgerEntryOut, LedgerOut, UsageOut, UsageRow
from controller.access.keys import Principal
from controller.access.tenancy import find_tenant
from controller.money.metering import tenant_spend
from controller.store.models import LedgerEntry, Tenant, Usage
from controller.values.errors import NotFound

router = APIRouter(prefix="/v1/tenants", tags=["usage and ledger"])


def _visible(session: SessionDep, tenant_id: str, principal: Principal) -> Tenant:
    """The tenant a path names by id or name, if the caller may read it (another's: a 404)."""
    tenant = find_tenant(session, tenant_id)
    if tenant is None or (principal.role == "tenant" and principal.scope != tenant.id):
        raise NotFound(f"no tenant {tenant_id!r}", field="tenant_id")
    return tenant


@router.get("/{tenant_id}/usage", response_model=UsageOut)
def usage(tenant_id: str, session: SessionDep, principal: ReaderDep) -> UsageOut:
    """Metered GPU-seconds by cluster, model and class, and WAN bytes by link."""
    tenant = _visible(session, tenant_id, principal)
    tenant_id = tenant.id
    rows = session.execute(
        select(
            Usage.kind,
            Usage.cluster,
            Usage.dst_cluster,
            Usage.gpu_model,
            Usage.qos_class,
            func.sum(Usage.quantity),
        )
        .where(Usage.tenant_id == tenant_id)
        .group_by(Usage.kind, Usage.cluster, Usage.dst_cluster, Usage.gpu_model, Usage.qos_class)
        .order_by(Usage.kind, Usage.cluster, Usage.dst_cluster, Usage.gpu_model)
    ).all()
    out = [
        UsageRow(kind=k, cluster=c, dst_cluster=d, gpu_model=m, qos_class=q, quantity=float(s))
        for k, c, d, m, q, s in rows
    ]
    return UsageOut(
        tenant_id=tenant_id,
        tenant_name=tenant.name,
        gpu_seconds=sum(r.quantity for r in out if r.kind == "gpu_seconds"),
        wan_bytes=int(sum(r.quantity for r in out if r.kind == "wan_bytes")),
        rows=out,
    )


@router.get("/{tenant_id}/ledger", response_model=LedgerOut)
def ledger(tenant_id: str, session: SessionDep, principal: ReaderDep, page: PageDep) -> LedgerOut:
    """Append-only charges, oldest first, with their exact total. A deleted tenant's ledger
    stays readable to admins."""
    tenant_id = _visible(session, tenant_id, principal).id
    total = tenant_spend(session, tenant_id)  # exact on SQLite too (no float SUM)
    count = session.scalar(select(func.count()).where(LedgerEntry.tenant_id == tenant_id)) or 0
    rows = session.scalars(
        select(LedgerEntry)
        .where(LedgerEntry.tenant_id == tenant_id)
        .order_by(LedgerEntry.id)
        .limit(page.limit)
        .offset(page.offset)
    ).all()
    items = [
        LedgerEntryOut(
            id=e.id,
            job_id=e.job_id,
            kind=e.kind,
            description=e.description,
            quantity=str(Decimal(e.quantity)),
            unit_price=str(Decimal(e.unit_price)),
            amount=str(Decimal(e.amount)),
            period_start=e.period_start,
            period_end=e.period_end,
            created_at=e.created_at,
        )
        for e in rows
    ]
    return LedgerOut(
        tenant_id=tenant_id,
        total=str(Decimal(total or 0).quantize(Decimal("0.000001"))),
        items=items,
        total_items=int(count),
        limit=page.limit,
        offset=page.offset,
    )
