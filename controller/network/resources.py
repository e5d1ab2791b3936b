"""Clusters, GPU inventory and links: the resource layer's state and the agent reports into it."""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
import time
from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from itertools import zip_longest
from typing import Any, TypeVar

from sqlalchemy import (
    String,
    bindparam,
    case,
    delete,
    func,
    insert,
    or_,
    select,
    union_all,
    update,
)
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, aliased
from sqlalchemy.sql.dml import Update

from agents.protocol import GpuInventory as GpuReport
from agents.protocol import Heartbeat, LinkReport, PeerProbe, check_probe_url
from controller.money.pricing import egress_price_history, price_at
from controller.network.labels import check_labels
from controller.network.leases import LeasePolicy
from controller.store.clock import db_now
from controller.store.db import lock_for_update
from controller.store.models import (
    AuditLog,
    Cluster,
    ClusterGpus,
    ClusterTransition,
    EgressPrice,
    Link,
    utcnow,
)
from controller.values.errors import Conflict, CpnError, Invalid, NotFound
from grammar.states import LIVE, ClusterState

log = logging.getLogger(__name__)
_L = TypeVar("_L")


def audit(
    session: Session,
    actor: str | None,
    action: str,
    target_type: str,
    target_id: str,
    **detail: Any,
) -> None:
    session.add(
        AuditLog(
            actor_key_id=actor,
            action=action,
            target_type=target_type,
            target_id=target_id,
            detail=detail,
        )
    )


def get_cluster(session: Session, name: str, *, for_update: bool = False) -> Cluster:
    stmt = select(Cluster).where(Cluster.name == name)
    if for_update:
        lock_for_update(session)
        stmt = stmt.with_for_update()
    cluster = session.scalars(stmt).first()
    if cluster is None:
        raise NotFound(
            f"no cluster named {name!r}; list clusters with GET /v1/clusters", field="cluster"
        )
    return cluster


def create_cluster(
    session: Session,
    name: str,
    region: str,
    labels: dict[str, str],
    *,
    pinned_probe_url: str | None = None,
) -> Cluster:
    check_labels(labels)
    if session.scalar(select(Cluster.id).where(Cluster.name == name)) is not None:
        raise Conflict(f"a cluster named {name!r} exists; pick another name", field="name")
    cluster = Cluster(name=name, region=region, labels=labels, pinned_probe_url=pinned_probe_url)
    session.add(cluster)
    try:
        session.flush()
    except IntegrityError as exc:  # lost a race with another creator
        raise Conflict(f"a cluster named {name!r} exists; pick another name", field="name") from exc
    return cluster


# ---- agent reports -------------------------------------------------------------------------


def declared_neighbours(
    session: Session, cluster: Cluster | None = None
) -> dict[str, frozenset[str]]:
    """Each cluster's name -> the clusters an admin declared a link with, either way round:
    the links an agent may measure without CPN_LINK_DISCOVERY (what its heartbeat lists as
    peers, and what `ingest_links` accepts). `cluster`: its links only."""
    a, b = aliased(Cluster), aliased(Cluster)
    stmt = (
        select(a.name, b.name)
        .join(Link, Link.src_cluster_id == a.id)
        .join(b, Link.dst_cluster_id == b.id)
        .where(Link.source == "declared")
    )
    if cluster is not None:
        stmt = stmt.where(or_(a.id == cluster.id, b.id == cluster.id))
    near: dict[str, set[str]] = {}
    for x, y in session.execute(stmt):
        near.setdefault(x, set()).add(y)
        near.setdefault(y, set()).add(x)
    return {k: frozenset(v) for k, v in near.items()}


