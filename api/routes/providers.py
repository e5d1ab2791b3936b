"""Resource providers: parties that own clusters, offer them at their own prices and are paid.

Admins create providers, assign them clusters and record payouts; a provider (its own key)
reads its clusters' utilisation, its offers and its statement, and posts offers through the
catalogue (`POST /v1/pricing/gpu|egress` on its own clusters). Another provider is a 404.
"""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Annotated

from fastapi import APIRouter, Depends, Query, status
from pydantic import AfterValidator
from sqlalchemy import select

from agents.protocol import in_utc_range
from api.deps import AdminDep, SessionDep, require
from api.pagination import PageDep, fetch_page
from api.routes.pricing import catalogue, effective, in_effect
from api.schemas import (
    Page,
    PayoutIn,
    PayoutOut,
    PricingOut,
    ProviderClusterOut,
    ProviderClustersIn,
    ProviderGpusOut,
    ProviderIn,
    ProviderOut,
    SlaIn,
    SlaOut,
    StatementLineOut,
    StatementOut,
)
from controller.access.keys import Principal
from controller.access.tenancy import find_provider
from controller.money import settlement
from controller.money.amounts import q6
from controller.network import resources
from controller.store.db import lock_for_update
from controller.store.models import (
    Cluster,
    Payout,
    Provider,
    Sla,
    utcnow,
)
from controller.values.errors import Conflict, Invalid, NotFound

router = APIRouter(prefix="/v1/providers", tags=["providers"])
ProviderReader = Annotated[Principal, Depends(require("provider", "admin"))]
ProviderDep = Annotated[Principal, Depends(require("provider"))]
"""A provider (scoped to itself) or an admin."""
AtTime = Annotated[datetime, AfterValidator(in_utc_range)]
ME = "me"
"""What a provider's key may call itself in a path: `GET /v1/providers/me/statement`."""


def visible(session: SessionDep, ref: str, principal: Principal, *, lock: bool = False) -> Provider:
    """The provider a path names by id, name or `me` (a provider's key), if the caller may
    read it (another's: 404);
    with `lock`, its row is held until the transaction ends (payouts, ownership)."""
    if lock:
        lock_for_update(session)
    if ref == ME and principal.role == "provider" and principal.scope:
        ref = principal.scope
    provider = find_provider(session, ref, lock=lock)
    if provider is None or (principal.role == "provider" and principal.scope != provider.id):
        raise NotFound(
            f"no provider {ref!r} (an id or a name); admins list them with GET /v1/providers",
            field="provider_id",
        )
    return provider


def _out(session: SessionDep, provider: Provider) -> ProviderOut:
    names = session.scalars(
        select(Cluster.name).where(Cluster.provider_id == provider.id).order_by(Cluster.name)
    ).all()
    return ProviderOut(
        id=provider.id,
        name=provider.name,
        fee_rate=float(provider.fee_rate),
        clusters=list(names),
        balance=str(settlement.balance(session, provider.id)),
        created_at=provider.created_at,
    )


def _assign(session: SessionDep, provider: Provider, names: list[str]) -> None:
    """Make `names` exactly the clusters `provider` owns; a cluster another provider owns is
    a 409 (that provider must be relieved of it first)."""
    wanted = {resources.get_cluster(session, n, for_update=True).name for n in names}
    for cluster in session.scalars(
        select(Cluster).where((Cluster.name.in_(wanted)) | (Cluster.provider_id == provider.id))
    ):
        if cluster.name in wanted:
            if cluster.provider_id not in (None, provider.id):
                raise Conflict(
                    f"cluster {cluster.name!r} belongs to another provider; take it from that "
                    "provider first (PUT /v1/providers/{id}/clusters)",
                    field="clusters",
                )
            cluster.provider_id = provider.id
        else:
            cluster.provider_id = None


