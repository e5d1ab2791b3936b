"""Every route of the live app and who may call it: the one place the suite's policy lives.

Routes come from the live OpenAPI document, plus any route the document hides (found by
walking the app), so a route added later is checked without anyone listing it here. A new
route is admin-only unless this file says otherwise: a tenant, agent or provider route that is not
listed below fails the checks until its roles are written down.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from tests.security.conftest import World

PUBLIC_PATHS = frozenset({"/healthz", "/readyz", "/metrics", "/openapi.json", "/docs", "/redoc"})
"""The routes that answer without a key. Exactly these: the suite checks both ways."""

CONSOLE_PREFIX = "/ui"
"""The web console (`api/ui`): page shells and its sign-in, left out of the OpenAPI document.
They hold no data of their own: their pages read it from the routes checked here, with a
session cookie standing in for the bearer key. `tests/ui` checks their sign-in, CSRF token,
sign-out and scoping in a browser."""

ROLES = ("admin", "tenant", "agent", "provider")
ANY_KEY = frozenset(ROLES)
TENANT_OR_ADMIN = frozenset({"tenant", "admin"})
PROVIDER_OR_ADMIN = frozenset({"provider", "admin"})
ROLE_POLICY: dict[tuple[str, str], frozenset[str]] = {
    ("POST", "/v1/agent/heartbeat"): frozenset({"agent"}),
    ("POST", "/v1/agent/links"): frozenset({"agent"}),
    ("POST", "/v1/quotes"): frozenset({"tenant"}),
    ("GET", "/v1/quotes/{quote_id}"): frozenset({"tenant"}),
    ("POST", "/v1/jobs"): frozenset({"tenant"}),
    ("GET", "/v1/jobs"): TENANT_OR_ADMIN,
    ("GET", "/v1/jobs/{job_id}"): TENANT_OR_ADMIN,
    ("POST", "/v1/jobs/{job_id}/cancel"): TENANT_OR_ADMIN,
    ("GET", "/v1/jobs/{job_id}/events"): TENANT_OR_ADMIN,
    ("GET", "/v1/jobs/{job_id}/metrics"): TENANT_OR_ADMIN,
    ("GET", "/v1/jobs/{job_id}/logs"): TENANT_OR_ADMIN,
    ("GET", "/v1/tenants/{tenant_id}/usage"): TENANT_OR_ADMIN,
    ("GET", "/v1/tenants/{tenant_id}/ledger"): TENANT_OR_ADMIN,
    ("GET", "/v1/pricing"): ANY_KEY,
    ("POST", "/v1/pricing/gpu"): PROVIDER_OR_ADMIN,
    ("POST", "/v1/pricing/egress"): PROVIDER_OR_ADMIN,
    ("POST", "/v1/pricing/bandwidth"): PROVIDER_OR_ADMIN,
    ("GET", "/v1/providers/{provider_id}"): PROVIDER_OR_ADMIN,
    ("GET", "/v1/providers/{provider_id}/clusters"): PROVIDER_OR_ADMIN,
    ("GET", "/v1/providers/{provider_id}/offers"): PROVIDER_OR_ADMIN,
    ("GET", "/v1/providers/{provider_id}/statement"): PROVIDER_OR_ADMIN,
    ("GET", "/v1/providers/{provider_id}/payouts"): PROVIDER_OR_ADMIN,
    ("GET", "/v1/providers/{provider_id}/slas"): PROVIDER_OR_ADMIN,
    ("POST", "/v1/providers/{provider_id}/slas"): frozenset({"provider"}),
}
"""Roles admitted by each non-admin route; every other route admits admins only."""

BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
_PARAM = re.compile(r"{([^}]+)}")


@dataclass(frozen=True)
class Operation:
    """One method on one route, optionally with query parameters that change what it does."""

    method: str
    template: str
    query: tuple[tuple[str, str], ...] = ()
    spec: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def public(self) -> bool:
        return self.template in PUBLIC_PATHS

    @property
    def roles(self) -> frozenset[str]:
        return ROLE_POLICY.get((self.method, self.template), frozenset({"admin"}))

    @property
    def params(self) -> list[str]:
        return _PARAM.findall(self.template)

    @property
    def has_body(self) -> bool:
        return self.method in BODY_METHODS

    def path(self, values: dict[str, str]) -> str:
        missing = [p for p in self.params if p not in values]
        assert not missing, (
            f"{self.method} {self.template}: add a plausible value for path parameter(s) "
            f"{missing} to World.path_values in tests/security/conftest.py"
        )
        return _PARAM.sub(lambda m: values[m.group(1)], self.template)

    def __str__(self) -> str:
        query = "&".join(f"{k}={v}" for k, v in self.query)
        return f"{self.method} {self.template}" + (f"?{query}" if query else "")


def _walk(routes: list[Any]) -> Iterator[tuple[str, str, bool]]:
    """(method, path, in the schema) of every route, through included routers and mounts."""
    for route in routes:
        inner = getattr(route, "original_router", None) or getattr(route, "app", None)
        nested = getattr(inner, "routes", None) if inner is not None else None
        if nested is None:
            nested = getattr(route, "routes", None)
        path, methods = getattr(route, "path", None), getattr(route, "methods", None)
        if path and methods:
            for method in methods:
                if method != "HEAD":  # HEAD is GET without a body: GET is what is checked
                    yield method, path, bool(getattr(route, "include_in_schema", True))
        elif nested:
            yield from _walk(list(nested))


def documented(world: World) -> list[Operation]:
    """The operations of the live OpenAPI document."""
    out = []
    for path, item in world.openapi["paths"].items():
        for method, spec in item.items():
            if method.upper() in {"GET", "POST", "PUT", "PATCH", "DELETE"}:
                out.append(Operation(method.upper(), path, spec=spec))
    return out


def hidden(world: World) -> list[Operation]:
    """Routes served but left out of the OpenAPI document (the docs pages, say)."""
    known = {(o.method, o.template) for o in documented(world)}
    return sorted(
        {
            Operation(m, p)
            for m, p, _ in _walk(list(world.app.routes))
            if (m, p) not in known and p.split("/")[1] != CONSOLE_PREFIX.strip("/")
        },
        key=str,
    )


def operations(world: World) -> list[Operation]:
    """Every operation to check: documented, hidden, and the event-stream form of a route."""
    ops = documented(world) + hidden(world)
    streams = [
        Operation(o.method, o.template, (("stream", "true"),), o.spec)
        for o in ops
        if any(p.get("name") == "stream" for p in o.spec.get("parameters", []))
    ]
    return ops + streams


def query_parameters(op: Operation) -> list[dict[str, Any]]:
    return [p for p in op.spec.get("parameters", []) if p.get("in") == "query"]


def resolve(world: World, schema: dict[str, Any]) -> dict[str, Any]:
    """A schema with its `$ref` followed and a nullable `anyOf` reduced to its one real branch."""
    schemas = world.openapi.get("components", {}).get("schemas", {})
    while True:
        if "$ref" in schema:
            schema = schemas[schema["$ref"].rsplit("/", 1)[-1]]
            continue
        branches = [b for b in schema.get("anyOf", []) if b.get("type") != "null"]
        if len(branches) == 1:
            schema = branches[0]
            continue
        return schema
