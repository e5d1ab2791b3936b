"""Admin API over WAN links: declared by admins, measured by agents, both kept."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Response, status
from sqlalchemy import or_, select

from api.deps import AdminDep, SessionDep
from api.pagination import PageDep, PageParams
from api.schemas import LinkIn, LinkOut, LinkPatch, Page, PortHolderOut, PortOut
from controller.network import allocations, resources
from controller.store.models import Link
from controller.values.errors import Invalid, NotFound
from scheduler.bandwidth import KBPS_PER_GBPS

router = APIRouter(prefix="/v1", tags=["links"])


def _out(link: Link) -> LinkOut:
    return LinkOut(
        id=link.id,
        src=link.src.name,
        dst=link.dst.name,
        source=link.source,
        bandwidth_gbps=link.bandwidth_gbps,
        free_gbps=link.free_gbps,
        rtt_ms=link.rtt_ms,
        loss=link.loss,
        egress_price_per_gb=link.egress_price_per_gb,
        measured_at=link.measured_at,
        pinned=link.pinned,
    )


def _get(session: SessionDep, link_id: str) -> Link:
    link = session.get(Link, link_id)
    if link is None:
        raise NotFound(f"no link with id {link_id!r}; list links with GET /v1/links", field="id")
    return link


@router.post("/links", status_code=status.HTTP_201_CREATED, response_model=list[LinkOut])
def declare_link(body: LinkIn, session: SessionDep, admin: AdminDep) -> list[LinkOut]:
    """Declare a link (both directions when `symmetric`); it counts until an agent measures one."""
    values = body.model_dump(exclude={"src", "dst", "symmetric"})
    pairs = [(body.src, body.dst)] + ([(body.dst, body.src)] if body.symmetric else [])
    links = [resources.declare_link(session, a, b, **values) for a, b in pairs]
    resources.audit(
        session,
        admin.key_id,
        "link.declare",
        "link",
        f"{body.src}->{body.dst}",
        **body.model_dump(),
    )
    session.commit()
    return [_out(link) for link in links]


@router.get("/links", response_model=Page[LinkOut])
def list_links(
    session: SessionDep,
    _: AdminDep,
    page: PageDep,
    view: Annotated[
        Literal["effective", "declared", "measured", "all"],
        Query(description="effective: one per direction, measured over declared."),
    ] = "effective",
    cluster: Annotated[
        str | None, Query(max_length=63, description="Touching this cluster.")
    ] = None,
) -> Page[LinkOut]:
    """Links between clusters with their source and time."""
    stmt = select(Link)
    if view in ("declared", "measured"):
        stmt = stmt.where(Link.source == view)
    if cluster:
        cid = resources.get_cluster(session, cluster).id
        stmt = stmt.where(or_(Link.src_cluster_id == cid, Link.dst_cluster_id == cid))
    links = list(session.scalars(stmt).unique().all())
    if view == "effective":
        links = resources.effective_links(links)
    else:
        links.sort(key=lambda k: (k.src.name, k.dst.name, k.source))
    return _slice([_out(k) for k in links], page)


def _slice(items: list[LinkOut], page: PageParams) -> Page[LinkOut]:
    return Page(
        items=items[page.offset : page.offset + page.limit],
        total=len(items),
        limit=page.limit,
        offset=page.offset,
    )


@router.get("/links/{link_id}", response_model=LinkOut)
def get_link(link_id: str, session: SessionDep, _: AdminDep) -> LinkOut:
    return _out(_get(session, link_id))


@router.patch("/links/{link_id}", response_model=LinkOut)
def patch_link(link_id: str, body: LinkPatch, session: SessionDep, admin: AdminDep) -> LinkOut:
    """Change a declared link; measured links belong to the agents."""
    link = _get(session, link_id)
    changes = body.model_dump(exclude_unset=True, exclude_none=True)
    if link.source == "measured" and set(changes) - {"egress_price_per_gb"}:  # agents own these
        raise Invalid(
            "measured links are written by agents; declare the link instead (POST /v1/links)",
            field="source",
        )
    for key, value in changes.items():
        setattr(link, key, value)
    resources.audit(session, admin.key_id, "link.update", "link", link_id, **changes)
    session.commit()
    return _out(link)


@router.delete("/links/{link_id}", status_code=status.HTTP_204_NO_CONTENT)
def delete_link(link_id: str, session: SessionDep, admin: AdminDep) -> Response:
    link = _get(session, link_id)
    session.delete(link)
    resources.audit(session, admin.key_id, "link.delete", "link", link_id)
    session.commit()
    return Response(status_code=status.HTTP_204_NO_CONTENT)


def _gbps(kbps: int | None) -> float | None:
    return None if kbps is None else kbps / KBPS_PER_GBPS


@router.get("/network/ports", response_model=Page[PortOut], tags=["links"])
def list_ports(session: SessionDep, _: AdminDep, page: PageDep) -> Page[PortOut]:
    """Each datacenter's uplink and downlink, by cluster: its declared capacity (the
    `uplink_gbps` / `downlink_gbps` labels, set with PATCH /v1/clusters/{name} or `cpn
    apply`), what placed jobs reserved of it and which jobs, and what is left."""
    found = allocations.ports(session)
    items = [
        PortOut(
            cluster=p.cluster,
            direction="up" if p.direction == "up" else "down",
            capacity_gbps=_gbps(p.capacity_kbps),
            measured_gbps=_gbps(p.carried_kbps),
            reserved_gbps=p.reserved_kbps / KBPS_PER_GBPS,
            free_gbps=_gbps(p.free_kbps),
            holders=[
                PortHolderOut(
                    job_id=h.job_id, tenant_id=h.tenant_id, reserved_gbps=h.kbps / KBPS_PER_GBPS
                )
                for h in p.holders
            ],
        )
        for p in found[page.offset : page.offset + page.limit]
    ]
    return Page(items=items, total=len(found), limit=page.limit, offset=page.offset)
