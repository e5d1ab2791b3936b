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


class TooMany(CpnError):
    """A tenant is over a cap that frees itself (jobs start or end): retry later."""

    status, slug, title = 429, "rate-limited", "Too many requests"

    def __init__(self, detail: str, *, field: str | None = None, retry_after_s: int = 30) -> None:
        super().__init__(detail, field=field)
        self.retry_after_s = retry_after_s
