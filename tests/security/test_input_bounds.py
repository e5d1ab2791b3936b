"""Input bounds: too long, too large, too deep, malformed or out of range is a 4xx problem
naming the field, never a 500 and never stored (issue 14, item 9).

The pagination, query-parameter and path-parameter sweeps walk the live OpenAPI document, so
a new list endpoint or parameter is covered without being listed here.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest

from tests.security.conftest import (
    Answer,
    Fresh,
    World,
    assert_problem,
    call,
    module_job,
    problem_issues,
)
from tests.security.routes import documented, query_parameters, resolve
from tests.service.conftest import spec

MEASURED_NOW = datetime.now(UTC).isoformat()
"""A link measurement's time the server takes: now (issue 48 bounds its skew)."""

# ---- body size ------------------------------------------------------------------------------


def _padded(size: int) -> bytes:
    """A valid job spec of exactly `size` bytes (JSON allows trailing whitespace)."""
    body = json.dumps(spec(name="padded")).encode()
    return body + b" " * (size - len(body))


def _chunks(body: bytes, size: int = 16 * 1024) -> Iterator[bytes]:
    for i in range(0, len(body), size):
        yield body[i : i + size]


def _total(http: httpx.Client, token: str) -> int:
    answer = call(http, "GET", "/v1/jobs", token)
    assert answer.status == 200, str(answer)
    return int(answer.body["total"])


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
@pytest.mark.parametrize("who", ["tenant", "anonymous"])
def test_a_body_over_the_limit_is_a_413_problem(
    world: World, http: httpx.Client, framing: str, who: str
) -> None:
    body = _padded(world.max_body_bytes + 1)
    before = _total(http, world.tenant_a)
    answer = call(
        http,
        "POST",
        "/v1/jobs",
        world.tenant_a if who == "tenant" else None,
        content=body if framing == "content-length" else _chunks(body),
        headers={"Content-Type": "application/json"},
    )
    assert_problem(answer, 413)
    assert str(world.max_body_bytes) in answer.body["detail"], "the problem should say the limit"
    assert _total(http, world.tenant_a) == before


def test_a_body_at_the_limit_is_read(world: World, http: httpx.Client) -> None:
    """The control for the 413s: exactly CPN_MAX_BODY_BYTES is a job."""
    body = _padded(world.max_body_bytes)
    assert len(body) == world.max_body_bytes
    headers = {"Content-Type": "application/json"}
    answer = call(http, "POST", "/v1/jobs", world.tenant_a, content=body, headers=headers)
    assert answer.status == 201, str(answer)
    assert call(http, "POST", f"/v1/jobs/{answer.body['id']}/cancel", world.tenant_a).status == 200


# ---- depth ----------------------------------------------------------------------------------


def _nested(depth: int, path: str = "/v1/jobs") -> bytes:
    """A job (or quote) of a module task whose free-form arguments nest `depth` deep."""
    args = '{"a":' * depth + "1" + "}" * depth
    head = json.dumps(module_job(name="nested", args={"task": {}}))
    return head.replace('"task": {}}', f'"task": {args}}}').encode()


def _post_raw(http: httpx.Client, path: str, token: str | None, body: bytes) -> Answer:
    headers = {"Content-Type": "application/json"}
    return call(http, "POST", path, token, content=body, headers=headers)


def test_nested_task_args_are_stored_as_sent(world: World, http: httpx.Client) -> None:
    answer = _post_raw(http, "/v1/jobs", world.tenant_a, _nested(32))
    assert answer.status == 201, str(answer)
    job = call(http, "GET", f"/v1/jobs/{answer.body['id']}", world.tenant_a)
    assert job.body["spec"]["args"] == json.loads(_nested(32))["args"]
    assert call(http, "POST", f"/v1/jobs/{answer.body['id']}/cancel", world.tenant_a).status == 200


@pytest.mark.parametrize("path", ["/v1/jobs", "/v1/quotes"])
def test_task_args_nested_too_deep_are_a_4xx_problem(
    world: World, http: httpx.Client, path: str
) -> None:
    before = _total(http, world.tenant_a)
    for depth in (300, 900, 5_000):
        assert_problem(_post_raw(http, path, world.tenant_a, _nested(depth)), 400, 422)
    assert _total(http, world.tenant_a) == before


def test_json_past_the_parsers_depth_is_a_4xx_problem(world: World, http: httpx.Client) -> None:
    for body in (_nested(50_000), b"[" * 200_000 + b"]" * 200_000):
        answer = _post_raw(http, "/v1/jobs", world.tenant_a, body)
        assert_problem(answer, 400, 413, 422)


