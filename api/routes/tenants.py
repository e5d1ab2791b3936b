"""Admin API over tenants, API keys and the audit log."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Response, status
from sqlalchemy import select

from api.deps import AdminDep, SessionDep
from api.pagination import PageDep, fetch_page
from api.schemas import (
    ApiKeyCreated,
    ApiKeyIn,
    ApiKeyOut,
    AuditOut,
    Page,
    TenantIn,
    TenantOut,
    TenantPatch,
)
from controller.access import keys
from controller.access.tenancy import find_provider, find_tenant
from controller.network import resources
from controller.store.models import ApiKey, AuditLog, Cluster, Job, Tenant, utcnow
from controller.values.errors import Conflict, Invalid, NotFound
from grammar.states import TERMINAL

router = APIRouter(prefix="/v1", tags=["tenants and keys"])


def _tenant(session: SessionDep, tenant_id: str, *, lock: bool = False) -> Tenant:
    """The live tenant a path names by id or by name."""
    tenant = find_tenant(session, tenant_id, lock=lock)
    if tenant is None or tenant.deleted_at is not None:
        raise NotFound(f"no tenant {tenant_id!r} (an id or a name); list them with GET /v1/tenants")
    return tenant


@router.post("/tenants", status_code=status.HTTP_201_CREATED, response_model=TenantOut)
def create_tenant(body: TenantIn, session: SessionDep, admin: AdminDep) -> TenantOut:
    """Create a tenant with an optional GPU quota and budget."""
    if session.scalar(select(Tenant.id).where(Tenant.name == body.name)):
        raise Conflict(f"a tenant named {body.name!r} exists; pick another name", field="name")
    tenant = Tenant(**body.model_dump())
    session.add(tenant)
    session.flush()
    resources.audit(session, admin.key_id, "tenant.create", "tenant", tenant.id, name=body.name)
    session.commit()
    return TenantOut.model_validate(tenant)


@router.get("/tenants", response_model=Page[TenantOut])
def list_tenants(session: SessionDep, _: AdminDep, page: PageDep) -> Page[TenantOut]:
    items, total = fetch_page(
        session, select(Tenant).where(Tenant.deleted_at.is_(None)).order_by(Tenant.name), page
    )
    return Page(
        items=[TenantOut.model_validate(t) for t in items],
        total=total,
        limit=page.limit,
        offset=page.offset,
    )


@router.get("/tenants/{tenant_id}", response_model=TenantOut)
def get_tenant(tenant_id: str, session: SessionDep, _: AdminDep) -> TenantOut:
    return TenantOut.model_validate(_tenant(session, tenant_id))


@router.patch("/tenants/{tenant_id}", response_model=TenantOut)
def patch_tenant(
    tenant_id: str, body: TenantPatch, session: SessionDep, admin: AdminDep
) -> TenantOut:
    """Change a tenant's quota or budget (send null to remove a limit)."""
    tenant = _tenant(session, tenant_id)
    changes = body.model_dump(exclude_unset=True)
    for key, value in changes.items():
        setattr(tenant, key, value)
    resources.audit(session, admin.key_id, "tenant.update", "tenant", tenant.id, **changes)
    session.commit()
    return TenantOut.model_validate(tenant)


