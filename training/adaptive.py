"""Adaptive compression: pick the lightest compression whose WAN time hides under compute.

Pure decision code. Every leader calls `choose` with the same inputs (shared through the
exchange headers), so all leaders switch to the same level on the same step.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from training.wan import Link


def estimate_bytes(level: str, shapes: Sequence[tuple[int, ...]]) -> int:
    """Roughly how many bytes one message of `level` takes for tensors of `shapes`."""
    total = 0
    for shape in shapes:
        n = 1
        for d in shape:
            n *= d
        if level in ("none", "fp32"):
            total += 4 * n
        elif level in ("fp16", "bf16"):
            total += 2 * n
        elif level.startswith("int8"):
            total += n + 8
        elif level == "sign":
            total += n // 8 + 8
        elif m := re.match(r"topk:([0-9.eE-]+)", level):
            total += max(1, int(float(m.group(1)) * n)) * 6  # value + small index
        elif m := re.match(r"powersgd:(\d+)", level):
            r = int(m.group(1))
            if len(shape) >= 2:
                rows, cols = shape[0], n // shape[0]
                total += 4 * min(n, r * (rows + cols))
            else:
                total += 4 * n
        else:
            total += 4 * n
        total += 16  # per-tensor framing
    return total


def choose(
    levels: list[str],
    measured: dict[str, int],
    shapes: Sequence[tuple[int, ...]],
    compute_s: float,
    link: Link | None,
    rounds: int = 1,
) -> str:
    """The first (least compressed) level whose time on the wire is at most the compute time.
    A message crosses the slowest link `rounds` times (n-1 in a ring all-gather of n).

    Only the bandwidth part counts: the latency of a synchronous exchange is paid whatever the
    compression, so no level can hide it (local SGD does).
    `measured` holds real message sizes seen for levels already used (they beat estimates).
    Without a link (no shaping, no table) the WAN is not the bottleneck: the first level.
    """
    if link is None or not levels:
        return levels[0] if levels else "none"
    for level in levels:
        nbytes = measured.get(level) or estimate_bytes(level, shapes)
        if rounds * nbytes * 8.0 / link.bandwidth_bps <= compute_s:
            return level
    return levels[-1]
