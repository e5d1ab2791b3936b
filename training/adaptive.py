"""Adaptive compression: pick the lightest compression whose WAN time hides under compute.

Pure decision code. Every leader calls `choose` with the same inputs (shared through the
exchange headers), so all leaders switch to the same level on the same step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from grammar import Compression, CompressionKind, parse_compression
from training.wan import Link


def estimate_bytes(level: str | Compression, shapes: Sequence[tuple[int, ...]]) -> int:
    """Roughly how many bytes one message of `level` takes for tensors of `shapes`."""
    c = parse_compression(level)
    total = 0
    for shape in shapes:
        n = math.prod(shape)
        if c.kind in (CompressionKind.FP16, CompressionKind.BF16):
            total += 2 * n
        elif c.kind is CompressionKind.INT8:
            total += n + 8
        elif c.kind in (CompressionKind.INT4, CompressionKind.INT2):
            bits = 4 if c.kind is CompressionKind.INT4 else 2
            total += math.ceil(n * bits / 8) + 2 * math.ceil(n / 128)
        elif c.kind is CompressionKind.SIGN:
            total += n // 8 + 8
        elif c.kind is CompressionKind.TOPK:
            value = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "int4": 0.6, "int2": 0.3}[c.values]
            total += math.ceil(max(1, int(c.density * n)) * (value + 2))  # value + small index
        elif c.kind is CompressionKind.POWERSGD:
            if len(shape) >= 2:
                rows, cols = shape[0], n // shape[0]
                total += 4 * min(n, c.rank * (rows + cols))
            else:
                total += 4 * n
        else:
            total += 4 * n
        total += 16  # per-tensor framing
    return total


def choose(
    levels: Sequence[Compression],
    measured: Mapping[str, int],
    shapes: Sequence[tuple[int, ...]],
    compute_s: float,
    link: Link | None,
    rounds: float = 1,
) -> Compression:
    """The first (least compressed) level whose time on the wire is at most the compute time.
    A message crosses the slowest link `rounds` times (n-1 in a ring all-gather of n; the
    adaptive sync passes bytes per link already, with rounds=1).

    Only the bandwidth part counts: the latency of a synchronous exchange is paid whatever the
    compression, so no level can hide it (local SGD does).
    `measured` holds real sizes seen for levels already used (they beat estimates), under
    their canonical names.
    Without a link (no shaping, no table) the WAN is not the bottleneck: the first level.
    """
    if link is None or not levels:
        return levels[0] if levels else Compression(CompressionKind.NONE)
    for level in levels:
        nbytes = measured.get(str(level)) or estimate_bytes(level, shapes)
        if rounds * nbytes * 8.0 / link.bandwidth_bps <= compute_s:
            return level
    return levels[-1]
