"""Wire models between a cluster agent and the control plane.

The only module that both `agents/` and `api/` import: keep it free of I/O.

Flow: an agent POSTs a `Heartbeat` to `/v1/agent/heartbeat` every `heartbeat_interval_s`
(bearer token of role `agent`, bound to its cluster); the `HeartbeatAck` renews its lease and
lists the peer clusters whose probe endpoints it should measure. It POSTs the measurements as a
`LinkReport` to `/v1/agent/links`. Each agent serves `GET /probe/ping` (empty 204) and
`GET /probe/blob?bytes=N` (N bytes, N <= PROBE_MAX_BYTES) for its peers to measure against.

A probe URL is what one agent makes every other agent fetch, so it is a plain base URL and
nothing else (`check_probe_url`): the controller refuses any other in a heartbeat, and an
agent checks each peer's again before its first request.
"""

from __future__ import annotations

import ipaddress
import re
from datetime import UTC, datetime
from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
)
from pydantic_core import PydanticCustomError

DiscoverySource = Literal["nvml", "kubernetes", "inventory"]
ClusterState = Literal["READY", "SUSPECT", "DOWN"]

PROBE_MAX_BYTES = 64 * 1024 * 1024
"""Largest blob a probe endpoint serves: a bounded transfer, never an open-ended one."""


# ---- value types every edge shares (api/ and controller/ import them from here) ------------

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def refuse_control_characters(value: str) -> str:
    """`value` unchanged, or a validation error when it holds a control character: a NUL is
    stored by SQLite but refused by PostgreSQL, and the others only garble logs and tables."""
    found = _CONTROL.search(value)
    if found is not None:
        raise PydanticCustomError(
            "control_character",
            "has the control character U+{code} at position {at}; send printable text only",
            {"code": f"{ord(found.group()):04X}", "at": found.start()},
        )
    return value


PlainText = Annotated[str, AfterValidator(refuse_control_characters)]
"""A string without control characters (the same answer on SQLite and PostgreSQL)."""


def in_utc_range(value: datetime) -> datetime:
    """`value` unchanged when its UTC instant lies in years 1..9999 (what a datetime, and so
    every stored time, can hold), else a validation error; a naive value passes unchanged."""
    if value.tzinfo is not None:
        try:
            value.astimezone(UTC)
        except OverflowError:
            raise PydanticCustomError(
                "datetime_range",
                "falls outside years 1 to 9999 once converted to UTC; give a time such as "
                "2026-01-01T00:00:00Z",
            ) from None
    return value


BoundedUTC = Annotated[AwareDatetime, AfterValidator(in_utc_range)]
"""A time with a UTC offset whose UTC instant cpn can store."""

PROBE_URL_MAX_LENGTH = 512  # the clusters.probe_url column
PROBE_URL_HELP = (
    "give a plain base URL: http:// or https://, a host name or IP address ([...] for IPv6), "
    "an optional :port and /path, with no user:password@, ?query or #fragment, at most "
    f"{PROBE_URL_MAX_LENGTH} characters; e.g. http://10.0.0.7:9100"
)

_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_HOST_NAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*")
_PORT = re.compile(r"[0-9]{1,5}")
_SEGMENT = re.compile(r"(?:[A-Za-z0-9._~-]|%[0-9A-Fa-f]{2})*")  # unreserved or %XX


def check_probe_url(url: str) -> str:
    """`url` unchanged when it is a plain probe base URL, else ValueError saying what is wrong.

    Agents fetch `<url>/probe/ping` and `<url>/probe/blob?bytes=N` from every peer, so a URL
    that could steer those requests elsewhere is refused: a `?` or `#` that would swallow the
    suffix, credentials, or characters that two URL parsers may read two ways. The check is
    by shape only (no DNS): probe endpoints are private addresses by nature.
    """
    if not url:
        raise ValueError("is empty; leave probe_url out when the agent serves no probe endpoint")
    if len(url) > PROBE_URL_MAX_LENGTH:
        raise ValueError(f"is {len(url)} characters long; {PROBE_URL_HELP}")
    if any(not 0x21 <= ord(c) <= 0x7E for c in url):
        raise ValueError(
            "has spaces, control or non-ASCII characters (write a non-ASCII host in its "
            f"xn-- form); {PROBE_URL_HELP}"
        )
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("http", "https"):
        raise ValueError(f"must start with http:// or https://; {PROBE_URL_HELP}")
    if "#" in rest:
        raise ValueError(f"has a #fragment; drop it: {PROBE_URL_HELP}")
    if "?" in rest:
        raise ValueError(f"has a ?query; drop it: {PROBE_URL_HELP}")
    authority, slash, path = rest.partition("/")
    if "@" in authority:
        raise ValueError(
            f"carries credentials (user@ or user:password@); drop them: {PROBE_URL_HELP}"
        )
    _check_authority(authority)
    for segment in path.split("/") if slash else ():
        if segment in (".", "..") or not _SEGMENT.fullmatch(segment):
            raise ValueError(
                "has a path with characters other than letters, digits, - . _ ~ / and %XX, "
                f"or a . or .. segment; {PROBE_URL_HELP}"
            )
    return url


