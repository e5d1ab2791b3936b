"""RFC 9457 problem details for every error the API returns."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from sqlalchemy.exc import DataError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from controller.errors import CpnError

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


def _loc(loc: tuple[Any, ...] | list[Any]) -> str:
    parts = [str(p) for p in loc if p not in ("body",)]
    return ".".join(parts) or "body"


def install(app: FastAPI) -> None:
    """Route every error through one problem shape."""

    @app.exception_handler(CpnError)
    async def _domain(request: Request, exc: CpnError) -> JSONResponse:
        errors = [{"field": exc.field, "message": exc.detail}] if exc.field else None
        return problem(
            exc.status,
            exc.title,
            exc.detail,
            slug=exc.slug,
            instance=request.url.path,
            errors=errors,
        )

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [{"field": _loc(e["loc"]), "message": e["msg"]} for e in exc.errors()]
        names = ", ".join(e["field"] for e in errors)
        return problem(
            422,
            "Invalid request",
            f"fix these fields: {names}" if names else "the request body is not valid",
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
    async def _db_down(request: Request, exc: OperationalError) -> JSONResponse:
        log.error("database error on %s: %s", request.url.path, exc)
        return problem(
            503,
            "Service unavailable",
            "the database is unreachable or busy; retry shortly",
            slug="unavailable",
            instance=request.url.path,
            headers={"Retry-After": "1"},
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
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _TooLarge
            return message

        try:
            await self.app(scope, limited, send)
        except _TooLarge:
            await self._reject(scope, receive, send)

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = problem(
            413,
            "Payload too large",
            f"request bodies are limited to {self.limit} bytes; send less",
            slug="payload-too-large",
            instance=scope.get("path"),
        )
        await response(scope, receive, send)


class _TooLarge(Exception):
    pass
