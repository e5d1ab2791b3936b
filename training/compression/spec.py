"""Compression spec strings ("topk:0.01", "powersgd:4", ...) -> configured compressors."""

from __future__ import annotations

import math

import torch

from training.compression.base import Compressor
from training.compression.cast import CastCompressor
from training.compression.identity import NoCompression
from training.compression.int8 import MinMaxInt8, StochasticInt8
from training.compression.powersgd import PowerSGDCompressor
from training.compression.sign import SignCompressor
from training.compression.topk import TopKCompressor

VALID_FORMS = (
    "none (or fp32)",
    "fp16",
    "bf16",
    "int8 (stochastic rounding)",
    "int8:minmax",
    "topk:<density in (0,1]>[:m<momentum in [0,1), default 0.9>][:w<warm-up rounds, default 0>]"
    "[:fp16|:bf16 (values in half precision)]",
    "powersgd:<rank >= 1>",
    "sign",
)

EXAMPLE_SPECS = [
    "none",
    "fp16",
    "bf16",
    "int8",
    "int8:minmax",
    "topk:0.01",
    "topk:0.01:fp16",
    "topk:0.001",
    "powersgd:4",
    "sign",
]


def _invalid(spec: str, problem: str) -> ValueError:
    return ValueError(
        f"invalid compression spec {spec!r}: {problem}; valid forms: " + ", ".join(VALID_FORMS)
    )


def _parse_float(spec: str, text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise _invalid(spec, f"{what} {text!r} is not a number") from None
    if not math.isfinite(value):
        raise _invalid(spec, f"{what} {text!r} is not finite")
    return value


def _parse_int(spec: str, text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise _invalid(spec, f"{what} {text!r} is not an integer") from None


def _make_topk(spec: str, options: list[str]) -> TopKCompressor:
    if not options or not options[0]:
        raise _invalid(spec, "topk needs a density, e.g. topk:0.01")
    density = _parse_float(spec, options[0], "density")
    if not 0.0 < density <= 1.0:
        raise _invalid(spec, f"density {options[0]} must be in (0, 1]")
    momentum, warmup, value_dtype, seen = 0.9, 0, torch.float32, set()
    for option in options[1:]:
        if option in ("fp16", "bf16") and "v" not in seen:
            seen.add("v")
            value_dtype = torch.float16 if option == "fp16" else torch.bfloat16
            continue
        tag, value = option[:1], option[1:]
        if tag not in ("m", "w") or not value or tag in seen:
            raise _invalid(
                spec, f"unknown or repeated topk option {option!r} (use m<x>, w<n>, fp16, bf16)"
            )
        seen.add(tag)
        if tag == "m":
            momentum = _parse_float(spec, value, "momentum")
            if not 0.0 <= momentum < 1.0:
                raise _invalid(spec, f"momentum {value} must be in [0, 1)")
        else:
            warmup = _parse_int(spec, value, "warm-up rounds")
            if warmup < 0:
                raise _invalid(spec, f"warm-up rounds {value} must be >= 0")
    return TopKCompressor(density, momentum=momentum, warmup_rounds=warmup, value_dtype=value_dtype)


def make_compressor(spec: str, *, seed: int = 0) -> Compressor:
    """Build the compressor `spec` names; ValueError naming the spec and the valid forms.

    `seed` drives the compressor's own random numbers (stochastic rounding, PowerSGD's first
    Q); give each cluster leader its own seed so their rounding noise is independent.
    """
    if not isinstance(spec, str):
        raise _invalid(repr(spec), "the spec must be a string")
    text = spec.strip().lower()
    kind, *options = text.split(":")
    if kind in ("none", "fp32", "fp16", "bf16", "sign") and not options:
        if kind == "fp16":
            return CastCompressor(torch.float16)
        if kind == "bf16":
            return CastCompressor(torch.bfloat16)
        if kind == "sign":
            return SignCompressor()
        return NoCompression()
    if kind == "int8":
        if not options:
            return StochasticInt8(seed=seed)
        if options in (["minmax"],):
            return MinMaxInt8()
        if options == ["stochastic"]:
            return StochasticInt8(seed=seed)
        raise _invalid(spec, "int8 takes no option or :minmax")
    if kind == "topk":
        return _make_topk(spec, options)
    if kind == "powersgd":
        if len(options) != 1 or not options[0]:
            raise _invalid(spec, "powersgd needs exactly a rank, e.g. powersgd:4")
        rank = _parse_int(spec, options[0], "rank")
        if rank < 1:
            raise _invalid(spec, f"rank {options[0]} must be >= 1")
        return PowerSGDCompressor(rank, seed=seed)
    if kind in ("none", "fp32", "fp16", "bf16", "sign"):
        raise _invalid(spec, f"{kind} takes no options")
    raise _invalid(spec, f"unknown compressor {kind!r}")


def compressor_specs() -> list[str]:
    """Example specs, one per compressor family, for the CLI help and the benchmarks."""
    return list(EXAMPLE_SPECS)
