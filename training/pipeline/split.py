"""Pure decisions of a pipeline run: where stages start (`balance`), which cluster holds each
stage and how many data-parallel replicas each stage has (`place`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def balance(costs: Sequence[float], stages: int) -> tuple[int, ...]:
    """Cut points (piece indices where stages 1.. start) that minimise the costliest stage.

    Contiguous stages of at least one piece each; ties go to the earliest cut. ValueError when
    there are fewer pieces than stages."""
    n = len(costs)
    if not 1 <= stages <= n:
        raise ValueError(f"stages: the model splits into {n} piece(s); ask for 1 to {n} stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: the least max-stage cost of pieces [0, i) in k stages; cut[k][i]: last start
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                v = max(best[k - 1][j], prefix[i] - prefix[j])
                if v < best[k][i]:
                    best[k][i], cut[k][i] = v, j
    out: list[int] = []
    i = n
    for k in range(stages, 1, -1):
        i = cut[k][i]
        out.append(i)
    return tuple(reversed(out))


def check_cuts(cuts: Sequence[int], pieces: int) -> None:
    """ValueError when fixed cut points do not fit a model of `pieces` pieces."""
    if cuts and cuts[-1] >= pieces:
        raise ValueError(
            f"stages: cut point {cuts[-1]} is past the model's {pieces} piece(s); "
            f"use cut points in 1..{pieces - 1}"
        )


@dataclass(frozen=True)
class Placement:
    """Cluster of each stage, in pipeline order, the data-parallel width of every stage, and
    the GPUs each stage replica's layers are split over (`tensor`: tensor parallelism inside
    the stage's cluster). Rank `(stage * replicas + replica) * tensor + t`: a replica's
    tensor-parallel ranks are consecutive. With `pipelines` the replicas are whole pipelines
    on clusters of their own (replica r's stage s on `pipelines[r][s]`), whose gradient
    all-reduce crosses the WAN; without, every replica of a stage is in its stage's cluster."""

    stage_clusters: tuple[str, ...]
    replicas: int = 1
    tensor: int = 1
    pipelines: tuple[tuple[str, ...], ...] = ()

    def __post_init__(self) -> None:
        if self.pipelines and (
            len(self.pipelines) != self.replicas
            or any(len(c) != self.stages for c in self.pipelines)
            or self.pipelines[0] != self.stage_clusters
        ):
            raise ValueError(
                "pipelines: give each of the replicas one cluster a stage, replica 0's the "
                "stage clusters"
            )

    @property
    def stages(self) -> int:
        return len(self.stage_clusters)

    @property
    def world(self) -> int:
        return self.stages * self.replicas * self.tensor

    def stage_of(self, rank: int) -> int:
        return rank // (self.replicas * self.tensor)

    def replica_of(self, rank: int) -> int:
        return (rank // self.tensor) % self.replicas

    def tensor_of(self, rank: int) -> int:
        return rank % self.tensor

    def rank(self, stage: int, replica: int, t: int = 0) -> int:
        return (stage * self.replicas + replica) * self.tensor + t

    def cluster_of(self, rank: int) -> str:
        if self.pipelines:
            return self.pipelines[self.replica_of(rank)][self.stage_of(rank)]
        return self.stage_clusters[self.stage_of(rank)]

    def replica_clusters(self, stage: int) -> tuple[str, ...]:
        """The cluster of each of `stage`'s replicas, in replica order."""
        return tuple(self.cluster_of(self.rank(stage, r)) for r in range(self.replicas))

    def sharing(self, a: int, b: int, link: tuple[str, str]) -> int:
        """The replicas whose stage `a` to stage `b` messages take `link` (from, to): the
        schedule moves every replica in step, so on one WAN link they go at once."""
        pairs = zip(self.replica_clusters(a), self.replica_clusters(b), strict=True)
        return sum(1 for pair in pairs if pair == link)

    def workers(self) -> dict[str, int]:
        """Ranks per cluster, in order of first appearance."""
        out: dict[str, int] = {}
        for rank in range(self.world):
            c = self.cluster_of(rank)
            out[c] = out.get(c, 0) + 1
        return out


def place(
    clusters: dict[str, int], stages: int | None, hybrid: bool, whole: bool = False
) -> Placement:
    """Stages on clusters in the order the clusters are given, consecutive stages together.

    Pipeline: one worker a stage, so the workers must number the stages. Hybrid: every stage
    has the same number R of replicas, all in its cluster, so each cluster's workers are a
    multiple of R and the stages number the workers over R. Hybrid of `whole` pipelines:
    the workers, in order, make replicas of `stages` consecutive workers each (a replica's
    stages on its own clusters; their gradients all-reduce across them). ValueError says
    the fix."""
    total = sum(clusters.values())
    if whole:
        if stages is None or stages < 1 or total % stages:
            raise ValueError(
                f"stages: whole pipeline replicas take --stages workers each, and --clusters "
                f"gives {total} worker(s); give --stages that divides them"
            )
        order = [c for c, n in clusters.items() for _ in range(n)]
        runs = tuple(tuple(order[i : i + stages]) for i in range(0, total, stages))
        return Placement(runs[0], len(runs), pipelines=runs if len(runs) > 1 else ())
    if not hybrid:
        count = total if stages is None else stages
        if count != total:
            raise ValueError(
                f"stages: pipeline runs one worker per stage, and --clusters gives {total} "
                f"worker(s) for {count} stage(s); make them equal (or use --parallel hybrid)"
            )
        return Placement(tuple(c for c, n in clusters.items() for _ in range(n)))
    if stages is None:
        widths = set(clusters.values())
        if len(widths) != 1:
            raise ValueError(
                "stages: hybrid without --stages puts one stage on each cluster, so every "
                "cluster needs the same number of workers; give --stages or equal counts"
            )
        return Placement(tuple(clusters), widths.pop())
    if total % stages or any(n % (total // stages) for n in clusters.values()):
        raise ValueError(
            f"stages: hybrid gives every stage the same number of replicas inside one cluster; "
            f"{stages} stage(s) over workers {dict(clusters)} cannot; choose --stages so that "
            "every cluster's worker count is a multiple of (all workers / stages)"
        )
    r = total // stages
    return Placement(tuple(c for c, n in clusters.items() for _ in range(n // r)), r)
