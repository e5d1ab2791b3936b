"""FastAPI dependencies: the database session and the calling principal."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from api.config import Settings
from controller.keys import Principal, authenticate

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


def get_principal(
    session: SessionDep,
    creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Principal:
    if creds is None or creds.scheme.lower() != "bearer" or not creds.credentials:
        raise HTTPException(
            401,
            "missing bearer API key: send `Authorization: Bearer <key>`",
            headers={"WWW-Authenticate": "Bearer"},
        )
    principal = authenticate(session, creds.credentials)
    if principal is None:
        raise HTTPException(
            401,
            "API key is unknown or revoked: ask an admin for a valid key",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return principal


def require(*roles: str) -> Callable[[Principal], Principal]:
    """A dependency that admits only keys of the given roles."""

    def check(principal: Annotated[Principal, Depends(get_principal)]) -> Principal:
        if principal.role not in roles:
            raise HTTPException(
                403, f"this endpoint needs a key of role {' or '.join(roles)}, not {principal.role}"
            )
        return principal

    return check


AdminDep = Annotated[Principal, Depends(require("admin"))]
AgentDep = Annotated[Principal, Depends(require("agent"))]
