"""Domain errors the API turns into RFC 9457 problems; each says what to change."""

from __future__ import annotations


class CpnError(Exception):
    status = 400
    slug = "bad-request"
    title = "Bad request"

    def __init__(self, detail: str, *, field: str | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.field = field


class NotFound(CpnError):
    status, slug, title = 404, "not-found", "Not found"


class Conflict(CpnError):
    status, slug, title = 409, "conflict", "Conflict"


class Invalid(CpnError):
    status, slug, title = 422, "invalid", "Invalid request"


class PreconditionFailed(CpnError):
    status, slug, title = 412, "precondition-failed", "Precondition failed"


class Forbidden(CpnError):
    status, slug, title = 403, "forbidden", "Forbidden"
