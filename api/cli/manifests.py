"""Declarative admin state: the documents `cpn apply -f` reads and `cpn get -o yaml` writes,
and the pure plan that turns documents plus what the server holds into changes.

No I/O here: `api.cli.apply` reads the server's state into `Current`, asks `plan` what to
do, and sends the requests each `Step` carries. Each kind's fields are the REST input
model's (same names, same limits), plus `kind` and an optional `apiVersion`.

Semantics: a field a document gives is managed (set to that value); a field it leaves out
keeps the server's value on an update and takes the API's default on a create. Nothing is
deleted: a document removed from the file leaves its object alone.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any, ClassVar, Final, Literal

import yaml
from pydantic import BaseModel, ValidationError

from api.schemas import (
    ClusterIn,
    ClusterOut,
    EgressPriceIn,
    GpuPriceIn,
    LinkIn,
    LinkOut,
    PricingOut,
    TenantIn,
    TenantOut,
)

API_VERSION: Final = "cpn/v1"
Version = Literal["cpn/v1"]


class Doc(BaseModel):
    """What every document has besides its kind's fields."""

    kind: str
    RANK: ClassVar[int]
    """Apply order: clusters before what refers to them; links before the egress prices
    they would otherwise overwrite in the catalogue."""

    def ident(self) -> str:
        raise NotImplementedError

    def document(self) -> dict[str, Any]:
        """As `cpn get -o yaml` writes it: apiVersion and kind first, then the fields."""
        body = self.model_dump(mode="json", exclude={"kind", "apiVersion"})
        return {"apiVersion": API_VERSION, "kind": self.kind, **body}


class ClusterDoc(ClusterIn, Doc):
    RANK = 0
    kind: Literal["Cluster"]
    apiVersion: Version = API_VERSION

    def ident(self) -> str:
        return self.name


class LinkDoc(LinkIn, Doc):
    RANK = 1
    kind: Literal["Link"]
    apiVersion: Version = API_VERSION

    def ident(self) -> str:
        return f"{self.src}->{self.dst}"

    def directions(self) -> list[tuple[str, str]]:
        return [(self.src, self.dst)] + ([(self.dst, self.src)] if self.symmetric else [])

    def document(self) -> dict[str, Any]:
        doc = super().document()
        if self.symmetric:
            del doc["symmetric"]  # the default: one document for both directions
        return doc


class TenantDoc(TenantIn, Doc):
    RANK = 2
    kind: Literal["Tenant"]
    apiVersion: Version = API_VERSION

    def ident(self) -> str:
        return self.name


class GpuPriceDoc(GpuPriceIn, Doc):
    RANK = 3
    kind: Literal["GpuPrice"]
    apiVersion: Version = API_VERSION

    def ident(self) -> str:
        return f"{self.cluster}/{self.gpu_model}/{self.qos_class}"

    def document(self) -> dict[str, Any]:
        doc = super().document()
        if self.effective_from is None:
            del doc["effective_from"]
        return doc


class EgressPriceDoc(EgressPriceIn, Doc):
    RANK = 4
    kind: Literal["EgressPrice"]
    apiVersion: Version = API_VERSION

    def ident(self) -> str:
        return f"{self.src}->{self.dst}"

    def directions(self) -> list[tuple[str, str]]:
        return [(self.src, self.dst)] + ([(self.dst, self.src)] if self.symmetric else [])

    def document(self) -> dict[str, Any]:
        doc = super().document()
        if self.effective_from is None:
            del doc["effective_from"]
        if self.symmetric:
            del doc["symmetric"]
        return doc


KINDS: dict[str, type[Doc]] = {
    "Cluster": ClusterDoc,
    "Link": LinkDoc,
    "Tenant": TenantDoc,
    "GpuPrice": GpuPriceDoc,
    "EgressPrice": EgressPriceDoc,
}


class ManifestError(ValueError):
    """A document that cannot be applied; `where` names it (index, kind, name)."""

    def __init__(self, where: str, message: str) -> None:
        super().__init__(f"{where}: {message}")
        self.where, self.message = where, message


@dataclass(frozen=True)
class Parsed:
    index: int
    """1-based position in the file (empty documents count too, as YAML numbers them)."""
    doc: Doc

    @property
    def where(self) -> str:
        return where(self.index, self.doc.kind, self.doc.ident())


