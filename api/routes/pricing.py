"""The pricing catalogue: effective-dated prices, everyone reads what applies. Admins price
the operator's clusters; a provider posts the offers of its own (another's cluster is a 404
to it, and a provider's cluster is its own to price: an admin gets a 409)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Depends, Query, status
from pydantic import AfterValidator
from sqlalchemy import select

from agents.protocol import in_utc_range
from api.deps import PricerDep, SessionDep, get_principal
from api.schemas import (
    BandwidthPriceIn,
    BandwidthPriceOut,
    EgressPriceIn,
    EgressPriceOut,
    GpuPriceIn,
    GpuPriceOut,
    PricingOut,
)
from controller.access.keys import Principal
from controller.network import resources
from controller.store.models import (
    BandwidthPrice,
    Cluster,
    EgressPrice,
    GpuPrice,
    Provider,
    Sla,
    utcnow,
)
from controller.values.errors import Conflict, Invalid, NotFound

router = APIRouter(prefix="/v1/pricing", tags=["pricing"])
AnyKey = Annotated[Principal, Depends(get_principal)]
PAST_TOLERANCE = timedelta(seconds=60)
AtTime = Annotated[datetime, AfterValidator(in_utc_range)]
"""A time whose UTC instant cpn can compare with stored ones (years 1..9999)."""


def effective(value: datetime | None) -> datetime:
    now = utcnow()
    if value is None:
        return now
    if value.tzinfo is None:
        raise Invalid("give effective_from with a timezone, e.g. ...Z", field="effective_from")
    if value < now - PAST_TOLERANCE:
        raise Invalid(
            "effective_from is in the past; prices change from now on so history is never "
            "rewritten: leave it out or give a future time",
            field="effective_from",
        )
    return value


def _may_price(session: SessionDep, who: Principal, cluster: Cluster, field: str) -> None:
    """A provider prices its own clusters (another's is a 404, as if it did not exist); an
    admin the operator's (a provider's is a 409: its prices are the provider's offers)."""
    if who.role == "provider" and cluster.provider_id != who.scope:
        raise NotFound(
            f"no cluster named {cluster.name!r} among yours; list them with "
            "GET /v1/providers/{id}/clusters",
            field=field,
        )
    if who.role == "admin" and cluster.provider_id is not None:
        raise Conflict(
            f"cluster {cluster.name!r} belongs to provider {_provider_name(session, cluster)!r}, "
            "whose offers price it; its provider posts them (or PUT /v1/providers/{id}/clusters "
            "gives it back to the operator)",
            field=field,
        )


def _provider_name(session: SessionDep, cluster: Cluster) -> str | None:
    if cluster.provider_id is None:
        return None
    return session.scalar(select(Provider.name).where(Provider.id == cluster.provider_id))


Row = TypeVar("Row", GpuPrice, EgressPrice, BandwidthPrice, Sla)


def in_effect(rows: Iterable[Row], key: Callable[[Row], tuple[str, ...]], at: datetime,
               later: bool) -> list[Row]:  # fmt: skip
    """Of rows in effective order: each key's row in effect at `at`, and with `later` the
    rows that take effect after it (prices here, a provider's SLAs too)."""
    now: dict[tuple[str, ...], Row] = {}
    after: list[Row] = []
    for row in rows:
        if row.effective_from <= at:
            now[key(row)] = row
        elif later:
            after.append(row)
    return list(now.values()) + after


def catalogue(
    session: SessionDep, at: datetime, clusters: Collection[str] | None = None, later: bool = False
) -> PricingOut:
    """The catalogue as the API shows it: every price in effect at `at` (and with `later`
    those that take effect after), of every cluster or of the cluster ids `clusters` (egress
    and bandwidth by the cluster they leave), with who offers each."""
    names = dict(session.execute(select(Cluster.id, Cluster.name)).all())
    parties = dict(session.execute(select(Provider.id, Provider.name)).all())

    def rows(model: type[Row], column: Any) -> Sequence[Row]:
        query = select(model).order_by(model.effective_from, model.id)
        if clusters is not None:
            query = query.where(column.in_(clusters))
        return session.scalars(query).all()

    def party(row: GpuPrice | EgressPrice | BandwidthPrice) -> str | None:
        return parties.get(row.provider_id) if row.provider_id else None

    gpu = [
        GpuPriceOut(
            cluster=names.get(r.cluster_id, r.cluster_id),
            gpu_model=r.gpu_model,
            qos_class=r.qos_class,
            price_per_gpu_hour=float(r.price_per_gpu_hour),
            effective_from=r.effective_from,
            provider=party(r),
            gpus=r.gpus,
            until=r.until,
            min_hours=float(r.min_hours) if r.min_hours is not None else None,
        )
        for r in in_effect(
            rows(GpuPrice, GpuPrice.cluster_id),
            lambda r: (r.cluster_id, r.gpu_model, r.qos_class),
            at,
            later,
        )
    ]
    egress = [
        EgressPriceOut(
            src=names.get(e.src_cluster_id, e.src_cluster_id),
            dst=names.get(e.dst_cluster_id, e.dst_cluster_id),
            price_per_gb=float(e.price_per_gb),
            effective_from=e.effective_from,
            provider=party(e),
        )
        for e in in_effect(
            rows(EgressPrice, EgressPrice.src_cluster_id),
            lambda e: (e.src_cluster_id, e.dst_cluster_id),
            at,
            later,
        )
    ]
    bandwidth = [
        BandwidthPriceOut(
            cluster=names.get(b.cluster_id, b.cluster_id),
            price_per_gbps_hour=float(b.price_per_gbps_hour),
            effective_from=b.effective_from,
            provider=party(b),
        )
        for b in in_effect(
            rows(BandwidthPrice, BandwidthPrice.cluster_id), lambda b: (b.cluster_id,), at, later
        )
    ]
    return PricingOut(
        at=at,
        gpu=sorted(gpu, key=lambda p: (p.cluster, p.gpu_model, p.qos_class, p.effective_from)),
        egress=sorted(egress, key=lambda p: (p.src, p.dst, p.effective_from)),
        bandwidth=sorted(bandwidth, key=lambda p: (p.cluster, p.effective_from)),
    )


@router.get("", response_model=PricingOut)
def current(
    session: SessionDep,
    _: AnyKey,
    at: Annotated[AtTime | None, Query(description="Prices in effect at this time.")] = None,
) -> PricingOut:
    """The prices that apply now (or at `at`), per cluster, GPU model and QoS class."""
    return catalogue(session, at if at is not None and at.tzinfo is not None else utcnow())


@router.post("/gpu", status_code=status.HTTP_201_CREATED, response_model=GpuPriceOut)
def set_gpu_price(body: GpuPriceIn, session: SessionDep, who: PricerDep) -> GpuPriceOut:
    """Set a GPU-hour price from now (or a future time) on; earlier prices stay for history.
    A provider's price is its offer, on its own clusters only."""
    cluster = resources.get_cluster(session, body.cluster)
    _may_price(session, who, cluster, "cluster")
    at = effective(body.effective_from)
    if body.until is not None and (body.until.tzinfo is None or body.until <= at):
        raise Invalid(
            "until must be a time with a timezone after the offer takes effect", field="until"
        )
    session.add(
        GpuPrice(
            cluster_id=cluster.id,
            gpu_model=body.gpu_model,
            qos_class=body.qos_class,
            price_per_gpu_hour=Decimal(str(body.price_per_gpu_hour)),
            effective_from=at,
            provider_id=cluster.provider_id,
            gpus=body.gpus,
            until=body.until,
            min_hours=Decimal(str(body.min_hours)) if body.min_hours is not None else None,
        )
    )
    resources.audit(
        session, who.key_id, "price.gpu", "cluster", body.cluster, **body.model_dump(mode="json")
    )
    session.commit()
    return GpuPriceOut(
        cluster=body.cluster,
        gpu_model=body.gpu_model,
        qos_class=body.qos_class,
        price_per_gpu_hour=body.price_per_gpu_hour,
        effective_from=at,
        provider=_provider_name(session, cluster),
        gpus=body.gpus,
        until=body.until,
        min_hours=body.min_hours,
    )


@router.post("/egress", status_code=status.HTTP_201_CREATED, response_model=list[EgressPriceOut])
def set_egress_price(
    body: EgressPriceIn, session: SessionDep, who: PricerDep
) -> list[EgressPriceOut]:
    """Set the per-GB price of traffic from `src` to `dst` (both ways when symmetric). Egress
    is priced by the owner of the cluster it leaves: a provider prices its own uplinks."""
    if body.src == body.dst:
        raise Invalid("egress goes between two different clusters", field="dst")
    a, b = resources.get_cluster(session, body.src), resources.get_cluster(session, body.dst)
    _may_price(session, who, a, "src")
    if body.symmetric and b.provider_id != a.provider_id:
        raise Invalid(
            f"{body.dst!r} has another owner, who prices what leaves it; send symmetric: false",
            field="symmetric",
        )
    at = effective(body.effective_from)
    pairs = [(a, b)] + ([(b, a)] if body.symmetric else [])
    out = []
    for src, dst in pairs:
        session.add(
            EgressPrice(
                src_cluster_id=src.id,
                dst_cluster_id=dst.id,
                price_per_gb=Decimal(str(body.price_per_gb)),
                effective_from=at,
                provider_id=src.provider_id,
            )
        )
        out.append(
            EgressPriceOut(
                src=src.name,
                dst=dst.name,
                price_per_gb=body.price_per_gb,
                effective_from=at,
                provider=_provider_name(session, src),
            )
        )
    resources.audit(
        session,
        who.key_id,
        "price.egress",
        "link",
        f"{body.src}->{body.dst}",
        **body.model_dump(mode="json"),
    )
    session.commit()
    return out


@router.post("/bandwidth", status_code=status.HTTP_201_CREATED, response_model=BandwidthPriceOut)
def set_bandwidth_price(
    body: BandwidthPriceIn, session: SessionDep, who: PricerDep
) -> BandwidthPriceOut:
    """Set the price per Gbit/s-hour of WAN rate a job reserves on the cluster's ports (its
    uplink and downlink), from now (or a future time) on: a job pays it for the rate its
    plan holds there while it runs, and its quote prices it."""
    cluster = resources.get_cluster(session, body.cluster)
    _may_price(session, who, cluster, "cluster")
    at = effective(body.effective_from)
    session.add(
        BandwidthPrice(
            cluster_id=cluster.id,
            price_per_gbps_hour=Decimal(str(body.price_per_gbps_hour)),
            effective_from=at,
            provider_id=cluster.provider_id,
        )
    )
    resources.audit(
        session,
        who.key_id,
        "price.bandwidth",
        "cluster",
        body.cluster,
        **body.model_dump(mode="json"),
    )
    session.commit()
    return BandwidthPriceOut(
        cluster=body.cluster,
        price_per_gbps_hour=body.price_per_gbps_hour,
        effective_from=at,
        provider=_provider_name(session, cluster),
    )