@router.post("", status_code=status.HTTP_201_CREATED, response_model=ProviderOut)
def create_provider(body: ProviderIn, session: SessionDep, admin: AdminDep) -> ProviderOut:
    """Create a provider, with the platform's fee on its sales and the clusters it owns; mint
    its key with POST /v1/api-keys (role `provider`, scope its name)."""
    if session.scalar(select(Provider.id).where(Provider.name == body.name)):
        raise Conflict(f"a provider named {body.name!r} exists; pick another name", field="name")
    provider = Provider(name=body.name, fee_rate=Decimal(str(body.fee_rate)))
    session.add(provider)
    session.flush()
    _assign(session, provider, body.clusters)
    resources.audit(
        session, admin.key_id, "provider.create", "provider", provider.id, **body.model_dump()
    )
    session.commit()
    return _out(session, provider)


@router.get("", response_model=Page[ProviderOut])
def list_providers(session: SessionDep, _: AdminDep, page: PageDep) -> Page[ProviderOut]:
    """Every provider with its clusters and what it is owed: the admins' market view."""
    items, total = fetch_page(session, select(Provider).order_by(Provider.name), page)
    return Page(
        items=[_out(session, p) for p in items], total=total, limit=page.limit, offset=page.offset
    )


@router.get("/{provider_id}", response_model=ProviderOut)
def get_provider(provider_id: str, session: SessionDep, who: ProviderReader) -> ProviderOut:
    return _out(session, visible(session, provider_id, who))


@router.put("/{provider_id}/clusters", response_model=ProviderOut)
def set_clusters(
    provider_id: str, body: ProviderClustersIn, session: SessionDep, admin: AdminDep
) -> ProviderOut:
    """Set the clusters a provider owns. Prices already in the catalogue stay until the new
    owner posts its own; charges are credited to whoever owns a cluster when they are priced."""
    provider = visible(session, provider_id, admin, lock=True)
    _assign(session, provider, body.clusters)
    resources.audit(
        session, admin.key_id, "provider.clusters", "provider", provider.id, clusters=body.clusters
    )
    session.commit()
    return _out(session, provider)


@router.get("/{provider_id}/clusters", response_model=list[ProviderClusterOut])
def provider_clusters(
    provider_id: str, session: SessionDep, who: ProviderReader
) -> list[ProviderClusterOut]:
    """The provider's clusters, their GPUs and how many are in use now."""
    provider = visible(session, provider_id, who)
    out = []
    for c in session.scalars(
        select(Cluster).where(Cluster.provider_id == provider.id).order_by(Cluster.name)
    ):
        gpus = [
            ProviderGpusOut(
                model=g.model, count=g.count, allocatable=g.allocatable, in_use=g.in_use
            )
            for g in c.gpus
            if not g.missing
        ]
        allocatable = sum(g.allocatable for g in gpus)
        out.append(
            ProviderClusterOut(
                name=c.name,
                region=c.region,
                state=c.state.value,
                cordoned=c.cordoned,
                gpus=gpus,
                utilization=sum(g.in_use for g in gpus) / allocatable if allocatable else None,
            )
        )
    return out


@router.get("/{provider_id}/offers", response_model=PricingOut)
def offers(provider_id: str, session: SessionDep, who: ProviderReader) -> PricingOut:
    """Every price row of the provider's clusters in effect now and later: its offers (and
    the operator's prices it has not replaced yet)."""
    provider = visible(session, provider_id, who)
    ids = session.scalars(select(Cluster.id).where(Cluster.provider_id == provider.id)).all()
    return catalogue(session, utcnow(), clusters=ids, later=True)


@router.post("/{provider_id}/slas", status_code=status.HTTP_201_CREATED, response_model=SlaOut)
def post_sla(provider_id: str, body: SlaIn, session: SessionDep, who: ProviderDep) -> SlaOut:
    """Promise a cluster's uptime and/or its uplink's bandwidth from now (or a future time)
    on, and the share of a run's charges there refunded when the agents measure less."""
    provider = visible(session, provider_id, who)
    cluster = resources.get_cluster(session, body.cluster)
    if cluster.provider_id != provider.id:
        raise NotFound(f"no cluster named {body.cluster!r} among yours", field="cluster")
    if body.uptime is None and body.uplink_gbps is None:
        raise Invalid("promise something: give uptime, uplink_gbps or both", field="uptime")
    at = effective(body.effective_from)
    session.add(
        Sla(
            cluster_id=cluster.id,
            provider_id=provider.id,
            uptime=Decimal(str(body.uptime)) if body.uptime is not None else None,
            uplink_gbps=body.uplink_gbps,
            credit_rate=Decimal(str(body.credit_rate)),
            effective_from=at,
        )
    )
    resources.audit(
        session, who.key_id, "provider.sla", "cluster", cluster.name, **body.model_dump(mode="json")
    )
    session.commit()
    return SlaOut(**body.model_dump(exclude={"effective_from"}), effective_from=at)


