"""Compression values: `none`, `fp16`, `int8:minmax`, `topk:0.01:m0:fp16`, `powersgd:4`, ...

Parsed once into a frozen `Compression`; `str()` prints the canonical form, which parses back
to an equal value. `auto` is a value of the job, not of a run: the planner replaces it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum


class CompressionKind(StrEnum):
    AUTO = "auto"
    NONE = "none"
    FP16 = "fp16"
    BF16 = "bf16"
    INT8 = "int8"
    INT4 = "int4"
    INT2 = "int2"
    TOPK = "topk"
    POWERSGD = "powersgd"
    SIGN = "sign"


_FORMS = (
    "auto",
    "none (or fp32)",
    "fp16",
    "bf16",
    "int8 (stochastic rounding)",
    "int8:minmax",
    "int4",
    "int2 (stochastic rounding, a scale per block of 128)",
    "topk:<density in (0,1]>[:m<momentum in [0,1), default 0.9>][:w<warm-up rounds, default 0>]"
    "[:c<chunk: top-k per chunk of that many values>]"
    "[:fp16|:bf16|:int4|:int2 (value precision)]",
    "powersgd:<rank >= 1>",
    "sign",
)
COMPRESSION_HELP = "valid forms: " + ", ".join(_FORMS)
"""What a message about a bad compression value ends with."""

DOCUMENTED_COMPRESSIONS: tuple[str, ...] = (
    "auto",
    "none",
    "fp16",
    "bf16",
    "int8",
    "int8:minmax",
    "topk:0.01",
    "topk:0.01:fp16",
    "topk:0.1:m0",
    "int4",
    "int2",
    "topk:0.02:m0:c4096:int2",
    "powersgd:4",
    "sign",
)
"""One value of every form the docs name; tests place and run each of them."""

_VALUES = ("fp16", "bf16", "int4", "int2")
_TOPK_MOMENTUM = 0.9
_MAX_CHUNK = 1 << 20


@dataclass(frozen=True, repr=False)
class Compression:
    """A parsed compression value.

    `density` (top-k's kept fraction), `momentum` and `warmup` (top-k's momentum correction
    and its dense warm-up rounds), `chunk` (top-k per chunk of that many values, 0: per
    tensor), `values` (top-k's value precision), `rank` (PowerSGD) and `minmax` (int8
    rounding) are meaningful only for their kind.
    """

    kind: CompressionKind
    density: float = 1.0
    momentum: float = _TOPK_MOMENTUM
    warmup: int = 0
    values: str = "fp32"
    rank: int = 0
    minmax: bool = False
    chunk: int = 0

    def __str__(self) -> str:
        if self.kind is CompressionKind.INT8 and self.minmax:
            return "int8:minmax"
        if self.kind is CompressionKind.POWERSGD:
            return f"powersgd:{self.rank}"
        if self.kind is CompressionKind.TOPK:
            parts = [f"topk:{self.density:g}"]
            if self.momentum != _TOPK_MOMENTUM:
                parts.append(f"m{self.momentum:g}")
            if self.warmup:
                parts.append(f"w{self.warmup}")
            if self.chunk:
                parts.append(f"c{self.chunk}")
            if self.values != "fp32":
                parts.append(self.values)
            return ":".join(parts)
        return self.kind.value

    def __repr__(self) -> str:
        return f"Compression({str(self)!r})"

    @property
    def is_auto(self) -> bool:
        return self.kind is CompressionKind.AUTO


def _invalid(text: object, problem: str) -> ValueError:
    return ValueError(f"compression {text!r}: {problem}; {COMPRESSION_HELP}")


def _number(text: str, raw: str, what: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise _invalid(text, f"{what} {raw!r} is not a number") from None
    if not math.isfinite(value):
        raise _invalid(text, f"{what} {raw!r} is not finite")
    return value


def _integer(text: str, raw: str, what: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise _invalid(text, f"{what} {raw!r} is not an integer") from None


def _topk(text: str, options: list[str]) -> Compression:
    if not options or not options[0]:
        raise _invalid(text, "topk needs a density, e.g. topk:0.01")
    density = _number(text, options[0], "density")
    if not 0.0 < density <= 1.0:
        raise _invalid(text, f"density {options[0]} must be in (0, 1]")
    momentum, warmup, chunk, values, seen = _TOPK_MOMENTUM, 0, 0, "fp32", set()
    for option in options[1:]:
        if option in _VALUES and "v" not in seen:
            seen.add("v")
            values = option
            continue
        tag, raw = option[:1], option[1:]
        if tag not in ("m", "w", "c") or not raw or tag in seen:
            raise _invalid(
                text,
                f"unknown or repeated topk option {option!r} "
                "(use m<x>, w<n>, c<n>, fp16, bf16, int4, int2)",
            )
        seen.add(tag)
        if tag == "m":
            momentum = _number(text, raw, "momentum")
            if not 0.0 <= momentum < 1.0:
                raise _invalid(text, f"momentum {raw} must be in [0, 1)")
        elif tag == "w":
            warmup = _integer(text, raw, "warm-up rounds")
            if warmup < 0:
                raise _invalid(text, f"warm-up rounds {raw} must be >= 0")
        else:
            chunk = _integer(text, raw, "chunk")
            if not 1 <= chunk <= _MAX_CHUNK:
                raise _invalid(text, f"chunk {raw} must be in [1, {_MAX_CHUNK}]")
    return Compression(
        CompressionKind.TOPK,
        density=density,
        momentum=momentum,
        warmup=warmup,
        values=values,
        chunk=chunk,
    )


def parse_compression(text: str | Compression) -> Compression:
    """Parse a compression value; ValueError quotes it, says what is wrong and the valid forms."""
    if isinstance(text, Compression):
        return text
    if not isinstance(text, str):
        raise _invalid(text, "the value must be a string")
    kind, *options = text.strip().lower().split(":")
    if kind == "fp32":
        kind = "none"
    if kind in ("auto", "none", "fp16", "bf16", "sign", "int4", "int2"):
        if options:
            raise _invalid(text, f"{kind} takes no options")
        return Compression(CompressionKind(kind))
    if kind == "int8":
        if not options or options == ["stochastic"]:
            return Compression(CompressionKind.INT8)
        if options == ["minmax"]:
            return Compression(CompressionKind.INT8, minmax=True)
        raise _invalid(text, "int8 takes no option or :minmax")
    if kind == "topk":
        return _topk(text, options)
    if kind == "powersgd":
        if len(options) != 1 or not options[0]:
            raise _invalid(text, "powersgd needs exactly a rank, e.g. powersgd:4")
        rank = _integer(text, options[0], "rank")
        if rank < 1:
            raise _invalid(text, f"rank {options[0]} must be >= 1")
        return Compression(CompressionKind.POWERSGD, rank=rank)
    raise _invalid(text, f"unknown compressor {kind!r}")


def canonical_compression(text: str) -> str:
    """The canonical form of a compression value (a pydantic validator for string fields)."""
    return str(parse_compression(text))


_TOPK_VALUE_BYTES = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "int4": 0.6, "int2": 0.3}
"""A kept top-k value's bytes (4 and 2 bits with their block scales)."""
_TOPK_INDEX_BYTES = 2.0
"""A kept top-k value's index: the gaps between sorted indices go as varints (1-2 bytes)."""
_FRAMING_BYTES = 16
"""Each tensor's header in a message."""


