"""The API's own documentation: Swagger UI and ReDoc from bundled assets, public by default or
only for callers with a key.

FastAPI's pages load their JavaScript from a CDN, so on a machine without internet /docs is a
blank page; the assets here come from the `fastapi-offline` package and are served by cpn
itself. With CPN_PROTECT_DOCS the pages and /openapi.json need a key (any valid one; the assets
are the libraries' own files and stay public). A browser sends no bearer key by itself: fetch
/openapi.json with one (`curl -H 'Authorization: Bearer ...'`) or put the console behind a
proxy that adds it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import fastapi_offline
from fastapi import Depends, FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.params import Depends as DependsParam
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from api.config import Settings
from api.routes.health import authenticated

OPENAPI_URL = "/openapi.json"
ASSETS_URL = "/docs/assets"
ASSETS = Path(fastapi_offline.__file__).parent / "static"
"""swagger-ui-bundle.js, swagger-ui.css, redoc.standalone.js and a favicon."""


def fastapi_urls(settings: Settings) -> dict[str, Any]:
    """FastAPI's arguments for its documentation routes: its CDN pages are never used, and its
    /openapi.json is turned off when the documentation is protected."""
    urls: dict[str, Any] = {"docs_url": None, "redoc_url": None}
    if settings.protect_docs:
        urls["openapi_url"] = None
    return urls


def install(app: FastAPI, settings: Settings) -> None:
    """Serve /docs and /redoc from the bundled assets (behind a key with CPN_PROTECT_DOCS)."""
    guarded: list[DependsParam] = [Depends(authenticated)] if settings.protect_docs else []
    app.mount(ASSETS_URL, StaticFiles(directory=ASSETS), name="docs-assets")

    if settings.protect_docs:

        @app.get(OPENAPI_URL, include_in_schema=False, dependencies=guarded)
        def openapi() -> JSONResponse:
            return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False, dependencies=guarded)
    def swagger() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=OPENAPI_URL,
            title=f"{app.title} - docs",
            swagger_js_url=f"{ASSETS_URL}/swagger-ui-bundle.js",
            swagger_css_url=f"{ASSETS_URL}/swagger-ui.css",
            swagger_favicon_url=f"{ASSETS_URL}/favicon.png",
        )

    @app.get("/redoc", include_in_schema=False, dependencies=guarded)
    def redoc() -> HTMLResponse:
        return get_redoc_html(
            openapi_url=OPENAPI_URL,
            title=f"{app.title} - ReDoc",
            redoc_js_url=f"{ASSETS_URL}/redoc.standalone.js",
            redoc_favicon_url=f"{ASSETS_URL}/favicon.png",
            with_google_fonts=False,
        )


_PROBLEMS: dict[int, str] = {
    401: "No key, or a key that is unknown, revoked or expired.",
    403: "The key's role may not do this (a tenant key on an admin route).",
    404: "No such object, or another tenant's.",
    409: "The change conflicts with the stored state (a name taken, a state that forbids it, "
    "a concurrent change); read the object again.",
    412: "If-Match names a version that is no longer current.",
    413: "The body is larger than CPN_MAX_BODY_BYTES.",
    415: "The body is not application/json.",
    422: "A field is invalid; `errors` names each one and the fix.",
    429: "Over a rate limit or a cap; Retry-After says when to try again.",
    503: "The database is unreachable or overloaded; retry after Retry-After seconds.",
}
_MUTATING = {"post", "put", "patch", "delete"}


def document_problems(app: FastAPI) -> None:
    """Have the app's OpenAPI document, on every operation, the RFC 9457 problems the server
    can answer it with, in the shape and media type it really sends."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = with_problems(generate())
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def with_problems(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with each operation's problem answers (`application/problem+json`,
    `Problem`) in place of FastAPI's `HTTPValidationError`, so a generated client can parse
    every error: what an operation can answer follows from what it takes (a key, a path
    parameter, a body, If-Match) and its method. Changes `schema` in place and returns it."""
    from api.problems import PROBLEM_MEDIA_TYPE, Problem

    components = schema.setdefault("components", {}).setdefault("schemas", {})
    problem = Problem.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(problem.pop("$defs", {}))
    components["Problem"] = problem
    body = {PROBLEM_MEDIA_TYPE: {"schema": {"$ref": "#/components/schemas/Problem"}}}
    retry = {"Retry-After": {"description": "Seconds to wait.", "schema": {"type": "integer"}}}
    for path, operations in schema.get("paths", {}).items():
        for method, operation in operations.items():
            params = {(p["in"], p["name"].lower()) for p in operation.get("parameters", [])}
            codes = {503} if path.startswith("/v1/") else set()
            if operation.get("security"):
                codes |= {401, 403, 429}
            if any(where == "path" for where, _ in params):
                codes.add(404)
            if params or "requestBody" in operation:
                codes.add(422)
            if method in _MUTATING:
                codes.add(409)
            if "requestBody" in operation:
                codes |= {413, 415}
            if ("header", "if-match") in params:
                codes.add(412)
            responses = operation.setdefault("responses", {})
            codes |= {int(c) for c in responses if c.isdigit() and int(c) >= 400}
            for code in sorted(codes):
                given = responses.get(str(code), {})
                answer: dict[str, Any] = {
                    "description": given.get("description") or _PROBLEMS.get(code, "An error."),
                    "content": body,
                }
                if code in (429, 503):
                    answer["headers"] = retry
                responses[str(code)] = answer
    for unused in ("HTTPValidationError", "ValidationError"):
        components.pop(unused, None)
    return schema
