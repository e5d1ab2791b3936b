"""HTTP calls from an agent to the control plane, with failures sorted into kinds.

Every failure becomes a `ControllerError` whose message is one line fit for a log, so the
run loop can log it and back off without caring which layer broke.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
from pydantic import BaseModel, ValidationError

from agents.protocol import Heartbeat, HeartbeatAck, LinkReport

HEARTBEAT_PATH = "/v1/agent/heartbeat"
LINKS_PATH = "/v1/agent/links"


class ControllerError(Exception):
    """A call to the controller failed; `retry_after_s` is the server's hint, if it gave one."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Unreachable(ControllerError):
    """No HTTP answer: connection refused, DNS, timeout."""


class BadResponse(ControllerError):
    """An answer that is not the protocol: not JSON, or the wrong shape."""


class ServerError(ControllerError):
    """5xx: the controller is there but failing."""


class Rejected(ControllerError):
    """4xx: the controller refused this request (bad token, unknown cluster, bad body)."""

    def __init__(self, message: str, status: int, retry_after_s: float | None = None) -> None:
        super().__init__(message, retry_after_s)
        self.status = status


def _retry_after(response: httpx.Response) -> float | None:
    raw = response.headers.get("Retry-After")
    try:
        return max(0.0, float(raw)) if raw is not None else None
    except ValueError:  # the HTTP-date form; the backoff handles it
        return None


def _problem_detail(response: httpx.Response) -> str:
    """The RFC 9457 problem's detail (or title), else a short excerpt of the body."""
    try:
        body: Any = response.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        body = None
    if isinstance(body, dict):
        for key in ("detail", "title"):
            if isinstance(body.get(key), str) and body[key]:
                return str(body[key])
    text = response.text.strip().replace("\n", " ")
    return text[:200] if text else response.reason_phrase


class ControllerClient:
    def __init__(
        self, base_url: str, token: str, *, timeout_s: float = 10.0, user_agent: str = "cpn-agent"
    ) -> None:
        self._http = httpx.Client(
            base_url=base_url.rstrip("/"),
            headers={"Authorization": f"Bearer {token}", "User-Agent": user_agent},
            timeout=timeout_s,
        )

    def close(self) -> None:
        self._http.close()

    def _post(self, path: str, payload: BaseModel) -> httpx.Response:
        try:
            response = self._http.post(
                path,
                content=payload.model_dump_json(),
                headers={"Content-Type": "application/json"},
            )
        except httpx.HTTPError as exc:
            raise Unreachable(
                f"controller unreachable at {self._http.base_url}{path}: "
                f"{type(exc).__name__}: {exc}"
            ) from None
        status = response.status_code
        if status >= 500:
            raise ServerError(
                f"controller error HTTP {status} on {path}: {_problem_detail(response)}",
                _retry_after(response),
            )
        if status in (401, 403):
            raise Rejected(
                f"controller refused the agent token (HTTP {status}): {_problem_detail(response)}"
                " — check --token / CPN_AGENT_TOKEN and that it is bound to this cluster",
                status,
                _retry_after(response),
            )
        if status >= 400:
            raise Rejected(
                f"controller rejected {path} (HTTP {status}): {_problem_detail(response)}",
                status,
                _retry_after(response),
            )
        return response

    def heartbeat(self, beat: Heartbeat) -> HeartbeatAck:
        response = self._post(HEARTBEAT_PATH, beat)
        try:
            ack = HeartbeatAck.model_validate_json(response.content)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "body"
            raise BadResponse(
                f"controller answered HTTP {response.status_code} with no valid HeartbeatAck "
                f"({where}: {first['msg']}): {response.content[:120]!r}"
            ) from None
        if ack.cluster != beat.cluster:
            raise BadResponse(
                f"controller acknowledged cluster {ack.cluster!r}, not {beat.cluster!r}"
            )
        return ack

    def report_links(self, report: LinkReport) -> None:
        self._post(LINKS_PATH, report)