def test_no_nesting_depth_is_a_500_or_breaks_the_job_lists(fresh: Fresh) -> None:
    """Every depth around the serialiser's limit, on a server of its own (it breaks lists)."""
    failures, stored = [], 0
    with httpx.Client(base_url=fresh.url, timeout=30) as http:
        for depth in range(200, 320):
            for path in ("/v1/jobs", "/v1/quotes"):
                answer = _post_raw(http, path, fresh.tenant, _nested(depth))
                stored += answer.status == 201
                if answer.status != 201 and problem_issues(answer, (400, 422)):
                    failures.append(f"depth {depth}: {answer}")
        assert stored, "no depth was accepted: the probe found nothing to list"
        for token in (fresh.tenant, fresh.admin):
            answer = call(http, "GET", "/v1/jobs", token)
            if answer.status != 200:
                failures.append(f"then: {answer}")
    assert not failures, "\n".join(failures)


# ---- strings --------------------------------------------------------------------------------

JOB = spec()
LONG_STRINGS: list[tuple[str, str, str, dict[str, Any], str]] = [
    ("tenant", "POST", "/v1/jobs", {**JOB, "name": "n" * 129}, "name"),
    ("tenant", "POST", "/v1/jobs", {**JOB, "task": "builtin:" + "a" * 249}, "task"),
    ("tenant", "POST", "/v1/jobs", {**JOB, "compression": "x" * 65}, "compression"),
    ("tenant", "POST", "/v1/jobs", {**JOB, "sync": "x" * 65}, "sync"),
    ("tenant", "POST", "/v1/jobs", {**JOB, "quote_id": "q" * 37}, "quote_id"),
    ("tenant", "POST", "/v1/jobs", {**JOB, "preference": ["us-east"] * 65}, "preference"),
    ("tenant", "POST", "/v1/quotes", {**JOB, "name": "n" * 129}, "name"),
    ("admin", "POST", "/v1/clusters", {"name": "a" * 64, "region": "r"}, "name"),
    ("admin", "POST", "/v1/clusters", {"name": "long-region", "region": "r" * 64}, "region"),
    (
        "admin",
        "POST",
        "/v1/clusters",
        {"name": "many-labels", "region": "r", "labels": {f"k{i}": "v" for i in range(65)}},
        "labels",
    ),
    ("admin", "PATCH", "/v1/clusters/victim", {"region": "r" * 64}, "region"),
    ("admin", "POST", "/v1/tenants", {"name": "t" * 64}, "name"),
    ("admin", "POST", "/v1/api-keys", {"role": "admin", "name": "k" * 129}, "name"),
    ("admin", "POST", "/v1/api-keys", {"role": "agent", "scope": "s" * 64}, "scope"),
    (
        "admin",
        "POST",
        "/v1/pricing/gpu",
        {
            "cluster": "us-east",
            "gpu_model": "m" * 129,
            "qos_class": "spot",
            "price_per_gpu_hour": 1,
        },
        "gpu_model",
    ),
    (
        "admin",
        "POST",
        "/v1/links",
        {"src": "s" * 64, "dst": "us-east", "bandwidth_gbps": 1, "rtt_ms": 1},
        "src",
    ),
    (
        "agent",
        "POST",
        "/v1/agent/heartbeat",
        {"cluster": "us-east", "agent_version": "v" * 65},
        "agent_version",
    ),
    (
        "agent",
        "POST",
        "/v1/agent/heartbeat",
        {"cluster": "us-east", "probe_url": "http://a/" + "p" * 510},
        "probe_url",
    ),
    (
        "agent",
        "POST",
        "/v1/agent/heartbeat",
        {
            "cluster": "us-east",
            "gpus": [{"model": "m", "memory_gib": 1, "count": 1, "allocatable": 1}] * 65,
        },
        "gpus",
    ),
    (
        "agent",
        "POST",
        "/v1/agent/heartbeat",
        {
            "cluster": "us-east",
            "gpus": [{"model": "m" * 129, "memory_gib": 1, "count": 1, "allocatable": 1}],
        },
        "gpus.0.model",
    ),
    (
        "agent",
        "POST",
        "/v1/agent/links",
        {
            "cluster": "us-east",
            "links": [
                {
                    "dst": "eu-west",
                    "bandwidth_gbps": 1,
                    "rtt_ms": 1,
                    "bytes_transferred": 1,
                    "measured_at": MEASURED_NOW,
                }
            ]
            * 1025,
        },
        "links",
    ),
]