@router.get("/{provider_id}/slas", response_model=list[SlaOut])
def slas(provider_id: str, session: SessionDep, who: ProviderReader) -> list[SlaOut]:
    """The SLAs of the provider's clusters in effect now and later."""
    provider = visible(session, provider_id, who)
    now = utcnow()
    names = dict(
        session.execute(
            select(Cluster.id, Cluster.name).where(Cluster.provider_id == provider.id)
        ).all()
    )
    rows = session.scalars(
        select(Sla).where(Sla.cluster_id.in_(names)).order_by(Sla.effective_from, Sla.id)
    ).all()
    return [
        SlaOut(
            cluster=names[r.cluster_id],
            uptime=float(r.uptime) if r.uptime is not None else None,
            uplink_gbps=r.uplink_gbps,
            credit_rate=float(r.credit_rate),
            effective_from=r.effective_from,
        )
        for r in in_effect(rows, lambda r: (r.cluster_id,), now, later=True)
    ]


@router.get("/{provider_id}/statement", response_model=StatementOut)
def statement(
    provider_id: str,
    session: SessionDep,
    who: ProviderReader,
    start: Annotated[AtTime | None, Query(description="From (UTC); the start if left out.")] = (
        None
    ),
    end: Annotated[AtTime | None, Query(description="Until (UTC, excluded); now if left out.")] = (
        None
    ),
) -> StatementOut:
    """What the provider earned in [start, end): gross, the platform's fee and net per
    cluster and kind, exact decimals; its payouts in the period and its balance now."""
    for name, value in (("start", start), ("end", end)):
        if value is not None and value.tzinfo is None:
            raise Invalid(f"give {name} with a timezone, e.g. ...Z", field=name)
    until = end or utcnow()
    if start is not None and start >= until:
        raise Invalid("start must be before end", field="start")
    provider = visible(session, provider_id, who)
    st = settlement.statement(session, provider, start, until)
    return StatementOut(
        provider=st.provider,
        start=st.start,
        end=st.end,
        lines=[
            StatementLineOut(
                cluster=x.cluster, kind=x.kind, gross=str(x.gross), fee=str(x.fee), net=str(x.net)
            )
            for x in st.lines
        ],
        gross=str(st.gross),
        fee=str(st.fee),
        net=str(st.net),
        paid=str(st.paid),
        balance=str(st.balance),
    )


@router.post(
    "/{provider_id}/payouts", status_code=status.HTTP_201_CREATED, response_model=PayoutOut
)
def pay_out(provider_id: str, body: PayoutIn, session: SessionDep, admin: AdminDep) -> PayoutOut:
    """Record money paid to the provider; never more than it is owed (409)."""
    provider = visible(session, provider_id, admin, lock=True)
    amount = Decimal(body.amount)
    if amount <= 0:
        raise Invalid("amount must be more than 0", field="amount")
    payout = settlement.pay_out(session, provider, amount, body.reference, None)
    resources.audit(
        session, admin.key_id, "provider.payout", "provider", provider.id, amount=str(amount)
    )
    session.commit()
    return PayoutOut(
        id=payout.id, amount=str(payout.amount), reference=payout.reference, at=payout.at
    )


@router.get("/{provider_id}/payouts", response_model=Page[PayoutOut])
def payouts(
    provider_id: str, session: SessionDep, who: ProviderReader, page: PageDep
) -> Page[PayoutOut]:
    """The provider's payouts, newest first."""
    provider = visible(session, provider_id, who)
    items, total = fetch_page(
        session,
        select(Payout).where(Payout.provider_id == provider.id).order_by(Payout.id.desc()),
        page,
    )
    return Page(
        items=[
            PayoutOut(
                id=p.id, amount=str(q6(Decimal(str(p.amount)))), reference=p.reference, at=p.at
            )
            for p in items
        ],
        total=total,
        limit=page.limit,
        offset=page.offset,
    )
