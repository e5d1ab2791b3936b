"""FastAPI dependencies: the database session and the calling principal."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from api.config import Settings
from controller.keys import Principal, PrincipalCache, authenticate_cached, hash_key

_bearer = HTTPBearer(auto_error=False, description="An API key: `Authorization: Bearer cpn_...`")


def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def get_session(request: Request) -> Iterator[Session]:
    """A session per request; routes commit what they change, the rest is rolled back."""
    with request.app.state.sessions() as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session)]
SettingsDep = Annotated[Settings, Depends(get_settings)]


async def get_principal(
    request: Request,
    creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Principal:
    """The caller, from the in-process cache when it can (no thread, no query), else the DB.

    The lookup uses a session of its own, so no request holds a pooled connection while it
    waits for a worker thread (which deadlocked the pool under many concurrent requests).
    """
    if creds is None or creds.scheme.lower() != "bearer" or not creds.credentials:
        raise HTTPException(
            401,
            "missing bearer API key: send `Authorization: Bearer <key>`",
            headers={"WWW-Authenticate": "Bearer"},
        )
    state = request.app.state
    cache: PrincipalCache = state.principals
    principal = None if cache.stale() else cache.get(hash_key(creds.credentials))
    if principal is None:
        principal = await run_in_threadpool(
            authenticate_cached, cache, state.sessions, creds.credentials
        )
    if principal is None:
        raise HTTPException(
            401,
            "API key is unknown or revoked: ask an admin for a valid key",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return principal


def require(*roles: str) -> Callable[[Principal], Awaitable[Principal]]:
    """A dependency that admits only keys of the given roles."""

    async def check(principal: Annotated[Principal, Depends(get_principal)]) -> Principal:
        if principal.role not in roles:
            raise HTTPException(
                403, f"this endpoint needs a key of role {' or '.join(roles)}, not {principal.role}"
            )
        return principal

    return check


AdminDep = Annotated[Principal, Depends(require("admin"))]
AgentDep = Annotated[Principal, Depends(require("agent"))]