@pytest.mark.parametrize(
    ("role", "method", "path", "body", "field"),
    LONG_STRINGS,
    ids=[f"{m} {p} {f}" for _, m, p, _, f in LONG_STRINGS],
)
def test_an_over_long_value_is_a_422_problem_naming_it(
    world: World,
    http: httpx.Client,
    role: str,
    method: str,
    path: str,
    body: dict[str, Any],
    field: str,
) -> None:
    assert_problem(call(http, method, path, world.token(role), json=body), 422, field=field)


@pytest.mark.parametrize(
    ("path", "headers", "params", "field"),
    [
        ("/v1/jobs", {"Idempotency-Key": "k" * 129}, {}, "idempotency-key"),
        ("/v1/jobs/{job}/events", {"Last-Event-ID": "1" * 21}, {"stream": "true"}, "last-event-id"),
        ("/v1/jobs/{job}/events", {"Last-Event-ID": "abc"}, {"stream": "true"}, "last-event-id"),
    ],
    ids=["Idempotency-Key", "Last-Event-ID too long", "Last-Event-ID not a number"],
)
def test_bad_headers_are_a_422_problem_naming_them(
    world: World,
    http: httpx.Client,
    path: str,
    headers: dict[str, str],
    params: dict[str, str],
    field: str,
) -> None:
    method = "POST" if path == "/v1/jobs" else "GET"
    answer = call(
        http,
        method,
        path.format(job=world.job_a),
        world.tenant_a,
        json=spec() if method == "POST" else None,
        headers=headers,
        params=params,
    )
    assert_problem(answer, 422, field=field)


# ---- declared bounds ------------------------------------------------------------------------

KNOWN_UNBOUNDED: frozenset[str] = frozenset()
"""Body fields without a declared bound (none now: a new one fails both checks below)."""


def _unbounded(world: World, schema: dict[str, Any], where: str, seen: frozenset[str]) -> list[str]:
    """Places in a request-body schema that take a value of any size: a string without
    maxLength (or enum/pattern/format), a number without maximum, an array without maxItems,
    a map without maxProperties, a free-form object."""
    ref = schema.get("$ref", "")
    if ref:
        if ref in seen:
            return []
        seen = seen | {ref}
    schema = resolve(world, schema)
    out = []
    for branch in schema.get("anyOf", []) + schema.get("oneOf", []) + schema.get("allOf", []):
        out += _unbounded(world, branch, where, seen)
    kind = schema.get("type")
    bounds = {"enum", "const", "pattern", "format"}
    if kind == "string" and not ({"maxLength"} | bounds) & schema.keys():
        out.append(where)
    if kind in ("integer", "number") and not {"maximum", "exclusiveMaximum"} & schema.keys():
        out.append(where)
    if kind == "array":
        if "maxItems" not in schema:
            out.append(where)
        out += _unbounded(world, schema.get("items", {}), where + "[]", seen)
    for name, sub in schema.get("properties", {}).items():
        out += _unbounded(world, sub, f"{where}.{name}".lstrip("."), seen)
    extra = schema.get("additionalProperties")
    if isinstance(extra, dict):
        if "maxProperties" not in schema:
            out.append(where)
        out += _unbounded(world, extra, where + "{}", seen)
    elif kind == "object" and not schema.get("properties") and extra is not False:
        out.append(where)  # free-form: any keys, any depth
    return out


def _unbounded_body_fields(world: World) -> set[str]:
    found = set()
    for op in documented(world):
        body = op.spec.get("requestBody", {}).get("content", {}).get("application/json")
        if body:
            found |= {
                f"{op.method} {op.template} {w}"
                for w in _unbounded(world, body["schema"], "", frozenset())
            }
    return found


def test_no_new_body_field_is_unbounded(world: World) -> None:
    """A field added later declares its bound (maxLength, maximum, maxItems...)."""
    new = _unbounded_body_fields(world) - KNOWN_UNBOUNDED
    assert not new, f"request-body fields without a bound: {sorted(new)}"


def test_every_body_field_declares_a_bound(world: World) -> None:
    assert not _unbounded_body_fields(world), sorted(_unbounded_body_fields(world))


# ---- numbers and times ----------------------------------------------------------------------

HUGE = "1" + "0" * 40
VAST = "1" + "0" * 400
_MARK = "__cpn_value__"