class PeerTable:
    """Probe URLs of live clusters, cached briefly: every heartbeat needs it, few change it.

    A cluster's URL is its admin's pin when set, else what its agent reports. A stored URL
    that fails `check_probe_url` (written before that check existed, or by hand) is left out,
    and logged once, so agents are never sent a URL that could steer their probes elsewhere.
    """

    def __init__(self, ttl_s: float = 1.0, discovery: bool = True) -> None:
        self._ttl = ttl_s
        self._lock = threading.Lock()
        self._at = 0.0
        self._peers: list[PeerProbe] = []
        self._version = ""
        self._logged: set[tuple[str, str]] = set()
        self._discovery = discovery
        self._declared: dict[str, frozenset[str]] = {}

    def visible(self, cluster: str, peers: list[PeerProbe]) -> list[PeerProbe]:
        """The peers `cluster`'s agent probes: every other one with link discovery, else
        those an admin declared a link with (either way round), as `ingest_links` accepts."""
        if self._discovery:
            return [p for p in peers if p.cluster != cluster]
        with self._lock:
            near = self._declared.get(cluster, frozenset())
        return [p for p in peers if p.cluster in near]

    def invalidate(self) -> None:
        with self._lock:
            self._at = 0.0

    def get(self, session: Session) -> tuple[list[PeerProbe], str]:
        with self._lock:
            if time.monotonic() - self._at < self._ttl:
                return self._peers, self._version
        url = func.coalesce(Cluster.pinned_probe_url, Cluster.probe_url)
        rows = session.execute(
            select(Cluster.name, url)
            .where(url.is_not(None), Cluster.state.in_(LIVE))
            .order_by(Cluster.name)
        ).all()
        peers = [PeerProbe(cluster=n, probe_url=u) for n, u in rows if self._usable(n, u)]
        version = hashlib.sha256(repr(rows).encode()).hexdigest()[:16]
        declared = {} if self._discovery else declared_neighbours(session)
        with self._lock:
            self._peers, self._version, self._at = peers, version, time.monotonic()
            self._declared = declared
        return peers, version

    def _usable(self, cluster: str, url: str) -> bool:
        try:
            check_probe_url(url)
        except ValueError as exc:
            with self._lock:
                first = (cluster, url) not in self._logged
                self._logged.add((cluster, url))
            if first:
                log.warning(
                    "not listing cluster %s to peers: its probe URL %r %s", cluster, url, exc
                )
            return False
        return True


@dataclass(frozen=True)
class HeartbeatResult:
    cluster: str
    state: ClusterState
    lease_expires_at: datetime
    changed_state: bool


# A renewal leaves `version` (the ETag) alone: it versions what an admin sets and the
# cluster's state, not its liveness. Bumped every few seconds, no If-Match (an admin's PATCH,
# `cpn apply`) could win against a live agent. Nothing is lost without it: an admin's write
# sets only the columns it changes, and the lease monitor compares `last_heartbeat_at`.
# Hot-path statements, built once: constructing and cache-keying a statement per beat cost
# more than running it. Executed on the session's connection (Core), not through the ORM.
_RENEW = (
    update(Cluster)
    .where(
        Cluster.name == bindparam("b_name"),
        Cluster.state == ClusterState.READY,
        Cluster.probe_url.is_not_distinct_from(bindparam("b_probe_url", type_=String())),
    )
    .values(
        last_heartbeat_at=bindparam("b_now"),
        lease_expires_at=bindparam("b_expires"),
        agent_version=bindparam("b_agent_version"),
        discovery=bindparam("b_discovery"),
    )
    .returning(Cluster.id)
)
_GPUS_OF = select(
    ClusterGpus.cluster_id,
    ClusterGpus.id,
    ClusterGpus.model,
    ClusterGpus.memory_gib,
    ClusterGpus.count,
    ClusterGpus.allocatable,
    ClusterGpus.utilization,
    ClusterGpus.in_use,
    ClusterGpus.missing,
)
_GPUS = _GPUS_OF.where(ClusterGpus.cluster_id == bindparam("b_cluster_id"))
# `count` never drops below `in_use`, judged on the row as it is when the UPDATE runs (a
# reservation may commit between our read and this write): GPUs that jobs hold stay counted.
_GPU_UPDATE = (
    update(ClusterGpus)
    .where(ClusterGpus.id == bindparam("b_id"))
    .values(
        memory_gib=bindparam("b_memory_gib"),
        count=case(
            (ClusterGpus.in_use > bindparam("b_count"), ClusterGpus.in_use),
            else_=bindparam("b_count"),
        ),
        allocatable=bindparam("b_allocatable"),
        utilization=bindparam("b_utilization"),
        missing=False,
    )
)
# A model no longer reported: gone if nothing holds it, else kept as missing (nothing
# allocatable, counted as what is held) until its allocations end. Both conditional on
# `in_use` as it is when they run.
_GPU_DELETE = delete(ClusterGpus).where(
    ClusterGpus.id == bindparam("b_id"), ClusterGpus.in_use == 0
)
_GPU_MISSING = (
    update(ClusterGpus)
    .where(ClusterGpus.id == bindparam("b_id"), ClusterGpus.in_use > 0)
    .values(missing=True, allocatable=0, count=ClusterGpus.in_use, utilization=None)
)


