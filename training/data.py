"""Which samples a step uses, and which of them a worker gets.

The global batch of step t depends only on (seed, t, dataset size, batch size), so the data
position in a checkpoint is just the step, and a run resumed with a different number of
workers reads exactly the same global batches (re-sharded).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

import torch


def batch_indices(n: int, batch: int, seed: int, step: int) -> torch.Tensor:
    """Indices of the global batch of `step`: epochs of seeded permutations, no partial batch."""
    batch = min(batch, n)
    per_epoch = n // batch
    epoch, i = divmod(step, per_epoch)
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    perm = torch.randperm(n, generator=g)
    return perm[i * batch : (i + 1) * batch]


def shard_sizes(batch: int, world: int, weights: Sequence[float] | None = None) -> list[int]:
    """Each rank's part of a batch of `batch`: equal without `weights`, the remainder to the
    first ranks; else in proportion to each rank's weight (the planner's batch shares, so a
    faster GPU takes more samples and no cluster waits on another), by largest remainder
    (ties to the first ranks), one sample at least a rank. A rank of weight 0 takes none (a
    member sitting out a round: `SyncStrategy.seats_at`)."""
    if weights is not None and len(weights) == world and min(weights) == 0 < max(weights):
        active = [k for k in range(world) if weights[k] > 0]
        sizes = [0] * world
        parts = shard_sizes(batch, len(active), [weights[k] for k in active])
        for k, n in zip(active, parts, strict=True):
            sizes[k] = n
        return sizes
    if weights is None or batch < world:
        q, r = divmod(batch, world)
        return [q + (1 if k < r else 0) for k in range(world)]
    if len(weights) != world or min(weights) <= 0:
        raise ValueError(f"weights: {world} positive weights, one a rank; got {list(weights)}")
    total = float(sum(weights))
    exact = [batch * w / total for w in weights]
    sizes = [int(x) for x in exact]
    order = sorted(range(world), key=lambda k: (-(exact[k] - sizes[k]), k))
    for k in order[: batch - sum(sizes)]:
        sizes[k] += 1
    for k in range(world):  # a rank given nothing takes one sample of the largest part
        if sizes[k] == 0:
            sizes[max(range(world), key=lambda j: (sizes[j], -j))] -= 1
            sizes[k] = 1
    return sizes


def rank_weights(shares: Mapping[str, float], ranks_cluster: Sequence[str]) -> list[float] | None:
    """Each rank's weight from per-cluster batch shares: its cluster's share split equally
    over the cluster's ranks; None (equal per rank) without shares. A cluster the shares do
    not name (one that joined mid-run) weighs as the named clusters' ranks do on average."""
    if not shares:
        return None
    counts = Counter(ranks_cluster)
    named = [c for c in counts if c in shares]
    if not named:
        return None
    mean = sum(shares[c] for c in named) / sum(counts[c] for c in named)
    return [shares[c] / counts[c] if c in shares else mean for c in ranks_cluster]


def shard(
    indices: torch.Tensor, rank: int, world: int, weights: Sequence[float] | None = None
) -> torch.Tensor:
    """This rank's slice of a global batch (`shard_sizes`)."""
    sizes = shard_sizes(len(indices), world, weights)
    start = sum(sizes[:rank])
    return indices[start : start + sizes[rank]]