def _with(body: dict[str, Any], path: str, literal: str) -> bytes:
    """`body` as JSON with the value at dotted `path` replaced by the raw JSON `literal` (so
    NaN, Infinity and integers past any float can be sent)."""
    doc = json.loads(json.dumps(body))
    node: Any = doc
    parts = path.split(".")
    for part in parts[:-1]:
        node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
    last = parts[-1]
    if isinstance(node, list):
        node[int(last)] = _MARK
    else:
        node[last] = _MARK
    return json.dumps(doc).replace(json.dumps(_MARK), literal).encode()


GPU = {"model": "A100", "memory_gib": 80, "count": 8, "allocatable": 8}
LINK = {
    "dst": "eu-west",
    "bandwidth_gbps": 1,
    "rtt_ms": 1,
    "bytes_transferred": 1,
    "measured_at": MEASURED_NOW,
}
PRICE = {"cluster": "us-east", "gpu_model": "A100", "qos_class": "spot", "price_per_gpu_hour": 1}
NUMBERS: list[tuple[str, str, dict[str, Any], str, str]] = [
    ("tenant", "/v1/jobs", JOB, "gpus", HUGE),
    ("tenant", "/v1/jobs", JOB, "gpus", "0"),
    ("tenant", "/v1/jobs", JOB, "gpus", "2.5"),
    ("tenant", "/v1/jobs", JOB, "steps", HUGE),
    ("tenant", "/v1/jobs", JOB, "steps", "-1"),
    ("tenant", "/v1/jobs", JOB, "qos.priority", HUGE),
    ("tenant", "/v1/jobs", JOB, "qos.budget", "1e400"),
    ("tenant", "/v1/jobs", JOB, "qos.budget", "NaN"),
    ("tenant", "/v1/jobs", JOB, "qos.budget", VAST),
    ("tenant", "/v1/jobs", JOB, "qos.max_clusters", HUGE),
    ("tenant", "/v1/quotes", JOB, "steps", HUGE),
    ("admin", "/v1/tenants", {"name": "n1"}, "gpu_quota", HUGE),
    ("admin", "/v1/tenants", {"name": "n2"}, "budget", "NaN"),
    ("admin", "/v1/tenants", {"name": "n3"}, "budget", "Infinity"),
    ("admin", "/v1/tenants", {"name": "n4"}, "budget", "-Infinity"),
    ("admin", "/v1/tenants", {"name": "n5"}, "budget", VAST),
    ("admin", "/v1/tenants", {"name": "n6"}, "budget", "-1"),
    (
        "admin",
        "/v1/links",
        {"src": "us-east", "dst": "victim", "rtt_ms": 1},
        "bandwidth_gbps",
        "NaN",
    ),
    (
        "admin",
        "/v1/links",
        {"src": "us-east", "dst": "victim", "rtt_ms": 1},
        "bandwidth_gbps",
        "1e400",
    ),
    (
        "admin",
        "/v1/links",
        {"src": "us-east", "dst": "victim", "bandwidth_gbps": 1},
        "rtt_ms",
        "-1",
    ),
    ("admin", "/v1/pricing/gpu", PRICE, "price_per_gpu_hour", "NaN"),
    ("admin", "/v1/pricing/gpu", PRICE, "price_per_gpu_hour", "1e400"),
    ("admin", "/v1/pricing/gpu", PRICE, "price_per_gpu_hour", "-1"),
    ("agent", "/v1/agent/heartbeat", {"cluster": "us-east", "gpus": [GPU]}, "gpus.0.count", HUGE),
    (
        "agent",
        "/v1/agent/heartbeat",
        {"cluster": "us-east", "gpus": [GPU]},
        "gpus.0.memory_gib",
        "NaN",
    ),
    (
        "agent",
        "/v1/agent/heartbeat",
        {"cluster": "us-east", "gpus": [GPU]},
        "gpus.0.utilization",
        "Infinity",
    ),
    (
        "agent",
        "/v1/agent/links",
        {"cluster": "us-east", "links": [LINK]},
        "links.0.bandwidth_gbps",
        "Infinity",
    ),
    ("agent", "/v1/agent/links", {"cluster": "us-east", "links": [LINK]}, "links.0.rtt_ms", "NaN"),
    ("agent", "/v1/agent/links", {"cluster": "us-east", "links": [LINK]}, "links.0.loss", "NaN"),
]