def ingest_heartbeat(
    session: Session, hb: Heartbeat, policy: LeasePolicy, now: datetime | None = None
) -> HeartbeatResult:
    """Renew the cluster's lease, bring it back to READY, and sync its GPU inventory."""
    now = now or db_now(session)  # the database's clock, as every replica judges leases by
    expires = policy.expiry(now)
    check_gpus(hb.gpus)
    # Fast path, nearly every beat: READY with the same probe URL, so one conditional UPDATE
    # renews the lease and no state changes. The condition keeps replicas safe: if the lease
    # monitor moved the cluster meanwhile, it misses and the slow path below runs.
    conn = session.connection()
    renewed = conn.execute(
        _RENEW,
        {
            "b_name": hb.cluster,
            "b_probe_url": hb.probe_url,
            "b_now": now,
            "b_expires": expires,
            "b_agent_version": hb.agent_version,
            "b_discovery": hb.discovery,
        },
    ).first()
    if renewed is not None:
        _sync_gpus(session, renewed[0], hb.gpus)
        return HeartbeatResult(hb.cluster, ClusterState.READY, expires, False)
    return _ingest_slow(session, hb, now, expires)


RENEW_CHUNK = 256
"""Beats renewed per statement: SQLite refuses a compound SELECT of more than 500 terms."""
_BEAT_COLUMNS = ("name", "probe_url", "agent_version", "discovery")
"""A beat's values in the renewal, in this order: cluster, probe URL, agent version, discovery;
parameter `b_{column}_{row}` (named here once, for `_renewal` and its caller)."""


def _padded(n: int) -> int:
    """`n` rounded up to a power of two (at least 4): a handful of statement shapes, each
    compiled once, whatever the batch sizes."""
    return max(4, 1 << (n - 1).bit_length())


@functools.lru_cache(maxsize=8)
def _renewal(rows: int) -> Update:
    """The fast path's UPDATE for `rows` beats, as bound parameters (`b_name_0`, ...).

    A `values()` list with its data has no cache key, so SQLAlchemy compiled it again for
    every batch (9 % of a heartbeat's CPU at 1,000 beats/s, py-spy); a union of selects of
    bound parameters is compiled once per shape and cached. Run on the session's connection
    (Core), its cache key is computed once too; the ORM's execute built it again each time."""
    beat = union_all(
        *(
            select(*(bindparam(f"b_{c}_{i}", type_=String).label(c) for c in _BEAT_COLUMNS))
            for i in range(rows)
        )
    ).cte("beat")
    return (
        update(Cluster)
        .where(
            Cluster.name == beat.c.name,
            Cluster.state == ClusterState.READY,
            Cluster.probe_url.is_not_distinct_from(beat.c.probe_url),
        )
        .values(
            last_heartbeat_at=bindparam("b_now", type_=Cluster.last_heartbeat_at.type),
            lease_expires_at=bindparam("b_expires", type_=Cluster.lease_expires_at.type),
            agent_version=beat.c.agent_version,
            discovery=beat.c.discovery,
        )
        .returning(Cluster.id, Cluster.name)
    )


