"""Parallelism values: `data`, `pipeline`, `hybrid`, `tensor` (`auto` is the planner's), and
stage splits.

`--stages N` asks for N stages balanced by compute; `--stages @3,5` fixes the split: new stages
start at pieces 3 and 5 (three stages). `str()` prints the canonical form, which parses back
to an equal value.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from enum import StrEnum


class Parallelism(StrEnum):
    AUTO = "auto"
    DATA = "data"
    """The whole model in every worker; gradients (or models) cross clusters."""
    PIPELINE = "pipeline"
    """Stages on clusters, one worker a stage; activations cross clusters."""
    HYBRID = "hybrid"
    """Pipeline across clusters, data parallel inside each stage's cluster."""
    TENSOR = "tensor"
    """One cluster's GPUs split each layer (tensor parallel), data parallel over the groups;
    never across the WAN. With stages (`tensor` GPUs a stage replica) it is 3D."""


PARALLEL_HELP = "valid forms: auto, data, pipeline, hybrid, tensor"
STAGES_HELP = (
    "valid forms: <N >= 1> (balanced by compute) or @<c1>,<c2>,... (pieces where stages start)"
)


def parse_parallelism(text: str) -> Parallelism:
    """ValueError names the valid forms."""
    try:
        return Parallelism(text.strip().lower())
    except ValueError:
        raise ValueError(f"parallelism {text!r}: {PARALLEL_HELP}") from None


@dataclass(frozen=True)
class StageSplit:
    """`count` stages; `cuts` (ascending piece indices > 0 where stages 1.. start) when fixed."""

    count: int
    cuts: tuple[int, ...] | None = None

    def __str__(self) -> str:
        return str(self.count) if self.cuts is None else "@" + ",".join(map(str, self.cuts))


def parse_stages(text: str) -> StageSplit:
    """ValueError names the valid forms."""
    raw = text.strip()
    bad = ValueError(f"stages {text!r}: {STAGES_HELP}")
    if raw.startswith("@"):
        try:
            cuts = tuple(int(c) for c in raw[1:].split(","))
        except ValueError:
            raise bad from None
        if not cuts or cuts[0] < 1 or any(b <= a for a, b in itertools.pairwise(cuts)):
            raise ValueError(f"stages {text!r}: cut points must be ascending and >= 1")
        return StageSplit(len(cuts) + 1, cuts)
    try:
        n = int(raw)
    except ValueError:
        raise bad from None
    if n < 1:
        raise bad
    return StageSplit(n)
