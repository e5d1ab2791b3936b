"""The pricing catalogue: admins set effective-dated prices, everyone reads what applies."""

from __future__ import annotations

from datetime import datetime, timedelta
from decimal import Decimal
from typing import Annotated

from fastapi import APIRouter, Depends, Query, status
from pydantic import AfterValidator
from sqlalchemy import select

from agents.protocol import in_utc_range
from api.deps import AdminDep, SessionDep, get_principal
from api.schemas import EgressPriceIn, EgressPriceOut, GpuPriceIn, GpuPriceOut, PricingOut
from controller.access.keys import Principal
from controller.network import resources
from controller.store.models import Cluster, EgressPrice, GpuPrice, utcnow
from controller.values.errors import Invalid

router = APIRouter(prefix="/v1/pricing", tags=["pricing"])
AnyKey = Annotated[Principal, Depends(get_principal)]
PAST_TOLERANCE = timedelta(seconds=60)
AtTime = Annotated[datetime, AfterValidator(in_utc_range)]
"""A time whose UTC instant cpn can compare with stored ones (years 1..9999)."""


def _effective(value: datetime | None) -> datetime:
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


@router.get("", response_model=PricingOut)
def current(
    session: SessionDep,
    _: AnyKey,
    at: Annotated[AtTime | None, Query(description="Prices in effect at this time.")] = None,
) -> PricingOut:
    """The prices that apply now (or at `at`), per cluster, GPU model and QoS class."""
    when = at if at is not None and at.tzinfo is not None else utcnow()
    names = dict(session.execute(select(Cluster.id, Cluster.name)).all())
    gpu_rows = session.scalars(
        select(GpuPrice)
        .where(GpuPrice.effective_from <= when)
        .order_by(GpuPrice.effective_from, GpuPrice.id)
    ).all()
    gpu: dict[tuple[str, str, str], GpuPriceOut] = {}
    for row in gpu_rows:
        gpu[(row.cluster_id, row.gpu_model, row.qos_class)] = GpuPriceOut(
            cluster=names.get(row.cluster_id, row.cluster_id),
            gpu_model=row.gpu_model,
            qos_class=row.qos_class,
            price_per_gpu_hour=float(row.price_per_gpu_hour),
            effective_from=row.effective_from,
        )
    eg_rows = session.scalars(
        select(EgressPrice)
        .where(EgressPrice.effective_from <= when)
        .order_by(EgressPrice.effective_from, EgressPrice.id)
    ).all()
    egress: dict[tuple[str, str], EgressPriceOut] = {}
    for e in eg_rows:
        egress[(e.src_cluster_id, e.dst_cluster_id)] = EgressPriceOut(
            src=names.get(e.src_cluster_id, e.src_cluster_id),
            dst=names.get(e.dst_cluster_id, e.dst_cluster_id),
            price_per_gb=float(e.price_per_gb),
            effective_from=e.effective_from,
        )
    return PricingOut(
        at=when,
        gpu=sorted(gpu.values(), key=lambda p: (p.cluster, p.gpu_model, p.qos_class)),
        egress=sorted(egress.values(), key=lambda p: (p.src, p.dst)),
    )


@router.post("/gpu", status_code=status.HTTP_201_CREATED, response_model=GpuPriceOut)
def set_gpu_price(body: GpuPriceIn, session: SessionDep, admin: AdminDep) -> GpuPriceOut:
    """Set a GPU-hour price from now (or a future time) on; earlier prices stay for history."""
    cluster = resources.get_cluster(session, body.cluster)
    at = _effective(body.effective_from)
    session.add(
        GpuPrice(
            cluster_id=cluster.id,
            gpu_model=body.gpu_model,
            qos_class=body.qos_class,
            price_per_gpu_hour=Decimal(str(body.price_per_gpu_hour)),
            effective_from=at,
        )
    )
    resources.audit(
        session, admin.key_id, "price.gpu", "cluster", body.cluster, **body.model_dump(mode="json")
    )
    session.commit()
    return GpuPriceOut(
        cluster=body.cluster,
        gpu_model=body.gpu_model,
        qos_class=body.qos_class,
        price_per_gpu_hour=body.price_per_gpu_hour,
        effective_from=at,
    )


@router.post("/egress", status_code=status.HTTP_201_CREATED, response_model=list[EgressPriceOut])
def set_egress_price(
    body: EgressPriceIn, session: SessionDep, admin: AdminDep
) -> list[EgressPriceOut]:
    """Set the per-GB price of traffic from `src` to `dst` (both ways when symmetric)."""
    if body.src == body.dst:
        raise Invalid("egress goes between two different clusters", field="dst")
    a, b = resources.get_cluster(session, body.src), resources.get_cluster(session, body.dst)
    at = _effective(body.effective_from)
    pairs = [(a, b)] + ([(b, a)] if body.symmetric else [])
    out = []
    for src, dst in pairs:
        session.add(
            EgressPrice(
                src_cluster_id=src.id,
                dst_cluster_id=dst.id,
                price_per_gb=Decimal(str(body.price_per_gb)),
                effective_from=at,
            )
        )
        out.append(
            EgressPriceOut(
                src=src.name, dst=dst.name, price_per_gb=body.price_per_gb, effective_from=at
            )
        )
    resources.audit(
        session,
        admin.key_id,
        "price.egress",
        "link",
        f"{body.src}->{body.dst}",
        **body.model_dump(mode="json"),
    )
    session.commit()
    return out
