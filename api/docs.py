"""The API's own documentation: public by default, or only for callers with a key.

With CPN_PROTECT_DOCS FastAPI's public /docs, /redoc and /openapi.json are turned off and
served here behind authentication (any valid key). A browser sends no bearer key by itself:
fetch /openapi.json with one (`curl -H 'Authorization: Bearer ...'`) or put the console behind
a proxy that adds it.
"""

from __future__ import annotations

from typing import Any

from fastapi import Depends, FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse

from api.config import Settings
from api.routes.health import authenticated

OPENAPI_URL = "/openapi.json"


def fastapi_urls(settings: Settings) -> dict[str, Any]:
    """FastAPI's arguments for its documentation routes: off when they are protected."""
    if settings.protect_docs:
        return {"docs_url": None, "redoc_url": None, "openapi_url": None}
    return {}


def install(app: FastAPI, settings: Settings) -> None:
    """Serve the documentation behind authentication when CPN_PROTECT_DOCS is set."""
    if not settings.protect_docs:
        return
    guarded = [Depends(authenticated)]

    @app.get(OPENAPI_URL, include_in_schema=False, dependencies=guarded)
    def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False, dependencies=guarded)
    def swagger() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url=OPENAPI_URL, title=f"{app.title} - docs")

    @app.get("/redoc", include_in_schema=False, dependencies=guarded)
    def redoc() -> HTMLResponse:
        return get_redoc_html(openapi_url=OPENAPI_URL, title=f"{app.title} - ReDoc")
