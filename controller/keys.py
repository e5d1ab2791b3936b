"""API keys: minted with enough entropy that a plain SHA-256 is a safe stored form."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from controller.models import ApiKey

ROLES = ("admin", "tenant", "agent")


@dataclass(frozen=True)
class Principal:
    """Who is calling: the key's id, role and scope (tenant id or cluster name)."""

    key_id: str
    role: str
    scope: str | None


def hash_key(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def mint(role: str) -> str:
    return f"cpn_{role}_{secrets.token_urlsafe(32)}"


def create_key(
    session: Session, role: str, scope: str | None, name: str = "", token: str | None = None
) -> tuple[ApiKey, str]:
    """Store a new key and return it with its plaintext, which is never stored or shown again."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}")
    token = token or mint(role)
    key = ApiKey(name=name, key_hash=hash_key(token), prefix=token[:12], role=role, scope=scope)
    session.add(key)
    session.flush()
    return key, token


def authenticate(session: Session, token: str) -> Principal | None:
    """The principal for a live key, or None if unknown or revoked."""
    row = session.execute(
        select(ApiKey.id, ApiKey.role, ApiKey.scope, ApiKey.revoked_at).where(
            ApiKey.key_hash == hash_key(token)
        )
    ).first()
    if row is None or row.revoked_at is not None:
        return None
    return Principal(key_id=row.id, role=row.role, scope=row.scope)
