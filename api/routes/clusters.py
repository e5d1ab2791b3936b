"""Admin API over clusters: CRUD, cordon/uncordon/drain, transitions, GPU views."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Query, Request, Response, status
from sqlalchemy import select
from sqlalchemy.orm import selectinload

from api.deps import AdminDep, SessionDep, app_state
from api.pagination import PageDep, fetch_page
from api.schemas import (
    ClusterIn,
    ClusterOut,
    ClusterPatch,
    GpuOut,
    GpuRow,
    GpuTotal,
    Page,
    TransitionOut,
)
from controller.access import keys
from controller.network import resources
from controller.network.labels import check_labels
from controller.store.models import Cluster, ClusterGpus, ClusterTransition
from controller.values.errors import Invalid, PreconditionFailed

router = APIRouter(prefix="/v1", tags=["clusters"])

StateFilter = Annotated[
    str | None, Query(pattern="^(PENDING|READY|SUSPECT|DOWN)$", description="Only this state.")
]


def _out(cluster: Cluster, response: Response | None = None) -> ClusterOut:
    if response is not None:
        response.headers["ETag"] = f'"{cluster.version}"'
    return ClusterOut.model_validate(cluster)


@router.post("/clusters", status_code=status.HTTP_201_CREATED, response_model=ClusterOut)
def create_cluster(
    body: ClusterIn, session: SessionDep, admin: AdminDep, response: Response
) -> ClusterOut:
    """Register a datacenter cluster; it stays PENDING until its agent's first heartbeat."""
    cluster = resources.create_cluster(
        session, body.name, body.region, body.labels, pinned_probe_url=body.pinned_probe_url
    )
    pin = {"pinned_probe_url": body.pinned_probe_url} if body.pinned_probe_url else {}
    resources.audit(
        session, admin.key_id, "cluster.create", "cluster", body.name, region=body.region, **pin
    )
    session.commit()
    session.refresh(cluster)
    return _out(cluster, response)


@router.get("/clusters", response_model=Page[ClusterOut])
def list_clusters(
    session: SessionDep,
    _: AdminDep,
    page: PageDep,
    state: StateFilter = None,
    region: Annotated[str | None, Query(max_length=63)] = None,
) -> Page[ClusterOut]:
    """Clusters by name, with their GPUs and lease state."""
    stmt = select(Cluster).options(selectinload(Cluster.gpus)).order_by(Cluster.name)
    if state:
        stmt = stmt.where(Cluster.state == state)
    if region:
        stmt = stmt.where(Cluster.region == region)
    items, total = fetch_page(session, stmt, page)
    return Page(items=[_out(c) for c in items], total=total, limit=page.limit, offset=page.offset)


@router.get("/clusters/{name}", response_model=ClusterOut)
def get_cluster(name: str, session: SessionDep, _: AdminDep, response: Response) -> ClusterOut:
    """One cluster; its ETag is the version to send in If-Match when patching. It changes
    with the cluster's settings and state, not with each heartbeat."""
    return _out(resources.get_cluster(session, name), response)


@router.patch("/clusters/{name}", response_model=ClusterOut)
def patch_cluster(
    name: str,
    body: ClusterPatch,
    session: SessionDep,
    admin: AdminDep,
    request: Request,
    response: Response,
    if_match: Annotated[
        str | None, Header(description="ETag from a GET: refuse if changed.")
    ] = None,
) -> ClusterOut:
    """Change region, labels or the pinned probe URL (null unpins); with If-Match, only if
    nobody changed it since you read it."""
    cluster = resources.get_cluster(session, name, for_update=True)
    if if_match is not None and if_match.strip('W/"') != str(cluster.version):
        raise PreconditionFailed(
            f"cluster {name!r} changed (version {cluster.version}); GET it again and retry",
            field="If-Match",
        )
    changes = body.model_dump(exclude_unset=True, exclude_none=True)
    if "labels" in changes:
        check_labels(changes["labels"])
    for key, value in changes.items():
        setattr(cluster, key, value)
    pinned = "pinned_probe_url" in body.model_fields_set  # null is meaningful here: it unpins
    if pinned:
        cluster.pinned_probe_url = body.pinned_probe_url
        changes["pinned_probe_url"] = body.pinned_probe_url
    resources.audit(session, admin.key_id, "cluster.update", "cluster", name, **changes)
    session.commit()
    if pinned:  # agents' next acks must list the new URL, not the cached one
        app_state(request).peers.invalidate()
    session.refresh(cluster)
    return _out(cluster, response)