def ingest_heartbeats(
    session: Session, beats: Sequence[Heartbeat], policy: LeasePolicy, now: datetime
) -> dict[str, HeartbeatResult | CpnError]:
    """Many clusters' reports (one each) in one transaction and a few statements, whatever
    their number: on PostgreSQL the round trips, not the work, were a batch's price (two a
    beat). The fast path of `ingest_heartbeat` for all of them at once — one UPDATE over
    their values (`_renewal`, per `RENEW_CHUNK` beats) — and one read of their GPU rows; a
    cluster it misses (a first beat, a state or probe URL change) takes the one-by-one path.
    A report the domain refuses is its outcome and writes nothing."""
    expires = policy.expiry(now)
    outcomes: dict[str, HeartbeatResult | CpnError] = {}
    valid: dict[str, Heartbeat] = {}
    for hb in beats:
        try:
            check_gpus(hb.gpus)
        except CpnError as refused:
            outcomes[hb.cluster] = refused
        else:
            valid[hb.cluster] = hb
    if not valid:
        return outcomes
    names = sorted(valid)
    # Row locks in name order first: two batches written at once (PostgreSQL) may wait for
    # each other but never deadlock, which one UPDATE's own scan order would not promise.
    # SQLite has no row locks (one writer at a time): there the SELECT would only read.
    if session.get_bind().dialect.name != "sqlite":
        session.execute(
            select(Cluster.id)
            .where(Cluster.name.in_(names))
            .order_by(Cluster.name)
            .with_for_update()
        )
    renewed: dict[str, str] = {}
    for start in range(0, len(names), RENEW_CHUNK):
        chunk = names[start : start + RENEW_CHUNK]
        size = _padded(len(chunk))
        params: dict[str, Any] = {"b_now": now, "b_expires": expires}
        for i in range(size):  # padding rows name no cluster (NULL = name is never true)
            one = valid[chunk[i]] if i < len(chunk) else None
            given = (one.cluster, one.probe_url, one.agent_version, one.discovery) if one else ()
            for column_name, value in zip_longest(_BEAT_COLUMNS, given):
                params[f"b_{column_name}_{i}"] = value
        rows = session.connection().execute(_renewal(size), params)  # Core: its key memoized
        renewed.update((name, cid) for cid, name in rows)
    held: dict[str, list[Any]] = {cid: [] for cid in renewed.values()}
    if held:
        rows = session.connection().execute(_GPUS_OF.where(ClusterGpus.cluster_id.in_(list(held))))
        for row in rows:
            held[row.cluster_id].append(row)
    for name in names:
        hb = valid[name]
        cid = renewed.get(name)
        try:
            if cid is not None:
                _sync_gpus(session, cid, hb.gpus, {r.model: r for r in held[cid]})
                outcomes[name] = HeartbeatResult(name, ClusterState.READY, expires, False)
            else:
                outcomes[name] = _ingest_slow(session, hb, now, expires)
        except CpnError as refused:  # raised before this report wrote anything
            outcomes[name] = refused
    return outcomes


def _ingest_slow(
    session: Session, hb: Heartbeat, now: datetime, expires: datetime
) -> HeartbeatResult:
    """A beat that changes the cluster: its first one, or one after the lease lapsed, or a
    new probe URL."""
    row = session.execute(
        select(Cluster.id, Cluster.state, Cluster.probe_url).where(Cluster.name == hb.cluster)
    ).first()
    if row is None:
        raise NotFound(
            f"no cluster named {hb.cluster!r}; an admin must create it first (POST /v1/clusters)",
            field="cluster",
        )
    cid, state, probe_url = row
    values: dict[str, Any] = {
        "last_heartbeat_at": now,
        "lease_expires_at": expires,
        "state": ClusterState.READY,
        "agent_version": hb.agent_version,
        "discovery": hb.discovery,
        "probe_url": hb.probe_url,
    }
    result = session.execute(
        update(Cluster)
        .where(Cluster.id == cid, Cluster.state == state)
        .values(version=Cluster.version + 1, **values)
        .execution_options(synchronize_session=False)
    )
    if result.rowcount != 1:  # type: ignore[attr-defined]
        # The lease monitor moved it between our read and write: re-read under a row lock.
        state = session.execute(
            select(Cluster.state).where(Cluster.id == cid).with_for_update()
        ).scalar_one()
        session.execute(
            update(Cluster)
            .where(Cluster.id == cid)
            .values(version=Cluster.version + 1, **values)
            .execution_options(synchronize_session=False)
        )
    changed = state != ClusterState.READY
    if changed:
        session.add(
            ClusterTransition(
                cluster_id=cid,
                from_state=state,
                to_state=ClusterState.READY,
                reason="heartbeat received",
            )
        )
    _sync_gpus(session, cid, hb.gpus)
    return HeartbeatResult(
        hb.cluster, ClusterState.READY, expires, changed or probe_url != hb.probe_url
    )


