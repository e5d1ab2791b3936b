"""Which samples a step uses, and which of them a worker gets.

The global batch of step t depends only on (seed, t, dataset size, batch size), so the data
position in a checkpoint is just the step, and a run resumed with a different number of
workers reads exactly the same global batches (re-sharded).
"""

from __future__ import annotations

import torch


def batch_indices(n: int, batch: int, seed: int, step: int) -> torch.Tensor:
    """Indices of the global batch of `step`: epochs of seeded permutations, no partial batch."""
    batch = min(batch, n)
    per_epoch = n // batch
    epoch, i = divmod(step, per_epoch)
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    perm = torch.randperm(n, generator=g)
    return perm[i * batch : (i + 1) * batch]


def shard_sizes(batch: int, world: int) -> list[int]:
    """Equal batch shares, the remainder to the first ranks."""
    q, r = divmod(batch, world)
    return [q + (1 if k < r else 0) for k in range(world)]


def shard(indices: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's slice of a global batch."""
    sizes = shard_sizes(len(indices), world)
    start = sum(sizes[:rank])
    return indices[start : start + sizes[rank]]