def where(index: int, kind: str | None, name: str | None) -> str:
    """`document 2 (Tenant acme)`: how errors and output name a document."""
    label = " ".join(p for p in (kind, name) if p)
    return f"document {index}" + (f" ({label})" if label else "")


def _name_of(kind: str, data: Mapping[str, Any]) -> str | None:
    """A best-effort name of a document that may not validate, for its error line."""
    keys = {
        "Cluster": ("name",),
        "Tenant": ("name",),
        "Link": ("src", "dst"),
        "EgressPrice": ("src", "dst"),
        "GpuPrice": ("cluster", "gpu_model", "qos_class"),
    }.get(kind, ("name",))
    parts = [str(data[k]) for k in keys if isinstance(data.get(k), (str, int, float))]
    if len(parts) != len(keys):
        return None
    return "->".join(parts) if keys[0] == "src" else "/".join(parts)


def validation_message(errors: Iterable[Any]) -> str:
    """Every bad field with what would fix it, on one line."""
    parts = []
    for e in errors:
        loc = ".".join(str(p) for p in e["loc"]) or "document"
        message = str(e["msg"]).removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            message = "unknown field: check its spelling or remove it"
        elif e["type"] == "missing":
            message = "required: add it"
        parts.append(f"{loc}: {message}")
    return "; ".join(parts)


def parse(text: str) -> list[Parsed]:
    """Every document of a multi-document YAML text, validated once; ManifestError names the
    first bad one. Identities given twice (a link direction included) are refused too."""
    try:
        raw = list(yaml.safe_load_all(text))
    except yaml.YAMLError as exc:
        raise ManifestError("YAML", " ".join(str(exc).split())) from None
    out: list[Parsed] = []
    for index, data in enumerate(raw, start=1):
        if data is None:
            continue
        if not isinstance(data, dict):
            raise ManifestError(
                where(index, None, None),
                f"a document is a mapping with a kind, not {type(data).__name__}",
            )
        kind = data.get("kind")
        model = KINDS.get(kind) if isinstance(kind, str) else None
        if model is None or not isinstance(kind, str):
            raise ManifestError(
                where(index, kind if isinstance(kind, str) else None, _name_of("", data)),
                f"kind: {kind!r} is not one of {', '.join(KINDS)}",
            )
        try:
            doc = model.model_validate(data)
        except ValidationError as exc:
            raise ManifestError(
                where(index, kind, _name_of(kind, data)), validation_message(exc.errors())
            ) from None
        out.append(Parsed(index, doc))
    _refuse_duplicates(out)
    return out


def _keys(doc: Doc) -> list[tuple[tuple[str, ...], str]]:
    """What a document sets, as identities (and how to name them): two documents must not
    set the same one."""
    at = str(getattr(doc, "effective_from", None))
    if isinstance(doc, (LinkDoc, EgressPriceDoc)):
        return [((doc.kind, a, b, at), f"{doc.kind} {a}->{b}") for a, b in doc.directions()]
    return [((doc.kind, doc.ident(), at), f"{doc.kind} {doc.ident()}")]


def _refuse_duplicates(docs: list[Parsed]) -> None:
    seen: dict[tuple[str, ...], Parsed] = {}
    for p in docs:
        for key, label in _keys(p.doc):
            first = seen.setdefault(key, p)
            if first is not p:
                raise ManifestError(
                    p.where,
                    f"sets {label}, which document {first.index} sets already; keep one of them",
                )


# What the server holds, read by `api.cli.apply` (typed with the API's response models).


@dataclass(frozen=True)
class Current:
    clusters: dict[str, ClusterOut] = field(default_factory=dict)
    links: dict[tuple[str, str], LinkOut] = field(default_factory=dict)
    """Declared links by (src, dst); measured ones are the agents', never applied."""
    tenants: dict[str, TenantOut] = field(default_factory=dict)
    pricing: dict[datetime | None, PricingOut] = field(default_factory=dict)
    """Prices in force now (None) and at each effective_from the documents name."""

    def gpu_price(self, at: datetime | None, doc: GpuPriceDoc) -> float | None:
        for p in self.pricing[at].gpu:
            if (p.cluster, p.gpu_model, p.qos_class) == (doc.cluster, doc.gpu_model, doc.qos_class):
                return p.price_per_gpu_hour
        return None

    def egress_price(self, at: datetime | None, src: str, dst: str) -> float | None:
        for p in self.pricing[at].egress:
            if (p.src, p.dst) == (src, dst):
                return p.price_per_gb
        return None


