"""Bounded staleness: each cluster applies its own gradient at once and the other clusters'
`staleness` steps late, so that many exchanges overlap compute."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from grammar import Sync
from training.sync.base import Scope, SyncContext
from training.sync.every_step import EveryStepSync


class StaleSync(EveryStepSync):
    """The leader runs exchanges on one background thread in step order: each overlaps the
    next step's compute, one at a time (a step takes the longer of the two,
    `grammar.auto.step_seconds`), and a cluster never runs more than S steps ahead of the
    slowest one.
    Each step applies the cluster's fresh gradient plus, for step t-S, the correction
    (global mean gradient - own gradient), so every cluster applies the same total update;
    only its timing differs (clusters' parameters differ by the updates in flight). With
    S = 0 or a single cluster it is every-step sync."""

    regroups = False

    def __init__(self, sync: Sync, ctx: SyncContext) -> None:
        super().__init__(sync, ctx)
        self.staleness = sync.staleness
        self.active = self.staleness > 0 and len(self.comm.clusters) > 1
        leader = self.comm.is_leader and self.active
        self.pool = ThreadPoolExecutor(max_workers=1) if leader else None
        self.pending: deque[Future[torch.Tensor] | torch.Tensor] = deque()  # leader: sums
        self.own: deque[torch.Tensor] = deque()  # what this cluster applied, not yet corrected

    @property
    def scope(self) -> Scope:
        return Scope.CLUSTER if self.active else Scope.GLOBAL

    def _across_clusters(self, grad: torch.Tensor, step: int) -> torch.Tensor:
        if not self.active:
            return super()._across_clusters(grad, step)
        self.own.append(grad.clone())
        if self.comm.is_leader:
            assert self.pool is not None
            share = grad * self.ctx.cluster_share
            self.pending.append(self.pool.submit(self._global_sum, share, step))
        if len(self.own) <= self.staleness:
            return grad
        return grad + self._correction()

    def _correction(self) -> torch.Tensor:
        """The oldest in-flight step: global mean gradient minus what this cluster applied."""
        own = self.own.popleft()
        glob = torch.zeros_like(own)
        if self.comm.is_leader:
            item = self.pending.popleft()
            glob = item.result() if isinstance(item, Future) else item
        self.comm.broadcast(glob)
        return glob - own

    def finish(self) -> None:
        """Apply the corrections still in flight (the same total update on every cluster)."""
        while self.own:
            self.ctx.apply(self._correction())

    def _drain(self) -> list[torch.Tensor]:
        """Wait for the exchanges in flight (the leaders' group must be idle for a
        checkpoint's gather) and keep their sums."""
        done = [item.result() if isinstance(item, Future) else item for item in self.pending]
        self.pending = deque(done)
        return done

    def cluster_state(self) -> dict[str, Any]:
        self._drain()
        model = self.ctx.model
        return {
            "own": [t.cpu() for t in self.own],
            "model": {k: v.cpu() for k, v in model.state_dict().items()} if self.own else None,
        }

    def state_dict(self) -> dict[str, Any]:
        return {"pending": [t.cpu() for t in self._drain()]}

    def load_state_dict(
        self, state: Mapping[str, Any] | None, cluster_state: Mapping[str, Any] | None
    ) -> None:
        if state is None or cluster_state is None:
            return
        device = self.comm.device
        self.own = deque(t.to(device) for t in cluster_state.get("own", []))
        if self.comm.is_leader:
            self.pending = deque(t.to(device) for t in state.get("pending", []))

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None