def check_gpus(reported: Sequence[GpuReport]) -> None:
    seen: set[str] = set()
    for gpu in reported:
        if gpu.model in seen:
            raise Invalid(
                f"GPU model {gpu.model!r} reported twice; merge its counts into one entry",
                field="gpus",
            )
        seen.add(gpu.model)


def _sync_gpus(
    session: Session,
    cluster_id: str,
    reported: Sequence[GpuReport],
    existing: dict[str, Any] | None = None,
) -> None:
    """Write only what changed (usually nothing); `in_use` belongs to the controller and is kept.

    A model that vanishes, shrinks or comes back never loses track of the GPUs jobs hold (see
    `ClusterGpus`). Core statements on the session's connection: an unchanged inventory
    costs one small read.
    """
    conn = session.connection()
    if existing is None:  # else read for a whole batch at once (`ingest_heartbeats`)
        existing = {r.model: r for r in conn.execute(_GPUS, {"b_cluster_id": cluster_id})}
    for gpu in reported:
        allocatable = min(gpu.allocatable, gpu.count)
        row = existing.pop(gpu.model, None)
        if row is None:
            conn.execute(
                insert(ClusterGpus).values(
                    cluster_id=cluster_id,
                    model=gpu.model,
                    memory_gib=gpu.memory_gib,
                    count=gpu.count,
                    allocatable=allocatable,
                    utilization=gpu.utilization,
                )
            )
        elif (
            row.memory_gib,
            row.count,
            row.allocatable,
            row.utilization,
            row.missing,
        ) != (gpu.memory_gib, max(gpu.count, row.in_use), allocatable, gpu.utilization, False):
            conn.execute(
                _GPU_UPDATE,
                {
                    "b_id": row.id,
                    "b_memory_gib": gpu.memory_gib,
                    "b_count": gpu.count,
                    "b_allocatable": allocatable,
                    "b_utilization": gpu.utilization,
                },
            )
    for row in existing.values():  # models no longer reported
        if row.missing and row.count == row.in_use and row.in_use > 0:
            continue  # already kept as missing, and as held as it was
        _retire(conn, row.id, first_delete=row.in_use == 0)


def _retire(conn: Connection, row_id: int, *, first_delete: bool) -> None:
    """Delete the row if nothing holds its GPUs, else mark it missing; whichever the row's
    `in_use` calls for when the statements run (the first tried is the likely one)."""
    statements = (_GPU_DELETE, _GPU_MISSING) if first_delete else (_GPU_MISSING, _GPU_DELETE)
    for statement in statements:
        if conn.execute(statement, {"b_id": row_id}).rowcount == 1:
            return


MEASURE_AHEAD_S = 300.0
"""How far ahead of the server's clock a measurement's `measured_at` may be (clock skew)."""
MEASURE_AGE_S = 3600.0
"""How old a measurement may be when reported: an older one describes a link no more."""


def _check_measured_at(report: LinkReport, now: datetime) -> None:
    for i, m in enumerate(report.links):
        ahead = (m.measured_at - now).total_seconds()
        if ahead > MEASURE_AHEAD_S or -ahead > MEASURE_AGE_S:
            raise Invalid(
                f"measured_at {m.measured_at.isoformat()} is {abs(ahead):.0f} s "
                f"{'ahead of' if ahead > 0 else 'behind'} the server's clock; report "
                f"measurements within {MEASURE_AGE_S:.0f} s past and {MEASURE_AHEAD_S:.0f} s "
                "ahead of it (is the agent's clock set?)",
                field=f"links[{i}].measured_at",
            )


