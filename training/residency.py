"""Data residency: which training samples each cluster holds under `data: local`.

A task may give each cluster its own samples with its `cluster_data` hook (indices into its
training set); without one the built-in split is non-IID by label: with at least as many
labels as clusters, label `l` (in sorted order, the i-th) lives only in cluster `i mod n`;
otherwise (or for sequence targets) the set is cut into n contiguous parts. Pure code.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from training.tasks import Task


def split_by_label(y: torch.Tensor, clusters: Sequence[str]) -> dict[str, torch.Tensor]:
    """Indices of the samples each cluster holds: disjoint, together all of them."""
    n = len(clusters)
    if y.dim() == 1:
        labels = sorted(int(v) for v in y.unique())
        if len(labels) >= n:
            owner = {label: i % n for i, label in enumerate(labels)}
            which = torch.tensor([owner[int(v)] for v in y])
            return {c: torch.nonzero(which == i).flatten() for i, c in enumerate(clusters)}
    parts = torch.arange(len(y)).tensor_split(n)
    return {c: parts[i] for i, c in enumerate(clusters)}


def cluster_indices(
    task: Task, y: torch.Tensor, cluster: str, clusters: Sequence[str]
) -> torch.Tensor:
    """The training-set indices `cluster` holds: the task's hook, else `split_by_label`."""
    if task.cluster_data is not None:
        got = torch.as_tensor(list(task.cluster_data(cluster, list(clusters))), dtype=torch.long)
        if len(got) == 0:
            raise ValueError(f"task: cluster_data gave cluster {cluster!r} no samples")
        return got
    return split_by_label(y, clusters)[cluster]


def cluster_slice(
    task: Task, x: torch.Tensor, y: torch.Tensor, cluster: str, clusters: Sequence[str]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples (inputs, targets) `cluster` holds: all it may ever read."""
    idx = cluster_indices(task, y, cluster, clusters)
    return x[idx], y[idx]
