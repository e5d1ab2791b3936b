"""Pipeline schedules as pure op lists: which micro-batch each stage runs forward or backward.

Every stage executes its list in order with blocking receives and non-blocking sends; since
each link carries its messages in the order both ends list them, GPipe and 1F1B never
deadlock. GPipe runs all forwards then all backwards (activations of every micro-batch held);
1F1B warms up with S-1-s forwards, then alternates, so stage s holds at most S-s micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Schedule(StrEnum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"


@dataclass(frozen=True)
class Op:
    forward: bool
    micro: int


def stage_ops(schedule: Schedule, stage: int, stages: int, micro: int) -> list[Op]:
    """The ops of `stage` (0-based) of `stages` for one step of `micro` micro-batches."""
    if schedule is Schedule.GPIPE:
        return [Op(True, m) for m in range(micro)] + [Op(False, m) for m in range(micro)]
    warm = min(stages - 1 - stage, micro)
    ops = [Op(True, m) for m in range(warm)]
    f, b = warm, 0
    while f < micro:
        ops += [Op(True, f), Op(False, b)]
        f, b = f + 1, b + 1
    ops += [Op(False, m) for m in range(b, micro)]
    return ops


def bubble_fraction(stages: int, micro: int) -> float:
    """Idle share of a balanced pipeline's step: (S-1)/(M+S-1), the same for GPipe and 1F1B."""
    return (stages - 1) / (micro + stages - 1)


def max_in_flight(ops: list[Op]) -> int:
    """Most micro-batches whose activations a stage holds at once under `ops`."""
    held = peak = 0
    for op in ops:
        held += 1 if op.forward else -1
        peak = max(peak, held)
    return peak