def ingest_links(
    session: Session, report: LinkReport, now: datetime | None = None, discovery: bool = False
) -> int:
    """Store measured links from the reporting cluster; declared ones stay beside them. A
    measurement stamped outside a bounded skew of the server's clock is refused (422), one
    older than the link's measurement in force never replaces it (a replay), and without
    `discovery` (CPN_LINK_DISCOVERY) an agent measures only links an admin declared: it
    cannot add a fast free link the network does not have."""
    _check_measured_at(report, now or utcnow())
    src = get_cluster(session, report.cluster)
    names = {m.dst for m in report.links}
    ids = dict(
        session.execute(select(Cluster.name, Cluster.id).where(Cluster.name.in_(names))).all()
    )
    unknown = sorted(names - ids.keys())
    if unknown:
        raise Invalid(
            f"links name unknown clusters {unknown}; report only peers the controller listed",
            field="links.dst",
        )
    near = (
        frozenset() if discovery else declared_neighbours(session, src).get(src.name, frozenset())
    )
    for i, m in enumerate(report.links):
        if m.dst == report.cluster:
            raise Invalid("a link cannot go from a cluster to itself", field="links.dst")
        if not discovery and m.dst not in near:
            raise Invalid(
                f"no link {report.cluster} - {m.dst} is declared; agents measure declared "
                "links only (an admin declares it, or sets CPN_LINK_DISCOVERY=true)",
                field=f"links[{i}].dst",
            )
        _upsert_link(
            session,
            src.id,
            ids[m.dst],
            "measured",
            newer_than=m.measured_at,
            bandwidth_gbps=m.bandwidth_gbps,
            free_gbps=m.free_gbps,
            rtt_ms=m.rtt_ms,
            loss=m.loss,
            measured_at=m.measured_at,
        )
    return len(report.links)


def _upsert_link(
    session: Session,
    src_id: str,
    dst_id: str,
    source: str,
    newer_than: datetime | None = None,
    **values: Any,
) -> Link:
    """Insert or update the link; with `newer_than`, an existing row measured at or after it
    is kept as it is (an older report never replaces a newer one)."""
    link = session.scalars(
        select(Link).where(
            Link.src_cluster_id == src_id, Link.dst_cluster_id == dst_id, Link.source == source
        )
    ).first()
    if link is not None and newer_than is not None and link.measured_at >= newer_than:
        return link
    if link is None:
        if source == "measured" and "egress_price_per_gb" not in values:
            values["egress_price_per_gb"] = _declared_price(session, src_id, dst_id)
        link = Link(src_cluster_id=src_id, dst_cluster_id=dst_id, source=source, **values)
        session.add(link)
    else:
        for k, v in values.items():
            setattr(link, k, v)
    session.flush()
    return link


def _declared_price(session: Session, src_id: str, dst_id: str) -> float:
    price = session.scalar(
        select(Link.egress_price_per_gb).where(
            Link.src_cluster_id == src_id, Link.dst_cluster_id == dst_id, Link.source == "declared"
        )
    )
    return float(price or 0.0)


# ---- admin views ---------------------------------------------------------------------------


def declare_link(
    session: Session,
    src: str,
    dst: str,
    *,
    bandwidth_gbps: float,
    rtt_ms: float,
    loss: float,
    egress_price_per_gb: float,
    pinned: bool = False,
) -> Link:
    if src == dst:
        raise Invalid("a link cannot go from a cluster to itself; give two clusters", field="dst")
    a, b = get_cluster(session, src), get_cluster(session, dst)
    link = _upsert_link(
        session,
        a.id,
        b.id,
        "declared",
        bandwidth_gbps=bandwidth_gbps,
        rtt_ms=rtt_ms,
        loss=loss,
        egress_price_per_gb=egress_price_per_gb,
        measured_at=utcnow(),
        pinned=pinned,
    )
    # The declared price enters the pricing catalogue (effective now) if it changes what
    # applies, so billing has one source of truth.
    history = egress_price_history(session, a.id, b.id)
    if price_at(history, utcnow()) != Decimal(str(egress_price_per_gb)):
        session.add(
            EgressPrice(
                src_cluster_id=a.id,
                dst_cluster_id=b.id,
                price_per_gb=Decimal(str(egress_price_per_gb)),
                effective_from=utcnow(),
            )
        )
    # The egress price is the operator's word: measured rows of the pair follow it.
    session.execute(
        update(Link)
        .where(Link.src_cluster_id == a.id, Link.dst_cluster_id == b.id, Link.source == "measured")
        .values(egress_price_per_gb=egress_price_per_gb)
        .execution_options(synchronize_session=False)
    )
    return link