class Action(StrEnum):
    CREATE = "created"
    CHANGE = "changed"
    UNCHANGED = "unchanged"


@dataclass(frozen=True)
class FieldChange:
    field: str
    old: Any
    new: Any

    def __str__(self) -> str:
        return f"{self.field}: {show(self.old)} → {show(self.new)}"


@dataclass(frozen=True)
class Request:
    method: Literal["POST", "PATCH"]
    path: str
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Step:
    """One document's outcome: what changes, and the requests that change it."""

    parsed: Parsed
    action: Action
    changes: tuple[FieldChange, ...] = ()
    requests: tuple[Request, ...] = ()

    def line(self, dry_run: bool) -> str:
        """`Tenant acme: changed (gpu_quota: 8 → 16)`; a create lists its values."""
        doc = self.parsed.doc
        head = f"{doc.kind} {doc.ident()}: "
        verb = self.action.value
        if dry_run and self.action is not Action.UNCHANGED:
            verb = {"created": "would be created", "changed": "would change"}[verb]
        if self.action is Action.CREATE:
            detail = ", ".join(f"{c.field}: {show(c.new)}" for c in self.changes)
        else:
            detail = ", ".join(str(c) for c in self.changes)
        return head + verb + (f" ({detail})" if detail else "")


def show(value: Any) -> str:
    """A value as YAML would spell it, on one line."""
    if value is None:
        return "null"
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, default=str)


def _diff(given: Mapping[str, Any], current: Mapping[str, Any] | None) -> tuple[FieldChange, ...]:
    """Fields whose given value differs from the current one (all of them on a create)."""
    return tuple(
        FieldChange(k, None if current is None else current.get(k), v)
        for k, v in given.items()
        if current is None or current.get(k) != v
    )


def _created(body: Mapping[str, Any]) -> tuple[FieldChange, ...]:
    """A create's fields as changes from nothing (its name is in the line already)."""
    return _diff({k: v for k, v in body.items() if k != "name" and v is not None}, None)


def _given(doc: Doc, exclude: set[str]) -> dict[str, Any]:
    """The fields the document wrote, as JSON values."""
    fields = doc.model_fields_set - exclude - {"kind", "apiVersion"}
    return doc.model_dump(mode="json", include=fields)


def _all(doc: Doc, exclude: set[str]) -> dict[str, Any]:
    """Every field with its default filled in: what a create sends."""
    return doc.model_dump(mode="json", exclude=exclude | {"kind", "apiVersion"})


def plan(docs: list[Parsed], current: Current) -> list[Step]:
    """The steps that make the server hold what the documents say, in apply order.

    Raises ManifestError for a document naming a cluster that neither exists nor is
    created by the file, before anything is written."""
    clusters = set(current.clusters) | {p.doc.name for p in docs if isinstance(p.doc, ClusterDoc)}
    steps: list[Step] = []
    for p in sorted(docs, key=lambda p: (p.doc.RANK, p.index)):
        doc = p.doc
        for attr in ("src", "dst", "cluster"):
            name = getattr(doc, attr, None)
            if isinstance(name, str) and not isinstance(doc, ClusterDoc) and name not in clusters:
                raise ManifestError(
                    p.where,
                    f"{attr}: no cluster named {name!r}; add a Cluster document for it or fix "
                    "the name",
                )
        if isinstance(doc, ClusterDoc):
            steps.append(_cluster(p, doc, current))
        elif isinstance(doc, LinkDoc):
            steps.append(_link(p, doc, current))
        elif isinstance(doc, TenantDoc):
            steps.append(_tenant(p, doc, current))
        elif isinstance(doc, GpuPriceDoc):
            steps.append(_gpu_price(p, doc, current))
        elif isinstance(doc, EgressPriceDoc):
            steps.append(_egress_price(p, doc, current, _declared_egress(steps)))
    return steps


