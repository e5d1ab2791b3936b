"""The job list, the API's most frequent read: a page of keys, then only the rows not yet rendered.

A page is read in two steps. First the page's keys, `(id, version)`, in the list's order off
its index (`_keys`); then, in one statement, the full rows of the keys this replica has not
rendered yet (`_rows`), each parsed in one pydantic pass (`JobRow`) and its JSON kept
(`RenderedJobs`). A list polled again (the console's refresh, a tenant's loop) reads a page
of short keys instead of a page of full rows with their times formatted as text, which on
SQLite was most of a list's database time (measured: bench/results/api-throughput.md).

A key names one stored row: every write to `jobs` moves its `version` (the ORM's version
counter; the Core updates set it; and since revision 0014 a database trigger moves it for any
other `UPDATE` that leaves it), the invariant its ETag already stands on. So a job changed in
any column is another key and never answered stale.

Its `total` costs a few rows, not a count of the tenant's jobs: triggers keep each tenant's
number of jobs in `job_counts` (revision 0015).
"""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from pydantic import TypeAdapter, ValidationError
from sqlalchemy import (
    JSON,
    BigInteger,
    ColumnElement,
    Connection,
    Select,
    Text,
    bindparam,
    cast,
    func,
    select,
    type_coerce,
)

from api.schemas import JobRow
from controller.store.models import Job, JobCount, ModelJSON, StateType, UTCDateTime
from wire.jobs import JobOut

_FIELDS = tuple(JobOut.model_fields)
_ROW = TypeAdapter(JobRow)
_JOB = TypeAdapter(JobOut)
_JSON_FIELDS = tuple(n for n in _FIELDS if isinstance(Job.__table__.c[n].type, JSON | ModelJSON))
_JSON_AT = tuple(_FIELDS.index(n) for n in _JSON_FIELDS)
_ID_AT, _VERSION_AT = _FIELDS.index("id"), _FIELDS.index("version")

CACHE_ROWS = 2048
CACHE_MAX_CHARS = 8192
"""Rendered jobs are kept (least recently used first out) up to this many per replica, each
with at most this many characters of JSON text (the other columns are bounded strings): the
cache's memory has a bound whatever tenants store."""

Key = tuple[str, int]


