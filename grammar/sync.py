"""Sync values: how often and how loosely clusters exchange (`every-step`, `local-sgd:8`, ...).

Parsed once into a frozen `Sync`; `str()` prints the canonical form, which parses back to an
equal value. New modes add a `SyncKind` and a branch in `parse_sync`; every layer then
accepts them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class SyncKind(StrEnum):
    AUTO = "auto"
    EVERY_STEP = "every-step"
    """Exchange gradients every step."""
    LOCAL_SGD = "local-sgd"
    """DiLoCo: `period` inner steps, then an outer Nesterov step on the averaged
    pseudo-gradient."""
    STALE = "stale"
    """Gradients applied `staleness` steps late, so each exchange overlaps the next step's compute
    (one in flight at a time: a late one may fall up to `staleness` steps behind)."""
    ADAPTIVE = "adaptive"
    """Every step, the compression level picked at run time from link bandwidth and compute."""
    STREAMING = "streaming"
    """Streaming DiLoCo: local SGD whose parameters are split into `fragments` slices, each
    synced once every `period` steps at staggered steps; a fragment's outer step is applied
    `delay` inner steps after its pseudo-gradient was sent, so the exchange overlaps compute."""
    PARTIAL = "partial"
    """Heterogeneity-aware partial sync: rounds of `period` steps of the slowest cluster; in
    a round each cluster takes as many local steps as its speed allows (at most a bounded
    multiple of the slowest's), then an outer step on the pseudo-gradients weighted by the
    samples each cluster processed."""
    ASYNC_PS = "async-ps"
    """Asynchronous parameter server: clusters push compressed updates and pull fresh
    parameters without waiting for each other; an update more than `staleness` versions
    stale is down-weighted."""
    GOSSIP = "gossip"
    """No global exchange: every `period` steps each cluster averages with its neighbours in
    a sparse graph built from the links; one consensus average at the end."""


_FORMS = (
    "auto",
    "every-step",
    "local-sgd:<H >= 1> (or diloco:<H>)",
    "stale:<S >= 0>",
    "adaptive",
    "streaming:<H >= 1>[:f<fragments in [1, H], default min(4, H); 1 on local data>]"
    "[:d<delay in [0, H), default H/min(4, H) - 1 with one fragment, else H/fragments - 1>]",
    "partial:<H >= 1>",
    "async-ps:<S >= 0>",
    "gossip:<P >= 1>",
)
SYNC_HELP = "valid forms: " + ", ".join(_FORMS)
"""What a message about a bad sync value ends with."""

DOCUMENTED_SYNCS: tuple[str, ...] = (
    "auto",
    "every-step",
    "local-sgd:8",
    "stale:1",
    "adaptive",
    "streaming:8:f2:d3",
    "partial:4",
    "async-ps:2",
    "gossip:2",
)
"""One value of every form the docs name; tests place and run each of them."""


@dataclass(frozen=True, repr=False)
class Sync:
    """A parsed sync value; `period` is local SGD's (and streaming's, partial's) H and
    gossip's P, `staleness` bounded staleness' (and the parameter server's) S, `fragments`
    and `delay` streaming's slices and outer-step delay."""

    kind: SyncKind
    period: int = 1
    staleness: int = 0
    fragments: int = 1
    delay: int = 0

    def __str__(self) -> str:
        if self.kind is SyncKind.LOCAL_SGD:
            return f"local-sgd:{self.period}"
        if self.kind is SyncKind.STREAMING:  # always in full: a stored job shows what runs
            return f"streaming:{self.period}:f{self.fragments}:d{self.delay}"
        if self.kind is SyncKind.STALE:
            return f"stale:{self.staleness}"
        if self.kind in (SyncKind.PARTIAL, SyncKind.GOSSIP):
            return f"{self.kind.value}:{self.period}"
        if self.kind is SyncKind.ASYNC_PS:
            return f"async-ps:{self.staleness}"
        return self.kind.value

    def __repr__(self) -> str:
        return f"Sync({str(self)!r})"

    @property
    def is_auto(self) -> bool:
        return self.kind is SyncKind.AUTO


def _invalid(text: object, problem: str) -> ValueError:
    return ValueError(f"sync {text!r}: {problem}; {SYNC_HELP}")


def _streaming(text: str, options: list[str], local_data: bool) -> Sync:
    if not options or not (options[0].isascii() and options[0].isdigit()):
        raise _invalid(text, "streaming needs a whole number H (inner steps), e.g. streaming:32")
    period = int(options[0])
    if period < 1:
        raise _invalid(text, "H must be >= 1")
    found: dict[str, int] = {}
    for option in options[1:]:
        tag, raw = option[:1], option[1:]
        if tag not in ("f", "d") or not (raw.isascii() and raw.isdigit()) or tag in found:
            raise _invalid(
                text, f"unknown or repeated streaming option {option!r} (use f<n>, d<n>)"
            )
        found[tag] = int(raw)
    fragments = found.get("f", 1 if local_data else min(4, period))
    if not 1 <= fragments <= period:
        raise _invalid(text, f"fragments {fragments} must be in [1, H={period}]")
    # one fragment waits as long as the first of four would: H/F - 1 would leave it one step
    # of progress a period (the rest is dropped when the sum lands)
    delay = found.get("d", period // (min(4, period) if fragments == 1 else fragments) - 1)
    if not 0 <= delay < period:
        raise _invalid(text, f"delay {delay} must be in [0, H={period})")
    return Sync(SyncKind.STREAMING, period=period, fragments=fragments, delay=delay)


def parse_sync(text: str | Sync, *, local_data: bool = False) -> Sync:
    """Parse a sync value; ValueError quotes it, says what is wrong and the valid forms.
    On `local_data` (label-skewed: each cluster its own labels) streaming's fragments default
    to one: fragments synced at staggered steps, each against the others' own drift, cost
    far more quality there than the whole model at once (bench/results/local-data.md);
    named fragments are kept (the plan prices their quality,
    `grammar.quality.local_data_cost`)."""
    if isinstance(text, Sync):
        return text
    if not isinstance(text, str):
        raise _invalid(text, "the value must be a string")
    kind, *options = text.strip().lower().split(":")
    if kind == "diloco":
        kind = "local-sgd"
    if kind in ("auto", "every-step", "adaptive"):
        if options:
            raise _invalid(text, f"{kind} takes no options")
        return Sync(SyncKind(kind))
    if kind == "streaming":
        return _streaming(text, options, local_data)
    if kind in ("partial", "gossip", "async-ps"):
        what = "S (versions of staleness)" if kind == "async-ps" else "H (steps per round)"
        if kind == "gossip":
            what = "P (steps between neighbour averages)"
        if len(options) != 1 or not (options[0].isascii() and options[0].isdigit()):
            raise _invalid(text, f"{kind} needs a whole number {what}, e.g. {kind}:4")
        n = int(options[0])
        if kind == "async-ps":
            return Sync(SyncKind.ASYNC_PS, staleness=n)
        if n < 1:
            raise _invalid(text, f"{what.split()[0]} must be >= 1")
        return Sync(SyncKind(kind), period=n)
    if kind in ("local-sgd", "stale"):
        if len(options) != 1 or not options[0].isdigit():
            what = "H (inner steps)" if kind == "local-sgd" else "S (steps of staleness)"
            raise _invalid(text, f"{kind} needs a whole number {what}, e.g. {kind}:8")
        n = int(options[0])
        if kind == "stale":
            return Sync(SyncKind.STALE, staleness=n)
        if n < 1:
            raise _invalid(text, "H must be >= 1")
        return Sync(SyncKind.LOCAL_SGD, period=n)
    raise _invalid(text, "not understood")


def canonical_sync(text: str) -> str:
    """The canonical form of a sync value (a pydantic validator for string fields)."""
    return str(parse_sync(text))
