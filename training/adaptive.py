"""Adaptive compression: pick the lightest compression whose WAN time hides under compute.

Pure decision code. Every leader calls `choose` with the same inputs (shared through the
exchange headers), so all leaders switch to the same level on the same step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from grammar import Compression, CompressionKind
from grammar.compression import message_bytes
from training.wan import Link


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
        nbytes = measured.get(str(level)) or message_bytes(level, shapes)
        if rounds * nbytes * 8.0 / link.bandwidth_bps <= compute_s:
            return level
    return levels[-1]