@pytest.mark.parametrize(
    ("role", "path", "body", "field", "literal"),
    NUMBERS,
    ids=[f"{p} {f}={v[:8]}" for _, p, _, f, v in NUMBERS],
)
def test_an_out_of_range_number_is_a_422_problem_naming_it(
    world: World,
    http: httpx.Client,
    role: str,
    path: str,
    body: dict[str, Any],
    field: str,
    literal: str,
) -> None:
    answer = _post_raw(http, path, world.token(role), _with(body, field, literal))
    assert_problem(answer, 422, field=field)


FAR_FUTURE = "9999-12-31T23:59:59-14:00"
"""A valid RFC 3339 time whose UTC instant is past year 9999."""
FAR_PAST = "0001-01-01T00:00:00+14:00"


def _time_case(
    role: str,
    method: str,
    path: str,
    body: dict[str, Any] | None,
    query: dict[str, str],
    field: str,
) -> Any:
    return pytest.param(role, method, path, body, query, field, id=f"{path} {field}")


TIMES = [
    _time_case(
        "admin",
        "GET",
        "/v1/pricing",
        None,
        {"at": FAR_FUTURE},
        "at",
    ),
    _time_case(
        "admin",
        "GET",
        "/v1/pricing",
        None,
        {"at": FAR_PAST},
        "at",
    ),
    _time_case("admin", "GET", "/v1/pricing", None, {"at": "yesterday"}, "at"),
    _time_case(
        "admin",
        "POST",
        "/v1/pricing/gpu",
        {**PRICE, "effective_from": FAR_FUTURE},
        {},
        "effective_from",
    ),
    _time_case(
        "admin",
        "POST",
        "/v1/pricing/egress",
        {"src": "us-east", "dst": "eu-west", "price_per_gb": 1, "effective_from": FAR_FUTURE},
        {},
        "effective_from",
    ),
    _time_case(
        "agent",
        "POST",
        "/v1/agent/links",
        {"cluster": "us-east", "links": [{**LINK, "measured_at": "2026-01-01T00:00:00"}]},
        {},
        "links.0.measured_at",
    ),
    _time_case(
        "agent",
        "POST",
        "/v1/agent/links",
        {"cluster": "us-east", "links": [{**LINK, "measured_at": FAR_PAST}]},
        {},
        "links.0.measured_at",
    ),
    _time_case(
        "tenant",
        "POST",
        "/v1/jobs",
        {**JOB, "qos": {"deadline": "2026-12-01T12:00:00"}},
        {},
        "qos.deadline",
    ),
]


@pytest.mark.parametrize(("role", "method", "path", "body", "query", "field"), TIMES)
def test_an_unusable_time_is_a_422_problem_naming_it(
    world: World,
    http: httpx.Client,
    role: str,
    method: str,
    path: str,
    body: dict[str, Any] | None,
    query: dict[str, str],
    field: str,
) -> None:
    answer = call(http, method, path, world.token(role), json=body, params=query)
    assert_problem(answer, 422, field=field)


# ---- query parameters -----------------------------------------------------------------------

BAD_PAGES = {
    "limit": ["0", "-1", "501", "ten", "1e3", "1.5", HUGE, ""],
    "offset": ["-1", "ten", HUGE, VAST],
}


def _reader(world: World, op: Any) -> str:
    return world.token(sorted(op.roles)[0])


def test_bad_pagination_is_a_422_problem_naming_the_parameter(
    world: World, http: httpx.Client
) -> None:
    failures = []
    lists = 0
    for op in documented(world):
        names = {p["name"] for p in query_parameters(op)}
        if op.method != "GET" or not {"limit", "offset"} <= names:
            continue
        lists += 1
        for name, values in BAD_PAGES.items():
            for value in values:
                answer = call(
                    http,
                    "GET",
                    op.path(world.path_values()),
                    _reader(world, op),
                    params={name: value},
                )
                issues = problem_issues(answer, (422,), field=name)
                if issues:
                    failures.append(f"{op} {name}={value[:12]!r}: {'; '.join(issues)}")
    assert lists >= 10
    assert not failures, "\n".join(failures)


def _junk_for(world: World, param: dict[str, Any]) -> str | None:
    """A value the parameter's schema refuses, or None when any string of any length fits."""
    schema = resolve(world, param.get("schema", {}))
    kind = schema.get("type")
    if "enum" in schema or "pattern" in schema or kind in ("integer", "number", "boolean"):
        return "zz-not-valid"
    if schema.get("format") == "date-time":
        return "not-a-time"
    if kind == "string" and "maxLength" in schema:
        return "x" * (int(schema["maxLength"]) + 1)
    return None