@router.delete("/clusters/{name}", status_code=status.HTTP_204_NO_CONTENT)
def delete_cluster(name: str, session: SessionDep, admin: AdminDep) -> Response:
    """Remove a cluster, its GPUs and its links, and revoke its agent keys; refused while its
    GPUs are in use."""
    cluster = resources.get_cluster(session, name, for_update=True)
    busy = sum(g.in_use for g in cluster.gpus)
    if busy:
        raise Invalid(
            f"cluster {name!r} has {busy} GPUs in use; drain it and wait before deleting",
            field="name",
        )
    session.delete(cluster)
    # Its agent keys die with it: a cluster re-created under this name must not accept them.
    revoked = keys.revoke_scope(session, "agent", name)
    resources.audit(
        session,
        admin.key_id,
        "cluster.delete",
        "cluster",
        name,
        revoked_keys=[k.id for k in revoked],
    )
    session.commit()
    return Response(status_code=status.HTTP_204_NO_CONTENT)


def _set_flags(
    name: str, session: SessionDep, actor: str, action: str, *, cordoned: bool, draining: bool
) -> ClusterOut:
    cluster = resources.get_cluster(session, name, for_update=True)
    cluster.cordoned, cluster.draining = cordoned, draining
    resources.audit(session, actor, action, "cluster", name)
    session.commit()
    session.refresh(cluster)
    return _out(cluster)


@router.post("/clusters/{name}/cordon", response_model=ClusterOut)
def cordon(name: str, session: SessionDep, admin: AdminDep) -> ClusterOut:
    """Offer no more GPUs of this cluster to new work; running work stays."""
    return _set_flags(name, session, admin.key_id, "cluster.cordon", cordoned=True, draining=False)


@router.post("/clusters/{name}/uncordon", response_model=ClusterOut)
def uncordon(name: str, session: SessionDep, admin: AdminDep) -> ClusterOut:
    """Offer this cluster's GPUs again."""
    return _set_flags(
        name, session, admin.key_id, "cluster.uncordon", cordoned=False, draining=False
    )


@router.post("/clusters/{name}/drain", response_model=ClusterOut)
def drain(name: str, session: SessionDep, admin: AdminDep) -> ClusterOut:
    """Cordon the cluster and mark it draining so the controller moves its work elsewhere."""
    return _set_flags(name, session, admin.key_id, "cluster.drain", cordoned=True, draining=True)


@router.get("/clusters/{name}/transitions", response_model=Page[TransitionOut])
def transitions(name: str, session: SessionDep, _: AdminDep, page: PageDep) -> Page[TransitionOut]:
    """Every state change of the cluster, oldest first, with its reason."""
    cluster = resources.get_cluster(session, name)
    stmt = (
        select(ClusterTransition)
        .where(ClusterTransition.cluster_id == cluster.id)
        .order_by(ClusterTransition.id)
    )
    items, total = fetch_page(session, stmt, page)
    return Page(
        items=[TransitionOut.model_validate(t) for t in items],
        total=total,
        limit=page.limit,
        offset=page.offset,
    )


@router.get("/gpus", response_model=Page[GpuRow], tags=["gpus"])
def list_gpus(
    session: SessionDep,
    _: AdminDep,
    page: PageDep,
    cluster: Annotated[str | None, Query(max_length=63, description="Only this cluster.")] = None,
    model: Annotated[str | None, Query(max_length=128, description="Only this GPU model.")] = None,
) -> Page[GpuRow]:
    """GPU inventory per cluster and model."""
    stmt = (
        select(ClusterGpus)
        .join(Cluster)
        .options(selectinload(ClusterGpus.cluster))
        .order_by(Cluster.name, ClusterGpus.model)
    )
    if cluster:
        resources.get_cluster(session, cluster)
        stmt = stmt.where(Cluster.name == cluster)
    if model:
        stmt = stmt.where(ClusterGpus.model == model)
    items, total = fetch_page(session, stmt, page)
    rows = [
        GpuRow(
            **GpuOut.model_validate(g).model_dump(),
            cluster=g.cluster.name,
            cluster_state=g.cluster.state,
        )
        for g in items
    ]
    return Page(items=rows, total=total, limit=page.limit, offset=page.offset)


@router.get("/gpus/totals", response_model=list[GpuTotal], tags=["gpus"])
def gpu_totals(session: SessionDep, _: AdminDep) -> list[GpuTotal]:
    """GPUs summed by model across all clusters."""
    return [GpuTotal(**row) for row in resources.gpu_totals(session)]
