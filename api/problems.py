"""RFC 9457 problem details for every error the API returns."""

from __future__ import annotations

import logging
import re
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.dependencies.models import Dependant
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel
from sqlalchemy.exc import DataError, IntegrityError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.orm.exc import StaleDataError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.deps import get_principal, request_principal
from controller.values.errors import CpnError

log = logging.getLogger("cpn.api")

PROBLEM_BASE = "https://cpn.dev/problems/"
PROBLEM_MEDIA_TYPE = "application/problem+json"


class FieldError(BaseModel):
    field: str
    message: str


class Problem(BaseModel):
    """RFC 9457 problem details, with `errors` naming each bad field."""

    type: str
    title: str
    status: int
    detail: str
    instance: str | None = None
    errors: list[FieldError] | None = None


def problem(
    status: int,
    title: str,
    detail: str,
    *,
    slug: str,
    instance: str | None = None,
    errors: list[dict[str, str]] | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body: dict[str, Any] = {
        "type": PROBLEM_BASE + slug,
        "title": title,
        "status": status,
        "detail": detail,
    }
    if instance:
        body["instance"] = instance
    if errors:
        body["errors"] = errors
    return JSONResponse(body, status_code=status, media_type=PROBLEM_MEDIA_TYPE, headers=headers)


_HTTP_SLUGS = {
    401: ("unauthorized", "Unauthorized"),
    403: ("forbidden", "Forbidden"),
    404: ("not-found", "Not found"),
    405: ("method-not-allowed", "Method not allowed"),
    409: ("conflict", "Conflict"),
    413: ("payload-too-large", "Payload too large"),
    415: ("unsupported-media-type", "Unsupported media type"),
}


RETRY_AFTER_S = 1
"""What a 503 asks the client to wait: a busy pool or a database restart is seconds away."""

_API_FIELDS = {"idempotency_key": "Idempotency-Key"}
"""Columns whose name on the API differs from the database's."""


@dataclass(frozen=True)
class Violation:
    """What a refused write broke, read from the driver's error (SQLite or PostgreSQL)."""

    kind: str  # unique | foreign-key | not-null | check | other
    table: str | None
    columns: tuple[str, ...]
    constraint: str | None


_SQLITE_KINDS = (
    ("UNIQUE constraint failed: ", "unique"),
    ("NOT NULL constraint failed: ", "not-null"),
    ("CHECK constraint failed: ", "check"),
    ("FOREIGN KEY constraint failed", "foreign-key"),
)
_PG_KINDS = {"23505": "unique", "23503": "foreign-key", "23502": "not-null", "23514": "check"}


def violation(exc: IntegrityError) -> Violation:
    """Parse an IntegrityError: PostgreSQL's diagnostics, or SQLite's message."""
    orig = exc.orig
    diag = getattr(orig, "diag", None)
    if diag is not None:  # psycopg
        kind = _PG_KINDS.get(getattr(orig, "sqlstate", None) or "", "other")
        detail = diag.message_detail or ""
        columns: tuple[str, ...] = ()
        key = re.match(r"Key \((.+?)\)=", detail)
        if key:
            columns = tuple(c.strip().strip('"') for c in key.group(1).split(","))
        elif diag.column_name:
            columns = (diag.column_name,)
        return Violation(kind, diag.table_name, columns, diag.constraint_name)
    message = str(orig.args[0]) if orig is not None and orig.args else str(exc)
    for prefix, kind in _SQLITE_KINDS:
        if message.startswith(prefix):
            rest = message[len(prefix) :]
            if kind in ("unique", "not-null"):
                names = [n.strip() for n in rest.split(",") if n.strip()]
                table = names[0].split(".")[0] if names else None
                return Violation(kind, table, tuple(n.split(".")[-1] for n in names), None)
            if kind == "check":
                return Violation(kind, None, (), rest.strip() or None)
            return Violation(kind, None, (), None)
    return Violation("other", None, (), None)


def _integrity_detail(v: Violation) -> tuple[str, str | None]:
    """(detail, API field) of a 409 for a refused write."""
    field = ", ".join(_API_FIELDS.get(c, c) for c in v.columns) or None
    what = (v.table or "object").rstrip("s")
    if v.kind == "unique" and field:
        return (
            f"a {what} with this {field} already exists (a concurrent request may just have "
            f"created it); pick another {field}, or GET the existing one",
            field,
        )
    if v.kind == "foreign-key":
        return (
            "the request refers to an object that no longer exists (deleted meanwhile); "
            "read it again and retry",
            field,
        )
    rule = f" ({v.constraint})" if v.constraint else ""
    return (
        f"the change conflicts with the stored state{rule}; read the object again and retry",
        field,
    )


def _loc(loc: tuple[Any, ...] | list[Any]) -> str:
    parts = [str(p) for p in loc if p not in ("body",)]
    return ".".join(parts) or "body"


def _field_error(error: Any, body: Any) -> dict[str, str]:
    """One `errors` member; a body that is not JSON is named `body`, with where it breaks."""
    if error.get("type") != "json_invalid":
        return {"field": _loc(error["loc"]), "message": error["msg"]}
    reason = str((error.get("ctx") or {}).get("error") or "not JSON")
    loc = error.get("loc") or ()
    pos = loc[-1] if loc and isinstance(loc[-1], int) else None
    where = ""
    if pos is not None and isinstance(body, str):
        line = body.count("\n", 0, pos) + 1
        column = pos - (body.rfind("\n", 0, pos) + 1) + 1
        where = f" at line {line}, column {column}"
    elif pos is not None:
        where = f" at character {pos}"
    message = f"the body is malformed JSON: {reason}{where}; send one well-formed JSON object"
    return {"field": "body", "message": message}


def needs_key(dependant: Dependant) -> bool:
    """Whether a route (or any of its dependencies) asks for the caller's key."""
    return any(sub.call is get_principal or needs_key(sub) for sub in dependant.dependencies)


def install(app: FastAPI) -> None:
    """Route every error through one problem shape."""

    @app.exception_handler(CpnError)
    async def _domain(request: Request, exc: CpnError) -> JSONResponse:
        errors = [{"field": exc.field, "message": exc.detail}] if exc.field else None
        retry = getattr(exc, "retry_after_s", None)
        return problem(
            exc.status,
            exc.title,
            exc.detail,
            slug=exc.slug,
            instance=request.url.path,
            errors=errors,
            headers={"Retry-After": str(retry)} if retry is not None else None,
        )

    async def _unauthenticated(request: Request) -> JSONResponse | None:
        """The 401 of a caller without a live key on a route that needs one. FastAPI reads
        the body before it solves the route's dependencies, so a body that is not JSON would
        otherwise tell an anonymous caller about itself before it is asked for a key."""
        route = request.scope.get("route")
        if not isinstance(route, APIRoute) or not needs_key(route.dependant):
            return None
        try:
            await request_principal(request)
        except HTTPException as refused:
            return await _http(request, refused)
        return None

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        refused = await _unauthenticated(request)
        if refused is not None:
            return refused
        raw = exc.errors()
        errors = [_field_error(e, exc.body) for e in raw]
        names = ", ".join(e["field"] for e in errors)
        malformed = [
            f["message"]
            for e, f in zip(raw, errors, strict=True)
            if e.get("type") == "json_invalid"
        ]
        if malformed:
            detail = malformed[0]
        elif names:
            detail = f"fix these fields: {names}"
        else:
            detail = "the request body is not valid"
        return problem(
            422,
            "Invalid request",
            detail,
            slug="invalid",
            instance=request.url.path,
            errors=errors,
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        slug, title = _HTTP_SLUGS.get(exc.status_code, ("http-error", "HTTP error"))
        return problem(
            exc.status_code,
            title,
            str(exc.detail),
            slug=slug,
            instance=request.url.path,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(DataError)
    async def _out_of_range(request: Request, exc: DataError) -> JSONResponse:
        log.warning("value refused by the database on %s: %s", request.url.path, exc.orig)
        return problem(
            422,
            "Invalid request",
            "a value does not fit what cpn stores (too large or malformed); send a smaller value",
            slug="invalid",
            instance=request.url.path,
        )

    @app.exception_handler(OperationalError)
    @app.exception_handler(InterfaceError)
    @app.exception_handler(PoolTimeout)
    async def _db_unavailable(request: Request, exc: Exception) -> JSONResponse:
        if isinstance(exc, PoolTimeout):
            log.warning("no database connection free for %s: %s", request.url.path, exc)
            detail = "every database connection of this replica is busy; retry shortly"
        else:
            log.error("database error on %s: %s", request.url.path, exc)
            detail = "the database is unreachable or busy; retry shortly"
        return problem(
            503,
            "Service unavailable",
            detail,
            slug="unavailable",
            instance=request.url.path,
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )

    @app.exception_handler(IntegrityError)
    async def _refused_write(request: Request, exc: IntegrityError) -> JSONResponse:
        v = violation(exc)
        log.info("write refused on %s: %s %s", request.url.path, v.kind, v.constraint or v.columns)
        detail, field = _integrity_detail(v)
        return problem(
            409,
            "Conflict",
            detail,
            slug="conflict",
            instance=request.url.path,
            errors=[{"field": field, "message": detail}] if field else None,
        )

    @app.exception_handler(StaleDataError)
    async def _changed_meanwhile(request: Request, exc: StaleDataError) -> JSONResponse:
        """Another writer (a request, the controller's loop) changed the row between this
        request's read and its write: 412 when the caller sent If-Match, else 409."""
        log.info("concurrent change on %s: %s", request.url.path, exc)
        conditional = "if-match" in request.headers
        detail = (
            "the object changed while this request was changing it (another request or the "
            "controller); GET it again and retry" + (" with its new ETag" if conditional else "")
        )
        status, title, slug = (
            (412, "Precondition failed", "precondition-failed")
            if conditional
            else (409, "Conflict", "conflict")
        )
        field = "If-Match" if conditional else None
        return problem(
            status,
            title,
            detail,
            slug=slug,
            instance=request.url.path,
            errors=[{"field": field, "message": detail}] if field else None,
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        """The last resort: a problem with a reference to the log, never the exception's text
        (it may hold SQL, paths or values that are not the caller's)."""
        ref = uuid.uuid4().hex[:12]
        log.error(
            "unexpected error %s on %s %s", ref, request.method, request.url.path, exc_info=exc
        )
        return problem(
            500,
            "Internal error",
            f"cpn could not handle this request (reference {ref} in its log); retry, and give "
            "an admin the reference if it happens again",
            slug="internal",
            instance=request.url.path,
        )


class BodySizeLimit:
    """Refuse bodies over `limit` bytes with a 413 problem before anyone parses them."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.limit:
                await self._reject(scope, receive, send)
                return
        # A body without a length (chunked) is counted as it arrives. Past the limit this
        # middleware answers the 413 itself and tells the app the client left: an exception
        # raised from `receive` would reach FastAPI's body parser, which turns any error into
        # a 400, and whatever the app answers after the 413 is dropped.
        seen = 0
        started = rejected = False

        async def limited() -> Message:
            nonlocal seen, rejected
            if rejected:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    rejected = True
                    if not started:
                        await self._reject(scope, receive, send)
                    return {"type": "http.disconnect"}
            return message

        async def answer(message: Message) -> None:
            nonlocal started
            if rejected:
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, limited, answer)

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = problem(
            413,
            "Payload too large",
            f"request bodies are limited to {self.limit} bytes; send less",
            slug="payload-too-large",
            instance=scope.get("path"),
        )
        await response(scope, receive, send)