def test_every_query_parameter_refuses_junk_with_a_422_naming_it(
    world: World, http: httpx.Client
) -> None:
    """Each query parameter of the document gets a value its schema refuses; a parameter that
    takes any string at all is itself a finding (it has no bound)."""
    failures, unbounded = [], []
    for op in documented(world):
        for param in query_parameters(op):
            name = param["name"]
            if name in BAD_PAGES:
                continue
            junk = _junk_for(world, param)
            if junk is None:
                unbounded.append(f"{op} ?{name}")
                continue
            answer = call(
                http,
                op.method,
                op.path(world.path_values()),
                _reader(world, op),
                params={name: junk},
            )
            issues = problem_issues(answer, (422,), field=name)
            if issues:
                failures.append(f"{op} ?{name}={junk[:16]!r}: {'; '.join(issues)}")
    assert not unbounded, f"query parameters without a bound: {unbounded}"
    assert not failures, "\n".join(failures)


# ---- path parameters ------------------------------------------------------------------------

ODD_IDS = [
    "x" * 2048,
    "%00",
    "a%00b",
    "%FF%FE",
    "%E2%80%AE",
    "..%2F..%2Fhealthz",
    "'%20OR%20'1'='1",
    "%25",
    "-1",
    "0",
]


def test_odd_path_values_are_4xx_problems(world: World, http: httpx.Client) -> None:
    failures = []
    for op in documented(world):
        if not op.params:
            continue
        for odd in ODD_IDS:
            path = op.path(dict.fromkeys(op.params, odd))
            answer = call(
                http,
                op.method,
                path,
                _reader(world, op),
                json={} if op.has_body else None,
            )
            if problem_issues(answer, (404, 405, 422)):
                failures.append(str(answer))
    assert not failures, "\n".join(failures)


# ---- malformed bodies -----------------------------------------------------------------------

ODD_BODIES: dict[str, tuple[bytes, str]] = {
    "empty": (b"", "application/json"),
    "null": (b"null", "application/json"),
    "a list": (b"[]", "application/json"),
    "a string": (b'"x"', "application/json"),
    "a number": (b"1", "application/json"),
    "not UTF-8": (b'{"name": "\xff\xfe"}', "application/json"),
    "form-encoded": (b"name=a&task=b", "application/x-www-form-urlencoded"),
    "plain text": (b'{"name": "a"}', "text/plain"),
}


@pytest.mark.parametrize("kind", sorted(ODD_BODIES))
def test_an_odd_body_is_a_4xx_problem(world: World, http: httpx.Client, kind: str) -> None:
    content, ctype = ODD_BODIES[kind]
    failures = []
    for op in documented(world):
        if "requestBody" not in op.spec:
            continue
        answer = call(
            http,
            op.method,
            op.path(world.path_values()),
            _reader(world, op),
            content=content,
            headers={"Content-Type": ctype},
        )
        if problem_issues(answer, (400, 415, 422)):
            failures.append(str(answer))
    assert not failures, "\n".join(failures)


def test_malformed_json_is_a_problem_that_says_so(world: World, http: httpx.Client) -> None:
    answer = _post_raw(http, "/v1/jobs", world.tenant_a, b'{"name": "a",')
    assert_problem(answer, 400, 422)
    assert "json" in answer.body["detail"].lower(), answer.body["detail"]


NUL_CASES = [
    ("tenant", "POST", "/v1/jobs", {**JOB, "name": "a\x00b"}, "name"),
    ("admin", "POST", "/v1/clusters", {"name": "nul-region", "region": "r\x00"}, "region"),
    ("admin", "POST", "/v1/api-keys", {"role": "admin", "name": "k\x00"}, "name"),
    (
        "agent",
        "POST",
        "/v1/agent/heartbeat",
        {"cluster": "us-east", "agent_version": "v\x00"},
        "agent_version",
    ),
]


@pytest.mark.parametrize(
    ("role", "method", "path", "body", "field"),
    NUL_CASES,
    ids=[f"{p} {f}" for _, _, p, _, f in NUL_CASES],
)
def test_a_nul_character_is_a_422_problem_naming_the_field(
    world: World,
    http: httpx.Client,
    role: str,
    method: str,
    path: str,
    body: dict[str, Any],
    field: str,
) -> None:
    assert_problem(call(http, method, path, world.token(role), json=body), 422, field=field)