def value_bytes(value: str | Compression) -> float:
    """Bytes one value of a message costs at `value`, per value of the dense tensor (PowerSGD's
    depend on the matrix shapes: `message_bytes`). The one byte model of the planner
    (`scheduler.compression`) and the runtime (`training.auto`, `training.adaptive`)."""
    c = parse_compression(value)
    kind = c.kind
    if kind in (CompressionKind.FP16, CompressionKind.BF16):
        return 2.0
    if kind is CompressionKind.INT8:  # a scale (or a min and a step) per piece of 1024
        return 1.0 + 4.0 / 1024
    if kind in (CompressionKind.INT4, CompressionKind.INT2):  # a bf16 scale per 128 values
        bits = 4 if kind is CompressionKind.INT4 else 2
        return bits / 8.0 + 2.0 / 128
    if kind is CompressionKind.SIGN:  # one bit, a scale per tensor
        return 1.0 / 8
    if kind is CompressionKind.TOPK:
        return c.density * (_TOPK_VALUE_BYTES[c.values] + _TOPK_INDEX_BYTES)
    return 4.0


def message_bytes(value: str | Compression, shapes: Sequence[tuple[int, ...]]) -> int:
    """Bytes of one message of `value` carrying tensors of `shapes`: `value_bytes` a value
    (at least one kept value under top-k), PowerSGD's factors P (m x r) and Q (n x r) for each
    matrix (a 1-D tensor goes dense), and each tensor's framing."""
    c = parse_compression(value)
    total = 0
    for shape in shapes:
        n = math.prod(shape)
        if c.kind is CompressionKind.POWERSGD:
            rows = shape[0] if len(shape) >= 2 else n
            cols = n // rows
            total += 4 * min(n, c.rank * (rows + cols)) if len(shape) >= 2 else 4 * n
        elif c.kind is CompressionKind.TOPK:
            kept = max(1, int(c.density * n))
            total += math.ceil(kept * (_TOPK_VALUE_BYTES[c.values] + _TOPK_INDEX_BYTES))
        else:
            total += math.ceil(n * value_bytes(c))
        total += _FRAMING_BYTES
    return total