def _declared_egress(steps: list[Step]) -> dict[tuple[str, str], float]:
    """The egress prices the link declarations of `steps` put in force: declaring a link
    sets its pair's catalogue price to the link's, so an EgressPrice document of that pair
    must be sent again after it."""
    return {
        (r.body["src"], r.body["dst"]): r.body["egress_price_per_gb"]
        for step in steps
        for r in step.requests
        if r.path == "/v1/links"
    }


def _cluster(p: Parsed, doc: ClusterDoc, current: Current) -> Step:
    now = current.clusters.get(doc.name)
    if now is None:
        body = _all(doc, set())
        changes = _created(body)
        return Step(p, Action.CREATE, changes, (Request("POST", "/v1/clusters", body),))
    given = _given(doc, {"name"})
    changes = _diff(given, now.model_dump(mode="json"))
    if not changes:
        return Step(p, Action.UNCHANGED)
    patch = Request(
        "PATCH",
        f"/v1/clusters/{doc.name}",
        {c.field: c.new for c in changes},
        {"If-Match": f'"{now.version}"'},  # refused if someone changed it since we read it
    )
    return Step(p, Action.CHANGE, changes, (patch,))


LINK_VALUES = ("bandwidth_gbps", "rtt_ms", "loss", "egress_price_per_gb", "pinned")


def _link(p: Parsed, doc: LinkDoc, current: Current) -> Step:
    """Each direction is declared (an upsert, which also keeps the egress catalogue in step
    with the link's price) when it is missing or differs."""
    given = _given(doc, {"src", "dst", "symmetric"})
    defaults = _all(doc, {"src", "dst", "symmetric"})
    changes: list[tuple[str, tuple[FieldChange, ...]]] = []
    requests: list[Request] = []
    created = True
    for src, dst in doc.directions():
        now = current.links.get((src, dst))
        if now is not None:
            created = False
        old = None if now is None else {k: getattr(now, k) for k in LINK_VALUES}
        diff = _diff(defaults if old is None else given, old)
        if old is not None and not diff:
            continue
        changes.append((f"{src}->{dst}", diff))
        values = {**(old or {}), **(defaults if old is None else given)}
        requests.append(
            Request("POST", "/v1/links", {"src": src, "dst": dst, **values, "symmetric": False})
        )
    if not requests:
        return Step(p, Action.UNCHANGED)
    action = Action.CREATE if created else Action.CHANGE
    return Step(p, action, _by_direction(changes, len(doc.directions())), tuple(requests))


def _by_direction(
    diffs: list[tuple[str, tuple[FieldChange, ...]]], directions: int
) -> tuple[FieldChange, ...]:
    """One direction's changes as they are; the same changes both ways once; else each
    field named with its direction (`a->b rtt_ms`)."""
    if directions == 1 or (len(diffs) == directions and len({d for _, d in diffs}) == 1):
        return diffs[0][1]
    return tuple(FieldChange(f"{way} {c.field}", c.old, c.new) for way, diff in diffs for c in diff)


def _tenant(p: Parsed, doc: TenantDoc, current: Current) -> Step:
    now = current.tenants.get(doc.name)
    if now is None:
        body = _all(doc, set())
        changes = _created(body)
        return Step(p, Action.CREATE, changes, (Request("POST", "/v1/tenants", body),))
    changes = _diff(_given(doc, {"name"}), now.model_dump(mode="json"))
    if not changes:
        return Step(p, Action.UNCHANGED)
    patch = Request("PATCH", f"/v1/tenants/{now.id}", {c.field: c.new for c in changes})
    return Step(p, Action.CHANGE, changes, (patch,))


def _gpu_price(p: Parsed, doc: GpuPriceDoc, current: Current) -> Step:
    """A price is set again (effective now, or at its effective_from) when the one in force
    then differs; history is never rewritten, so 'changed' appends a price."""
    old = current.gpu_price(doc.effective_from, doc) if doc.cluster in current.clusters else None
    if old == doc.price_per_gpu_hour:
        return Step(p, Action.UNCHANGED)
    change = FieldChange("price_per_gpu_hour", old, doc.price_per_gpu_hour)
    body = doc.model_dump(mode="json", exclude={"kind", "apiVersion"}, exclude_none=True)
    action = Action.CREATE if old is None else Action.CHANGE
    return Step(p, action, (change,), (Request("POST", "/v1/pricing/gpu", body),))


