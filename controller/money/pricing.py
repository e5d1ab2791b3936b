"""The pricing catalogue: effective-dated GPU-hour and egress prices.

A price row applies from its `effective_from` until the next row of the same key, so history
is never rewritten and any period can be priced by splitting it at price changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal

from sqlalchemy import select
from sqlalchemy.orm import Session

from controller.store.models import BandwidthPrice, EgressPrice, GpuPrice
from controller.values.errors import NotFound


@dataclass(frozen=True)
class PricedSpan:
    """A part of a period with one price: [start, end) at `price` per unit."""

    start: datetime
    end: datetime
    price: Decimal


def spans(
    history: Sequence[tuple[datetime, Decimal]], start: datetime, end: datetime
) -> list[PricedSpan]:
    """Split [start, end) at the price changes in `history` (sorted by time).

    Pure: the caller fetched the history. A period starting before the first price is an error
    the caller must prevent (nothing may run unpriced).
    """
    out: list[PricedSpan] = []
    current: Decimal | None = None
    cursor = start
    for at, price in history:
        if at <= start:
            current = price
            continue
        if at >= end:
            break
        if current is None:
            raise LookupError(f"no price in effect at {start.isoformat()}")
        out.append(PricedSpan(cursor, at, current))
        cursor, current = at, price
    if current is None:
        raise LookupError(f"no price in effect at {start.isoformat()}")
    if cursor < end or not out:
        out.append(PricedSpan(cursor, end, current))
    return out


def gpu_price_history(
    session: Session, cluster_id: str, gpu_model: str, qos_class: str
) -> list[tuple[datetime, Decimal]]:
    rows = session.execute(
        select(GpuPrice.effective_from, GpuPrice.price_per_gpu_hour)
        .where(
            GpuPrice.cluster_id == cluster_id,
            GpuPrice.gpu_model == gpu_model,
            GpuPrice.qos_class == qos_class,
        )
        .order_by(GpuPrice.effective_from, GpuPrice.id)
    ).all()
    return [(at, Decimal(p)) for at, p in rows]


def egress_price_history(
    session: Session, src_cluster_id: str, dst_cluster_id: str
) -> list[tuple[datetime, Decimal]]:
    rows = session.execute(
        select(EgressPrice.effective_from, EgressPrice.price_per_gb)
        .where(
            EgressPrice.src_cluster_id == src_cluster_id,
            EgressPrice.dst_cluster_id == dst_cluster_id,
        )
        .order_by(EgressPrice.effective_from, EgressPrice.id)
    ).all()
    return [(at, Decimal(p)) for at, p in rows]


def bandwidth_price_history(session: Session, cluster_id: str) -> list[tuple[datetime, Decimal]]:
    rows = session.execute(
        select(BandwidthPrice.effective_from, BandwidthPrice.price_per_gbps_hour)
        .where(BandwidthPrice.cluster_id == cluster_id)
        .order_by(BandwidthPrice.effective_from, BandwidthPrice.id)
    ).all()
    return [(at, Decimal(p)) for at, p in rows]


def current_bandwidth_prices(session: Session, at: datetime) -> dict[str, Decimal]:
    """cluster_id -> price per reserved Gbit/s-hour in effect at `at`."""
    out: dict[str, Decimal] = {}
    rows = session.execute(
        select(BandwidthPrice.cluster_id, BandwidthPrice.price_per_gbps_hour)
        .where(BandwidthPrice.effective_from <= at)
        .order_by(BandwidthPrice.effective_from, BandwidthPrice.id)
    )
    for cluster_id, price in rows:
        out[cluster_id] = Decimal(price)
    return out


def priced_part(
    history: Sequence[tuple[datetime, Decimal]], start: datetime, end: datetime
) -> list[PricedSpan]:
    """`spans` of [start, end) from the first price on: what has no price before it (a
    reservation made before its cluster's bandwidth was priced) is free, not an error."""
    if not history or history[0][0] >= end:
        return []
    return spans(history, max(start, history[0][0]), end)


def price_at(history: Sequence[tuple[datetime, Decimal]], at: datetime) -> Decimal | None:
    current: Decimal | None = None
    for when, price in history:
        if when > at:
            break
        current = price
    return current


@dataclass(frozen=True)
class GpuOffer:
    """The GPU price in effect, with what the offer sells: at most `gpus` at once (None:
    all), new placements until `until` (None: open)."""

    price: Decimal
    gpus: int | None = None
    until: datetime | None = None
    min_hours: Decimal | None = None


def current_gpu_offers(session: Session, at: datetime) -> dict[tuple[str, str, str], GpuOffer]:
    """(cluster_id, gpu_model, qos_class) -> the offer in effect at `at`; an offer whose
    window closed by then is left out (its GPUs take no new placements at that class)."""
    out: dict[tuple[str, str, str], GpuOffer] = {}
    rows = session.execute(
        select(
            GpuPrice.cluster_id,
            GpuPrice.gpu_model,
            GpuPrice.qos_class,
            GpuPrice.price_per_gpu_hour,
            GpuPrice.gpus,
            GpuPrice.until,
            GpuPrice.min_hours,
        )
        .where(GpuPrice.effective_from <= at)
        .order_by(GpuPrice.effective_from, GpuPrice.id)
    )
    for cluster_id, gpu_model, qos_class, price, gpus, until, least in rows:
        offer = GpuOffer(Decimal(price), gpus, until, Decimal(least) if least else None)
        out[(cluster_id, gpu_model, qos_class)] = offer
    return {k: o for k, o in out.items() if o.until is None or o.until > at}


def offer_at(
    session: Session, cluster_id: str, gpu_model: str, qos_class: str, at: datetime
) -> GpuPrice | None:
    """The GPU price row in effect at `at` (the offer a run placed then was placed at)."""
    return session.scalars(
        select(GpuPrice)
        .where(
            GpuPrice.cluster_id == cluster_id,
            GpuPrice.gpu_model == gpu_model,
            GpuPrice.qos_class == qos_class,
            GpuPrice.effective_from <= at,
        )
        .order_by(GpuPrice.effective_from.desc(), GpuPrice.id.desc())
        .limit(1)
    ).first()


def current_egress_prices(session: Session, at: datetime) -> dict[tuple[str, str], Decimal]:
    """(src_cluster_id, dst_cluster_id) -> price per GB in effect at `at`."""
    out: dict[tuple[str, str], Decimal] = {}
    rows = session.execute(
        select(EgressPrice.src_cluster_id, EgressPrice.dst_cluster_id, EgressPrice.price_per_gb)
        .where(EgressPrice.effective_from <= at)
        .order_by(EgressPrice.effective_from, EgressPrice.id)
    )
    for src, dst, price in rows:
        out[(src, dst)] = Decimal(price)
    return out


def require(price: Decimal | None, what: str) -> Decimal:
    if price is None:
        raise NotFound(f"no price is set for {what}; an admin must add one (POST /v1/pricing/gpu)")
    return price