class RenderedJobs:
    """Jobs rendered as list items, by `(id, version)`, least recently used first out.

    Routes run on worker threads, so its two operations hold a lock (never while rendering)."""

    def __init__(self, rows: int = CACHE_ROWS) -> None:
        self.rows = rows
        self._items: OrderedDict[Key, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def get_many(self, keys: Sequence[Key]) -> dict[str, bytes]:
        """The kept items of `keys`, by job id: a page's in one hold of the lock, since a hold
        per job showed in a list read's CPU profile (bench/results/api-throughput.md)."""
        found: dict[str, bytes] = {}
        with self._lock:
            for key in keys:
                item = self._items.get(key)
                if item is not None:
                    self._items.move_to_end(key)
                    found[key[0]] = item
        return found

    def put(self, key: Key, item: bytes) -> None:
        with self._lock:
            self._items[key] = item
            self._items.move_to_end(key)
            while len(self._items) > self.rows:
                self._items.popitem(last=False)


def render(row: Sequence[Any]) -> bytes:
    """One job as list-item JSON: the row's text parsed by `JobRow` (one pydantic pass), or for
    a spec nested deeper than pydantic's JSON parser goes (about 200 levels; a submission's
    body may nest deeper) its JSON parsed in Python and validated as `JobOut`."""
    item = dict(zip(_FIELDS, row, strict=True))
    try:
        return _ROW.dump_json(_ROW.validate_python(item))
    except ValidationError:
        for name in _JSON_FIELDS:
            if isinstance(item[name], str):
                item[name] = json.loads(item[name])
        return _JOB.dump_json(_JOB.validate_python(item))


def _columns(dialect: str) -> list[ColumnElement[Any]]:
    """The row's columns as `JobRow` parses them: JSON columns as their text, times as ISO
    text in UTC (SQLite stores them as UTC 'YYYY-MM-DD HH:MM:SS.ffffff'), states as stored."""
    cols: list[ColumnElement[Any]] = []
    for name in _FIELDS:
        col = Job.__table__.c[name]
        if isinstance(col.type, UTCDateTime):
            iso: ColumnElement[Any]
            if dialect == "postgresql":
                iso = func.to_char(func.timezone("UTC", col), 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')
            else:
                iso = cast(col, Text) + "Z"
            cols.append(type_coerce(iso, Text).label(name))
        elif isinstance(col.type, JSON | ModelJSON):
            cols.append(cast(col, Text).label(name))
        elif isinstance(col.type, StateType):
            cols.append(type_coerce(col, Text).label(name))
        else:
            cols.append(col)
    return cols


@functools.cache
def _keys(by_tenant: bool, by_state: bool) -> tuple[Select[str, int, int], Select[int]]:
    """The page's keys, each row with the count of all (an uncorrelated subquery both
    backends run once: one statement, not two), and the count alone for a page with no rows.
    Built once per shape: building and keying a statement for SQLAlchemy's cache cost as much
    as running it.

    Without a state the count is the sum of the tenant's (or every tenant's) `job_counts`
    rows, which triggers keep (revision 0015): a few rows, however many jobs. A state's count
    still counts its jobs (states change too often to keep counts of)."""
    where = []
    if by_tenant:
        where.append(Job.tenant_id == bindparam("tenant"))
    if by_state:
        where.append(Job.state == bindparam("state"))
        count = select(func.count()).select_from(Job).where(*where)
    else:
        kept = [JobCount.tenant_id == bindparam("tenant")] if by_tenant else []
        count = select(cast(func.coalesce(func.sum(JobCount.n), 0), BigInteger)).where(*kept)
    keys = (
        select(Job.id, Job.version, count.correlate(None).scalar_subquery())
        .where(*where)
        .order_by(Job.created_at.desc(), Job.id.desc())
        .limit(bindparam("limit"))
        .offset(bindparam("offset"))
    )
    return keys, count


@functools.cache
def _rows(dialect: str) -> Select[Any]:
    return select(*_columns(dialect)).where(Job.id.in_(bindparam("ids", expanding=True)))


def list_page(
    conn: Connection,
    rendered: RenderedJobs,
    *,
    tenant: str | None,
    state: str | None,
    limit: int,
    offset: int,
) -> bytes:
    """The page as `Page[JobOut]` JSON, newest first: `tenant` None lists every tenant's."""
    keys_stmt, count_stmt = _keys(tenant is not None, state is not None)
    where = {"tenant": tenant, "state": state}
    page = conn.execute(keys_stmt, {**where, "limit": limit, "offset": offset}).all()
    total = page[0][2] if page else conn.execute(count_stmt, where).scalar() or 0
    keys: list[Key] = [(i, v) for i, v, _ in page]
    items = rendered.get_many(keys)
    missing = [i for i, _ in keys if i not in items]
    if missing:
        # Read now, so possibly a version newer than its key's: answered, and kept, as read.
        for row in conn.execute(_rows(conn.dialect.name), {"ids": missing}):
            item = render(row)
            items[row[_ID_AT]] = item
            if sum(len(row[i] or "") for i in _JSON_AT) <= CACHE_MAX_CHARS:
                rendered.put((row[_ID_AT], row[_VERSION_AT]), item)
    # `Page`'s fields in its order (the schema-conformance fuzz test holds this to Page[JobOut]);
    # a job deleted between the two reads is left out
    body = b",".join([items[i] for i, _ in keys if i in items])
    return b'{"items":[%b],"total":%d,"limit":%d,"offset":%d}' % (body, total, limit, offset)