def _egress_price(
    p: Parsed, doc: EgressPriceDoc, current: Current, by_links: Mapping[tuple[str, str], float]
) -> Step:
    changes: list[tuple[str, tuple[FieldChange, ...]]] = []
    requests: list[Request] = []
    created = True
    known = current.clusters
    for src, dst in doc.directions():
        old = (
            current.egress_price(doc.effective_from, src, dst)
            if src in known and dst in known
            else None
        )
        if old is not None:
            created = False
        label = "price_per_gb"
        reset = by_links.get((src, dst)) if doc.effective_from is None else None
        if reset is not None and reset != doc.price_per_gb:
            label, old = "(as its Link sets it) price_per_gb", reset
        elif old == doc.price_per_gb:
            continue
        changes.append((f"{src}->{dst}", (FieldChange(label, old, doc.price_per_gb),)))
        body: dict[str, Any] = {"src": src, "dst": dst, "price_per_gb": doc.price_per_gb}
        if doc.effective_from is not None:
            body["effective_from"] = doc.model_dump(mode="json")["effective_from"]
        requests.append(Request("POST", "/v1/pricing/egress", {**body, "symmetric": False}))
    if not requests:
        return Step(p, Action.UNCHANGED)
    action = Action.CREATE if created else Action.CHANGE
    return Step(p, action, _by_direction(changes, len(doc.directions())), tuple(requests))


# `cpn get`: the server's state as documents that `cpn apply` takes back unchanged.


def documents_of(current: Current, kinds: Iterable[str]) -> Iterator[Doc]:
    """The documents describing `current`, kind by kind in apply order."""
    wanted = set(kinds)
    if "Cluster" in wanted:
        for c in sorted(current.clusters.values(), key=lambda c: c.name):
            yield ClusterDoc(
                kind="Cluster",
                name=c.name,
                region=c.region,
                labels=c.labels,
                pinned_probe_url=c.pinned_probe_url,
            )
    if "Link" in wanted:
        yield from _link_docs(current.links)
    if "Tenant" in wanted:
        for t in sorted(current.tenants.values(), key=lambda t: t.name):
            yield TenantDoc(
                kind="Tenant",
                name=t.name,
                gpu_quota=t.gpu_quota,
                budget=t.budget,
                priority_ceiling=t.priority_ceiling,
                qos_classes=t.qos_classes,
            )
    now = current.pricing.get(None)
    if "GpuPrice" in wanted and now is not None:
        for g in now.gpu:
            if g.cluster in current.clusters:
                yield GpuPriceDoc(
                    kind="GpuPrice",
                    cluster=g.cluster,
                    gpu_model=g.gpu_model,
                    qos_class=g.qos_class,
                    price_per_gpu_hour=g.price_per_gpu_hour,
                )
    if "EgressPrice" in wanted and now is not None:
        prices = {
            (e.src, e.dst): e.price_per_gb
            for e in now.egress
            if e.src in current.clusters and e.dst in current.clusters
        }
        for (src, dst), price in sorted(prices.items()):
            pair = prices.get((dst, src))
            if pair == price and dst < src:
                continue  # written by the symmetric document of (dst, src)
            yield EgressPriceDoc(
                kind="EgressPrice", src=src, dst=dst, price_per_gb=price, symmetric=pair == price
            )


def _link_docs(links: Mapping[tuple[str, str], LinkOut]) -> Iterator[LinkDoc]:
    def values(link: LinkOut) -> tuple[Any, ...]:
        return tuple(getattr(link, k) for k in LINK_VALUES)

    for (src, dst), link in sorted(links.items()):
        back = links.get((dst, src))
        both = back is not None and values(back) == values(link)
        if both and dst < src:
            continue  # written by the symmetric document of (dst, src)
        yield LinkDoc(
            kind="Link",
            src=src,
            dst=dst,
            symmetric=both,
            **{k: getattr(link, k) for k in LINK_VALUES},
        )


def dump_yaml(docs: Iterable[Doc]) -> str:
    """Multi-document YAML, keys in field order."""
    return yaml.safe_dump_all(
        (d.document() for d in docs), sort_keys=False, explicit_start=True, allow_unicode=True
    )