def carried_gbps(rows: Iterable[Any]) -> dict[str, tuple[float | None, float | None]]:
    """The most the agents' probes carried out of and into each cluster (Gbit/s; None: no
    measurement that way), by name, from link rows (`source`, `src_name`, `dst_name`,
    `bandwidth_gbps`): the port is at least that fast, and planned on no more where less was
    declared (`scheduler.bandwidth.port_gbps`)."""
    up: dict[str, float] = {}
    down: dict[str, float] = {}
    for row in rows:
        if row.source != "measured":
            continue
        up[row.src_name] = max(up.get(row.src_name, 0.0), row.bandwidth_gbps)
        down[row.dst_name] = max(down.get(row.dst_name, 0.0), row.bandwidth_gbps)
    return {name: (up.get(name), down.get(name)) for name in up.keys() | down.keys()}


def link_rows(session: Session, touching: AbstractSet[str] | None = None) -> Sequence[Any]:
    """Every link's columns with its clusters' names, as the snapshot plans on them and
    `carried_gbps` reads them; `touching`: only the links out of or into these clusters."""
    src, dst = aliased(Cluster), aliased(Cluster)
    query = (
        select(
            Link.src_cluster_id,
            Link.dst_cluster_id,
            Link.source,
            Link.pinned,
            Link.bandwidth_gbps,
            Link.rtt_ms,
            Link.egress_price_per_gb,
            src.name.label("src_name"),
            dst.name.label("dst_name"),
        )
        .join(src, src.id == Link.src_cluster_id)
        .join(dst, dst.id == Link.dst_cluster_id)
    )
    if touching is not None:
        names = sorted(touching)
        query = query.where(or_(src.name.in_(names), dst.name.in_(names)))
    return session.execute(query).all()


def winning_links(links: Iterable[_L]) -> list[_L]:
    """One link per directed pair: a pinned declared link, else the measured, else the declared.
    Takes ORM links or rows of their columns (the snapshot reads columns on the hot path)."""
    best: dict[tuple[str, str], _L] = {}

    def rank(link: Any) -> int:
        return 2 if link.pinned else 1 if link.source == "measured" else 0

    for link in links:
        row: Any = link
        key = (row.src_cluster_id, row.dst_cluster_id)
        if key not in best or rank(link) > rank(best[key]):
            best[key] = link
    return list(best.values())


def effective_links(links: Sequence[Link]) -> list[Link]:
    """`winning_links`, sorted by cluster names."""
    return sorted(winning_links(links), key=lambda k: (k.src.name, k.dst.name))


def gpu_totals(session: Session) -> list[dict[str, Any]]:
    """GPUs by model across clusters that are READY and not cordoned count as offered."""
    rows = session.execute(
        select(
            ClusterGpus.model,
            func.sum(ClusterGpus.count),
            func.sum(ClusterGpus.allocatable),
            func.sum(ClusterGpus.in_use),
            func.count(ClusterGpus.cluster_id),
        )
        .group_by(ClusterGpus.model)
        .order_by(ClusterGpus.model)
    ).all()
    return [
        {
            "model": model,
            "count": int(count or 0),
            "allocatable": int(alloc or 0),
            "in_use": int(in_use or 0),
            "clusters": int(n),
        }
        for model, count, alloc, in_use, n in rows
    ]