def _check_authority(authority: str) -> None:
    if authority.startswith("["):
        host, bracket, after = authority[1:].partition("]")
        try:
            if not bracket or "%" in host:  # no zone ids: they name this host's interfaces
                raise ValueError
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"has a malformed [IPv6] host; {PROBE_URL_HELP}") from None
        if after and not after.startswith(":"):
            raise ValueError(f"has text after the ] of its IPv6 host; {PROBE_URL_HELP}")
        has_port, port = bool(after), after[1:]
    else:
        if authority.count(":") > 1:
            raise ValueError(f"has more than one ':'; put an IPv6 host in [...]: {PROBE_URL_HELP}")
        host, colon, port = authority.partition(":")
        has_port = bool(colon)
        if not host:
            raise ValueError(f"has no host; {PROBE_URL_HELP}")
        if len(host) > 253 or not _HOST_NAME.fullmatch(host):
            raise ValueError(f"has a host that is not a host name or IP address; {PROBE_URL_HELP}")
    if has_port and not (_PORT.fullmatch(port) and 1 <= int(port) <= 65535):
        raise ValueError(f"has a port that is not a number from 1 to 65535; {PROBE_URL_HELP}")


def _probe_url(url: str) -> str:
    try:
        return check_probe_url(url)
    except ValueError as exc:  # a clean message, without pydantic's "Value error, " prefix
        raise PydanticCustomError("probe_url", "probe_url {reason}", {"reason": str(exc)}) from None


ProbeUrl = Annotated[
    str,
    Field(
        max_length=PROBE_URL_MAX_LENGTH,
        description="Base URL of an agent's probe endpoint: http(s)://host[:port][/path], "
        "no query, fragment or credentials.",
        examples=["http://10.0.0.7:9100"],
    ),
    AfterValidator(_probe_url),
]


def _scalar_kind(annotation: Any) -> str | None:
    """ "number" for an int or float field (optional or not), "bool" for a boolean one."""
    if get_origin(annotation) is Annotated:
        return _scalar_kind(get_args(annotation)[0])
    members = set(get_args(annotation)) - {type(None)} if get_origin(annotation) else {annotation}
    if members and members <= {int, float}:
        return "number"
    if members == {bool}:
        return "bool"
    return None


class StrictScalars(BaseModel):
    """Input whose numbers and booleans are what its schema says: "1" or true is no count,
    "yes" or 1 no boolean (pydantic's lax mode took them); every other type as pydantic
    reads it. The base of every input model of the public API and the agents' wire."""

    @field_validator("*", mode="before")
    @classmethod
    def _as_the_schema_says(cls, value: Any, info: ValidationInfo) -> Any:
        if info.field_name is None or value is None:
            return value
        kind = _scalar_kind(cls.model_fields[info.field_name].annotation)
        if kind == "number" and isinstance(value, bool | str):
            raise PydanticCustomError(
                "strict_number", "must be a JSON number, not {got}", {"got": type(value).__name__}
            )
        if kind == "bool" and not isinstance(value, bool):
            raise PydanticCustomError("strict_bool", "must be true or false", {})
        return value


class _Wire(StrictScalars):
    model_config = ConfigDict(extra="forbid")


class GpuInventory(_Wire):
    """GPUs of one model in a cluster, as discovered by the agent."""

    model: PlainText = Field(
        min_length=1, max_length=128, description="GPU product name, e.g. 'A100-80GB'."
    )
    memory_gib: float = Field(ge=0, le=4096, description="Memory per GPU in GiB.")
    count: int = Field(ge=0, le=1_000_000, description="GPUs present.")
    allocatable: int = Field(ge=0, le=1_000_000, description="GPUs the cluster offers to cpn.")
    utilization: float | None = Field(
        default=None, ge=0, le=1, description="Mean utilisation 0..1, when the source reports it."
    )


class Heartbeat(_Wire):
    """What an agent reports on each beat: it is alive, and what GPUs its cluster has."""

    cluster: PlainText = Field(min_length=1, max_length=63)
    agent_version: PlainText = Field(default="", max_length=64)
    probe_url: ProbeUrl | None = Field(
        default=None,
        description="Base URL of this agent's probe endpoint, or null when it serves none: "
        + PROBE_URL_HELP
        + ".",
    )
    discovery: DiscoverySource = "inventory"
    gpus: list[GpuInventory] = Field(default_factory=list, max_length=64)


class PeerProbe(_Wire):
    """Another cluster's probe endpoint, for link measurements.

    `probe_url` is deliberately not checked here: one bad stored URL must not make a whole
    `HeartbeatAck` unreadable (and every agent's lease lapse). The agent checks each peer's
    URL with `check_probe_url` before its first request and skips a peer that fails.
    """

    cluster: str
    probe_url: str


class HeartbeatAck(_Wire):
    """The controller's answer to a heartbeat: lease renewed until `lease_expires_at`."""

    cluster: str
    state: ClusterState
    lease_expires_at: datetime
    heartbeat_interval_s: float
    probe_interval_s: float
    probe_bytes: int
    peers: list[PeerProbe] = Field(default_factory=list)


class LinkMeasurement(_Wire):
    """One measured link from the reporting cluster to `dst`."""

    dst: PlainText = Field(min_length=1, max_length=63)
    bandwidth_gbps: float = Field(
        gt=0,
        le=100_000,
        description="The link's capacity, Gbit/s: the most its recent probes carried.",
    )
    free_gbps: float | None = Field(
        default=None,
        gt=0,
        le=100_000,
        description="What is free on it now, Gbit/s: what the newest probe carried beside the "
        "traffic on the path at the time (absent from older agents).",
    )
    rtt_ms: float = Field(ge=0, le=600_000, description="Round-trip time, milliseconds.")
    loss: float = Field(default=0.0, ge=0, le=1, description="Fraction of probes that failed.")
    bytes_transferred: int = Field(
        ge=0,
        le=PROBE_MAX_BYTES,
        description="Size of the transfer the bandwidth came from (at most a probe blob).",
    )
    measured_at: BoundedUTC = Field(description="When it was measured, with a UTC offset.")


class LinkReport(_Wire):
    """Link measurements an agent made to its peers since its last report."""

    cluster: PlainText = Field(min_length=1, max_length=63)
    links: list[LinkMeasurement] = Field(max_length=1024)
