"""Every step: the step's gradient, reduced over every rank of every cluster, before it is
applied (synchronous data parallelism; compressed between cluster leaders)."""

from __future__ import annotations

import torch

from training.sync.base import SyncStrategy


class EveryStepSync(SyncStrategy):
    """All-reduce inside the cluster, compressed sum between leaders, broadcast back: every
    rank applies the full-batch mean gradient (up to compression error)."""

    regroups = True

    def after_backward(self, grad: torch.Tensor, step: int, compute_s: float) -> torch.Tensor:
        self.comm.observe_compute(compute_s)
        self.comm.reduce(grad)
        if len(self.comm.clusters) == 1:
            return grad
        return self._across_clusters(grad, step)

    def _across_clusters(self, grad: torch.Tensor, step: int) -> torch.Tensor:
        """The cluster-reduced `grad` summed over clusters, on every rank."""
        if self.comm.is_leader:
            grad = self._global_sum(grad, step)
        self.comm.broadcast(grad)
        return grad

    def _global_sum(self, flat: torch.Tensor, step: int) -> torch.Tensor:
        """Leader only: the sum over clusters at the current compression level."""
        return self.comm.wan_sum(flat, step, self.compression)
