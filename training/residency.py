"""Data residency: which training samples each cluster holds under `data: local`.

A task may load each cluster's samples where they live with its `cluster_train` hook, or
give each cluster its own samples with its `cluster_data` hook (indices into its training
set: a `Dataset` is then read at those indices only); without either the built-in split is
non-IID by label: with at least as many labels as clusters, label `l` (in sorted order, the
i-th) lives only in cluster `i mod n`; otherwise (or for sequence targets) the set is cut into
n contiguous parts. Pure code.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils.data import Subset

from training.tasks import Task
from training.tasks.base import as_tensors


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


def local_samples(
    task: Task, cluster: str, clusters: Sequence[str]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples (inputs, targets) a worker of `cluster` trains on under local data, read
    without reading another cluster's where the task allows: its `cluster_train`, else a
    `Dataset` at `cluster_data`'s indices; a task of in-memory tensors is sliced."""
    if task.cluster_train is not None:
        got = as_tensors(task.cluster_train(cluster, list(clusters)))
        if len(got[1]) == 0:
            raise ValueError(f"task: cluster_train gave cluster {cluster!r} no samples")
        return got
    if task.cluster_data is not None and not isinstance(task.train, tuple):
        idx = cluster_indices(task, torch.empty(0), cluster, clusters)
        return as_tensors(Subset(task.train, idx.tolist()))
    x, y = as_tensors(task.train)
    return cluster_slice(task, x, y, cluster, clusters)
