"""Compression values (`grammar.Compression`) -> configured compressors.

The grammar of the values (parsing, validation, help text) is `grammar.parse_compression`'s;
this module only maps each `CompressionKind` to the compressor that implements it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from grammar import COMPRESSION_HELP, Compression, CompressionKind, parse_compression
from training.compression.base import Compressor
from training.compression.cast import CastCompressor
from training.compression.identity import NoCompression
from training.compression.int8 import MinMaxInt8, StochasticInt8
from training.compression.intn import StochasticIntN
from training.compression.powersgd import PowerSGDCompressor
from training.compression.sign import SignCompressor
from training.compression.topk import TopKCompressor

EXAMPLE_SPECS = [
    "none",
    "fp16",
    "bf16",
    "int8",
    "int8:minmax",
    "int4",
    "int2",
    "topk:0.01",
    "topk:0.01:fp16",
    "topk:0.001",
    "topk:0.02:m0:c4096:int2",
    "powersgd:4",
    "sign",
]

_HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _int8(c: Compression, seed: int) -> Compressor:
    return MinMaxInt8() if c.minmax else StochasticInt8(seed=seed)


_BITS = {"int4": 4, "int2": 2}


def _topk(c: Compression, seed: int) -> Compressor:
    return TopKCompressor(
        c.density,
        momentum=c.momentum,
        warmup_rounds=c.warmup,
        value_dtype=_HALF.get(c.values, torch.float32),
        chunk=c.chunk,
        value_bits=_BITS.get(c.values, 0),
        seed=seed,
    )


_BUILDERS: dict[CompressionKind, Callable[[Compression, int], Compressor]] = {
    CompressionKind.NONE: lambda c, seed: NoCompression(),
    CompressionKind.FP16: lambda c, seed: CastCompressor(torch.float16),
    CompressionKind.BF16: lambda c, seed: CastCompressor(torch.bfloat16),
    CompressionKind.INT8: _int8,
    CompressionKind.INT4: lambda c, seed: StochasticIntN(4, seed=seed),
    CompressionKind.INT2: lambda c, seed: StochasticIntN(2, seed=seed),
    CompressionKind.TOPK: _topk,
    CompressionKind.POWERSGD: lambda c, seed: PowerSGDCompressor(c.rank, seed=seed),
    CompressionKind.SIGN: lambda c, seed: SignCompressor(),
}


def make_compressor(spec: str | Compression, *, seed: int = 0) -> Compressor:
    """Build the compressor a compression value names (a string is parsed by the grammar).

    ValueError quotes the value and lists the valid forms; `auto` is refused, since the
    planner replaces it before anything runs. `seed` drives the compressor's own random
    numbers (stochastic rounding, PowerSGD's first Q); give each cluster leader its own seed
    so their rounding noise is independent.
    """
    compression = parse_compression(spec)
    builder = _BUILDERS.get(compression.kind)
    if builder is None:
        raise ValueError(
            f"compression {str(spec)!r}: {compression.kind.value} is not runnable, a run needs "
            f"a concrete value (the planner replaces auto); {COMPRESSION_HELP}"
        )
    return builder(compression, seed)


def compressor_specs() -> list[str]:
    """Runnable example values, one per compressor family, for the CLI help and the benchmarks."""
    return list(EXAMPLE_SPECS)
