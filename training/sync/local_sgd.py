"""Local SGD / DiLoCo: each cluster takes `period` inner steps on its own, then the clusters
average their pseudo-gradients and take one outer Nesterov step."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from grammar import Sync
from training.collective import flatten, split
from training.sync.base import Scope, SyncContext, SyncStrategy
from training.sync.drift import DriftCorrection, move
from training.sync.outer import make_outer


class LocalSGDSync(SyncStrategy):
    """Inner steps reduce only inside the cluster; every `period` steps the cluster's
    pseudo-gradient (anchor - parameters) crosses the WAN, weighted by the cluster's batch
    share, and an outer SGD (Nesterov momentum by default) moves the anchor, which every rank
    then copies into its parameters. After a last step that ends no period, the clusters
    average instead of taking an outer step. With `spec.drift_correction` each local step is
    corrected by the clusters' drift apart, from the same exchange (`training.sync.drift`)."""

    regroups = True

    exchanges_gradients = False

    def __init__(self, sync: Sync, ctx: SyncContext) -> None:
        super().__init__(sync, ctx)
        self.period = sync.period
        self.anchor = [p.detach().clone() for p in ctx.params]
        self.outer = make_outer(self.anchor, ctx.spec)
        self.kept: list[tuple[torch.Tensor, bool]] | None = None
        """Joining late (`defer`): each outer step's sum, applied once the state is here."""
        self.drift: DriftCorrection | None = None
        if ctx.spec.drift_correction and len(self.comm.clusters) > 1:
            size = sum(a.numel() for a in self.anchor)
            self.drift = DriftCorrection(size, self.anchor[0].device if self.anchor else "cpu")

    @property
    def scope(self) -> Scope:
        return Scope.CLUSTER

    def after_backward(self, grad: torch.Tensor, step: int, compute_s: float) -> torch.Tensor:
        self.comm.reduce(grad)
        return grad

    def after_local_step(self) -> None:
        if self.drift is not None and self.kept is None:
            move(self.ctx.params, self.drift.correction)
            self.drift.step()

    def after_step(self, step: int) -> None:
        if (step + 1) % self.period == 0:
            self._outer_step(step)
        elif step + 1 == self.spec.steps:
            self._outer_step(step, average=True)

    def at_sync_point(self, step: int) -> bool:
        return step % self.period == 0 or step == self.spec.steps

    def seats_at(self, step: int) -> int | None:
        """The next outer step's: a pseudo-gradient weighted 0 adds nothing to the sum, and
        every member moves the same anchor by the same sums, in the same order."""
        return min((step // self.period + 1) * self.period, self.spec.steps)

    def defer(self) -> None:
        self.kept = []

    def replay(self) -> None:
        kept, self.kept = self.kept, None
        for delta, average in kept or []:
            self._move_anchor(delta, average=average)
        rounds = [delta for delta, average in kept or [] if not average]
        if self.drift is not None and rounds:
            self.drift.seat(rounds[-1], self.period)

    def _outer_step(self, step: int, *, average: bool = False) -> None:
        """Average the pseudo-gradients over clusters, take a Nesterov outer step; or, with
        `average`, move the anchor by the average alone: a pseudo-gradient of less than a
        period pushed through momentum built from whole periods overshoots, and raised the
        language model's final loss (measured: bench/results/streaming-merge.md)."""
        params = self.ctx.params
        cur = flatten([p.detach() for p in params])
        delta = flatten(self.anchor) - cur  # cluster copies agree after the intra all-reduce
        own = delta
        if len(self.comm.clusters) > 1:
            if self.comm.is_leader:
                share = self.ctx.cluster_share
                delta = self.comm.wan_sum(delta * share, step, self.compression)
            self.comm.broadcast(delta)
        self._drift_round(own, delta)
        self._move_anchor(delta, average=average)

    def _drift_round(self, own: torch.Tensor, total: torch.Tensor) -> None:
        """The round's rates for the drift correction: this cluster's pseudo-gradient `own`
        and the clusters' weighted sum `total`, over the local steps it took."""
        if self.drift is not None and self.kept is None:
            self.drift.round(own, total, self.drift.steps)

    def _move_anchor(self, delta: torch.Tensor, *, average: bool) -> None:
        """An outer step on the clusters' summed pseudo-gradient `delta` (flat), or with
        `average` the anchor minus it; then every parameter is the anchor."""
        if self.kept is not None:
            self.kept.append((delta.clone(), average))
            return
        parts = split(delta, [a.shape for a in self.anchor])
        if average:
            with torch.no_grad():
                for a, g in zip(self.anchor, parts, strict=True):
                    a.sub_(g)
        else:
            for a, g in zip(self.anchor, parts, strict=True):
                a.grad = g.clone()
            self.outer.step()
        with torch.no_grad():
            for p, a in zip(self.ctx.params, self.anchor, strict=True):
                p.copy_(a)

    def state_dict(self) -> dict[str, Any]:
        return {"outer": self.outer.state_dict(), "anchor": [a.cpu() for a in self.anchor]}

    def cluster_state(self) -> dict[str, Any]:
        if self.drift is None:
            return {}
        return {"drift": {"cluster": self.comm.cluster, **self.drift.state()}}

    def load_state_dict(
        self, state: Mapping[str, Any] | None, cluster_state: Mapping[str, Any] | None
    ) -> None:
        with torch.no_grad():
            if state is not None and state.get("outer") is not None:
                for a, saved in zip(self.anchor, state["anchor"], strict=True):
                    a.copy_(saved)
                self.outer.load_state_dict(state["outer"])
            else:  # a fresh start, or another mode's checkpoint: start from the parameters
                for a, p in zip(self.anchor, self.ctx.params, strict=True):
                    a.copy_(p.detach())
        saved = (cluster_state or {}).get("drift")
        if self.drift is not None and saved is not None:
            self.drift.load(saved, own=saved.get("cluster") == self.comm.cluster)
