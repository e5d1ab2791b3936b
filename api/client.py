"""A small Python client for the cpn REST API; the `cpn` CLI uses it too."""

from __future__ import annotations

import itertools
import json
import os
import time
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import httpx
import stamina
from httpx_sse import EventSource

from wire import JobLogOut, JobMetricOut, JobOut, JobSpec, QuoteOut

DEFAULT_URL = "http://127.0.0.1:8000"


class ApiError(Exception):
    """A problem answer from the API (RFC 9457), or a transport failure (status 0)."""

    def __init__(self, status: int, title: str, detail: str, errors: list[Any] | None = None):
        super().__init__(f"{status} {title}: {detail}" if status else detail)
        self.status, self.title, self.detail, self.errors = status, title, detail, errors or []


class Client:
    """Talks to one cpn control plane with one bearer key."""

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        timeout: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.url = (url or os.environ.get("CPN_URL") or DEFAULT_URL).rstrip("/")
        token = token or os.environ.get("CPN_TOKEN")
        self.keyless = not token
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(
            base_url=self.url, headers=headers, timeout=timeout, transport=transport
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise ApiError(0, "unreachable", f"cannot reach {self.url}: {exc}") from exc
        if response.status_code >= 400:
            try:
                body = response.json()
            except ValueError:
                body = {}
            detail = str(body.get("detail", response.text[:200]))
            if response.status_code == 401 and self.keyless:
                detail += (
                    "; no API key was sent: pass --token, set CPN_TOKEN, or `cpn login` "
                    "(the local `cpn serve` writes its admin key to var/admin-token)"
                )
            raise ApiError(
                response.status_code,
                str(body.get("title", response.reason_phrase)),
                detail,
                body.get("errors"),
            )
        if response.status_code == 204 or not response.content:
            return None
        return response.json()

    def get(self, path: str, **params: Any) -> Any:
        # httpx replaces a path's own query string with `params` when any are given, even {}
        given = {k: v for k, v in params.items() if v is not None}
        return self.request("GET", path, params=given or None)

    def post(self, path: str, body: Any = None) -> Any:
        return self.request("POST", path, json=body)

    def paginate(self, path: str, page_size: int = 500, **params: Any) -> Iterator[Any]:
        """Every item of a paginated list, fetching page after page."""
        offset = 0
        while True:
            page = self.get(path, limit=page_size, offset=offset, **params)
            yield from page["items"]
            offset += len(page["items"])
            if not page["items"] or offset >= page["total"]:
                return

    # Admin helpers used by the CLI and the demo.
    def create_cluster(self, name: str, region: str, **labels: str) -> Any:
        return self.post("/v1/clusters", {"name": name, "region": region, "labels": labels})

    def declare_link(self, src: str, dst: str, **values: Any) -> Any:
        return self.post("/v1/links", {"src": src, "dst": dst, **values})

    def create_api_key(
        self, role: str, scope: str | None = None, name: str = "", expires_at: str | None = None
    ) -> Any:
        """Mint a key (`expires_at`: ISO 8601 with an offset; none: until revoked)."""
        body: dict[str, Any] = {"role": role, "scope": scope, "name": name}
        if expires_at is not None:
            body["expires_at"] = expires_at
        return self.post("/v1/api-keys", body)

    def clusters(self) -> list[Any]:
        return list(self.paginate("/v1/clusters"))

    def links(self, view: str = "effective") -> list[Any]:
        return list(self.paginate("/v1/links", view=view))

    def gpus(self) -> list[Any]:
        return list(self.paginate("/v1/gpus"))

    def ports(self) -> list[Any]:
        """Every datacenter's uplink and downlink: capacity, reserved, free, holders."""
        return list(self.paginate("/v1/network/ports"))

    # Tenant helpers: quotes, jobs, their events and metrics, usage and the ledger.
    def quote(self, spec: JobSpec | Mapping[str, Any]) -> QuoteOut:
        """Price options for a spec (dict or JobSpec): fastest, cheapest, within the deadline."""
        return QuoteOut.model_validate(self.post("/v1/quotes", _spec_body(spec)))

    def submit(
        self,
        spec: JobSpec | Mapping[str, Any],
        idempotency_key: str | None = None,
        *,
        retries: int = 2,
    ) -> JobOut:
        """Submit a job; transport failures are retried under one Idempotency-Key, so at most
        one job is created (a key is generated when none is given)."""
        key = idempotency_key or f"cpn-{uuid.uuid4()}"
        body = _spec_body(spec)
        answer: Any = None
        for attempt in stamina.retry_context(
            on=_transient, attempts=retries + 1, timeout=None, wait_initial=0.2, wait_max=2.0,
            wait_jitter=0.2,
        ):  # fmt: skip
            with attempt:
                answer = self.request(
                    "POST", "/v1/jobs", json=body, headers={"Idempotency-Key": key}
                )
        return JobOut.model_validate(answer)

    def jobs(self, state: str | None = None, limit: int | None = None) -> list[JobOut]:
        """Your jobs (an admin: everyone's), newest first; at most `limit` of them."""
        pages = self.paginate("/v1/jobs", page_size=min(limit or 500, 500), state=state)
        return [JobOut.model_validate(j) for j in itertools.islice(pages, limit)]

    def job(self, job_id: str) -> JobOut:
        return JobOut.model_validate(self.get(f"/v1/jobs/{job_id}"))

    def cancel(self, job_id: str, version: int | None = None) -> JobOut:
        """Cancel a job; with `version` (its ETag) only if nobody changed it since."""
        headers = {"If-Match": f'"{version}"'} if version is not None else {}
        answer = self.request("POST", f"/v1/jobs/{job_id}/cancel", headers=headers)
        return JobOut.model_validate(answer)

    def events(
        self, job_id: str, after: int | None = None, *, reconnects: int = 3, busy_retries: int = 10
    ) -> Iterator[Any]:
        """A job's events as they happen (server-sent events), ending when the job has ended.

        The server ends each stream after its lifetime (`event: resume`) and this resumes it
        at once from the last event seen (Last-Event-ID), so none is lost or repeated; a
        dropped stream is resumed the same way, up to `reconnects` times in a row. A 429 (this
        key holds the most streams the server allows) is retried after its Retry-After, up to
        `busy_retries` times. A stream ended by the server because the key was revoked or
        expired raises its problem as ApiError (401)."""
        yield from self._stream(
            job_id, "events", {"stream": "true"}, after, reconnects, busy_retries
        )

    def logs(
        self, job_id: str, source: str | None = None, after: int | None = None
    ) -> Iterator[JobLogOut]:
        """A job's log lines as they are written (server-sent events), from the line after
        `after`, ending when the job has ended and every line is sent; resumed as `events`."""
        params = {"follow": "true", **({"source": source} if source is not None else {})}
        for line in self._stream(job_id, "logs", params, after, 3, 10):
            yield JobLogOut.model_validate(line)

    def _stream(
        self,
        job_id: str,
        what: str,
        params: dict[str, str],
        after: int | None,
        reconnects: int,
        busy_retries: int,
    ) -> Iterator[Any]:
        """The server-sent events of `/v1/jobs/{job_id}/{what}`, resumed (see `events`)."""
        last, failures, busy = after, 0, 0
        while True:
            headers = {"Accept": "text/event-stream"}
            if last is not None:
                headers["Last-Event-ID"] = str(last)
            resumed = False
            try:
                with self._http.stream(
                    "GET", f"/v1/jobs/{job_id}/{what}", params=params, headers=headers
                ) as response:
                    if response.status_code == 429 and busy < busy_retries:
                        response.read()
                        busy += 1
                        time.sleep(_retry_after(response))
                        continue
                    if response.status_code >= 400:
                        response.read()
                        raise _problem(response)
                    for message in EventSource(response).iter_sse():
                        kind, data = message.event, message.data
                        if kind == "end":
                            return
                        if kind == "resume":
                            resumed = True
                            break
                        if kind == "error":
                            raise _problem_of(data)
                        if data:
                            event = json.loads(data)
                            last = event.get("id", last)
                            failures = 0
                            yield event
                reason = "the server closed the stream before the job ended"
            except httpx.TransportError as exc:
                reason = str(exc) or exc.__class__.__name__
            if resumed:
                failures = 0
                continue
            failures += 1
            if failures > reconnects:
                raise ApiError(0, "unreachable", f"{what} stream of job {job_id} broke: {reason}")
            time.sleep(min(0.25 * 2**failures, 2.0))

    def metrics(self, job_id: str) -> list[JobMetricOut]:
        """Progress reports: step, loss, accuracy, step time, WAN bytes."""
        return [JobMetricOut.model_validate(m) for m in self.paginate(f"/v1/jobs/{job_id}/metrics")]

    def pricing(self) -> Any:
        """The prices that apply now, per cluster, GPU model and QoS class, and per link."""
        return self.get("/v1/pricing")

    def tenant_id(self) -> str:
        """The tenant of this key, found from its jobs (the API has no who-am-I).

        Raises LookupError for admin keys (they see every tenant) and for tenants with no
        job yet."""
        try:
            self.get("/v1/tenants", limit=1)
        except ApiError as exc:
            if exc.status != 403:
                raise
        else:
            raise LookupError("an admin key sees every tenant: name one with its tenant id")
        page = self.get("/v1/jobs", limit=1)
        if not page["items"]:
            raise LookupError(
                "this tenant key has no jobs yet, so its tenant id is not known here: "
                "pass it explicitly (your admin has it)"
            )
        return str(page["items"][0]["tenant_id"])

    def usage(self, tenant_id: str | None = None) -> Any:
        """Metered GPU-seconds and WAN bytes of a tenant (default: this key's tenant)."""
        return self.get(f"/v1/tenants/{tenant_id or self.tenant_id()}/usage")

    def ledger(self, tenant_id: str | None = None) -> Any:
        """A tenant's ledger: its exact total and every entry, oldest first."""
        tenant_id = tenant_id or self.tenant_id()
        first = self.get(f"/v1/tenants/{tenant_id}/ledger", limit=500)
        items = list(first["items"])
        while items and len(items) < first["total_items"]:
            page = self.get(f"/v1/tenants/{tenant_id}/ledger", limit=500, offset=len(items))
            if not page["items"]:
                break
            items.extend(page["items"])
        return {**first, "items": items, "limit": len(items), "offset": 0}


def _spec_body(spec: JobSpec | Mapping[str, Any]) -> Any:
    """A JobSpec as JSON, only the fields that were given; a mapping as it is."""
    if isinstance(spec, JobSpec):
        return spec.model_dump(mode="json", exclude_unset=True)
    return dict(spec)


def _problem(response: httpx.Response) -> ApiError:
    try:
        body = response.json()
    except ValueError:
        body = {}
    return ApiError(
        response.status_code,
        str(body.get("title", response.reason_phrase)),
        str(body.get("detail", response.text[:200])),
        body.get("errors"),
    )


def _problem_of(data: str) -> ApiError:
    """The problem an `event: error` carries."""
    try:
        body = json.loads(data)
    except ValueError:
        body = {}
    if not isinstance(body, dict):
        body = {}
    return ApiError(
        int(body.get("status") or 500),
        str(body.get("title", "Stream error")),
        str(body.get("detail", data[:200])),
        body.get("errors"),
    )


def _retry_after(response: httpx.Response, most: float = 30.0) -> float:
    """Seconds a 429 asks to wait (1 when it does not say), at most `most`."""
    try:
        return min(max(float(response.headers.get("Retry-After", "1")), 0.0), most)
    except ValueError:
        return 1.0


def _transient(exc: Exception) -> bool:
    """A failure a retry under the same Idempotency-Key may get past: the server unreachable,
    or a proxy's 502/503/504."""
    return isinstance(exc, ApiError) and exc.status in (0, 502, 503, 504)