@router.delete("/tenants/{tenant_id}", status_code=status.HTTP_204_NO_CONTENT)
def delete_tenant(tenant_id: str, session: SessionDep, admin: AdminDep) -> Response:
    """Delete a tenant that has no live jobs: it leaves the lists and its keys are revoked, but
    its jobs, usage and ledger stay, readable by admins (a soft delete: money is never erased).
    With live jobs it is a 409: cancel them, or let them end, first."""
    tenant = _tenant(session, tenant_id, lock=True)  # against placements
    tenant_id = tenant.id
    live = session.scalars(
        select(Job.id)
        .where(Job.tenant_id == tenant_id, Job.state.not_in(TERMINAL))
        .order_by(Job.created_at)
    ).all()
    if live:
        shown = ", ".join(live[:5]) + (f" and {len(live) - 5} more" if len(live) > 5 else "")
        raise Conflict(
            f"tenant {tenant_id} has {len(live)} live job(s) ({shown}); cancel them "
            "(POST /v1/jobs/{id}/cancel) or wait for them to end, then delete the tenant",
            field="tenant_id",
        )
    now = utcnow()
    for key in session.scalars(
        select(ApiKey).where(ApiKey.role == "tenant", ApiKey.scope == tenant_id)
    ):
        key.revoked_at = key.revoked_at or now
    tenant.deleted_at = now
    resources.audit(session, admin.key_id, "tenant.delete", "tenant", tenant_id)
    session.commit()
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.post("/api-keys", status_code=status.HTTP_201_CREATED, response_model=ApiKeyCreated)
def create_api_key(body: ApiKeyIn, session: SessionDep, admin: AdminDep) -> ApiKeyCreated:
    """Mint a key. Its token is in this response only; cpn keeps just a hash."""
    if body.role == "admin" and body.scope:
        raise Invalid("admin keys take no scope; leave `scope` out", field="scope")
    scoped = find_tenant(session, body.scope) if body.role == "tenant" and body.scope else None
    if body.role == "tenant" and (scoped is None or scoped.deleted_at is not None):
        raise Invalid("a tenant key needs `scope` = an existing tenant's id or name", field="scope")
    if scoped is not None:
        body = body.model_copy(update={"scope": scoped.id})  # keys are scoped by id
    if body.role == "provider":
        provider = find_provider(session, body.scope) if body.scope else None
        if provider is None:
            raise Invalid(
                "a provider key needs `scope` = an existing provider's id or name", field="scope"
            )
        body = body.model_copy(update={"scope": provider.id})
    if body.role == "agent" and (
        not body.scope or not session.scalar(select(Cluster.id).where(Cluster.name == body.scope))
    ):
        raise Invalid("an agent key needs `scope` = the name of an existing cluster", field="scope")
    if body.expires_at is not None and body.expires_at <= utcnow():
        raise Invalid(
            "expires_at is not in the future; give a later time, or none for no expiry",
            field="expires_at",
        )
    key, token = keys.create_key(
        session, body.role, body.scope, body.name, expires_at=body.expires_at
    )
    resources.audit(session, admin.key_id, "key.create", "api_key", key.id, role=body.role)
    session.commit()
    return ApiKeyCreated(**ApiKeyOut.model_validate(key).model_dump(), token=token)


@router.get("/api-keys", response_model=Page[ApiKeyOut])
def list_api_keys(
    session: SessionDep,
    _: AdminDep,
    page: PageDep,
    role: Annotated[str | None, Query(pattern="^(admin|tenant|agent|provider)$")] = None,
) -> Page[ApiKeyOut]:
    """Keys without their secrets."""
    stmt = select(ApiKey).order_by(ApiKey.created_at, ApiKey.id)
    if role:
        stmt = stmt.where(ApiKey.role == role)
    items, total = fetch_page(session, stmt, page)
    return Page(
        items=[ApiKeyOut.model_validate(k) for k in items],
        total=total,
        limit=page.limit,
        offset=page.offset,
    )


@router.delete("/api-keys/{key_id}", response_model=ApiKeyOut)
def revoke_api_key(key_id: str, session: SessionDep, admin: AdminDep) -> ApiKeyOut:
    """Revoke a key at once; it stays listed with its revocation time."""
    key = session.get(ApiKey, key_id)
    if key is None:
        raise NotFound(f"no API key with id {key_id!r}; list them with GET /v1/api-keys")
    if key.id == admin.key_id:
        raise Invalid("a key cannot revoke itself; use another admin key", field="key_id")
    key.revoked_at = key.revoked_at or utcnow()
    resources.audit(session, admin.key_id, "key.revoke", "api_key", key_id)
    session.commit()
    return ApiKeyOut.model_validate(key)


@router.get("/audit", response_model=Page[AuditOut])
def audit_log(session: SessionDep, _: AdminDep, page: PageDep) -> Page[AuditOut]:
    """Admin actions, newest first."""
    items, total = fetch_page(session, select(AuditLog).order_by(AuditLog.id.desc()), page)
    return Page(
        items=[AuditOut.model_validate(a) for a in items],
        total=total,
        limit=page.limit,
        offset=page.offset,
    )
