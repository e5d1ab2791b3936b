"""Heterogeneity-aware partial sync (`partial:H`): local SGD whose fast clusters run ahead.

A round is H steps of the slowest cluster. In it each cluster takes as many local steps per
step as its speed allows (`steps_per_tick`: its step time against the slowest's, at most
`spec.speed_bound` times), so no cluster idles while the slowest computes. At the end of the
round the pseudo-gradients are averaged weighted by the samples each cluster processed, and
the outer step is local SGD's. The speeds travel with the outer exchange (each leader's mean
step time of the round), so every leader computes the same step counts and weights.

Each cluster's pseudo-gradient is first divided by its local steps per tick (FedNova's
normalisation, with the nominal H as the effective step count): a fast cluster's drift spans
k x H local steps, and the outer Nesterov step (lr 0.7, momentum 0.9, tuned for H-step
pseudo-gradients) fed that unnormalised overshoots round after round. Measured before the fix
(mnist1d MLP, 3 clusters, 1:1:4, partial:16, 400 steps): the fast clusters' pseudo-gradient
norms grew from 1.9 to 22 and the anchor's norm from 9 to 175; accuracy peaked at 60 % at step
150 and fell to 19 % (loss 2.67). The same run with a plain outer average (momentum 0, lr 1)
reached 68 %, which puts the blame on the outer step's size, not on mixing unequal progress.
With the normalisation: 65 %. The sample weighting stays: the fast clusters' directions count
k times, only the step's magnitude is per tick.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import Any

import torch

from grammar import Sync
from training.collective import flatten
from training.sync.base import SyncContext
from training.sync.hetero import steps_per_tick
from training.sync.local_sgd import LocalSGDSync


class PartialSync(LocalSGDSync):
    """`partial:H`; `self.steps` holds each cluster's local steps per step this round.

    It shrinks and grows in place as local SGD does: the survivors keep their local steps
    per step (`state_dict`), a newcomer starts at one, and the next round's end measures
    every cluster's speed again. A newcomer is seated late as in local SGD: sitting out,
    it reports no step time, which the round's end reads as one local step per step (what a
    newcomer starts at), and it keeps the steps the rounds it sat out decided, not those of
    the state it takes (`load_state_dict`)."""

    WINDOW = 64
    """Local step times the speed estimate is the median of."""

    def __init__(self, sync: Sync, ctx: SyncContext) -> None:
        super().__init__(sync, ctx)
        self.steps: dict[str, int] = dict.fromkeys(self.comm.clusters, 1)
        self.times: list[float] = []  # the last WINDOW local step times
        self.rounds = 0

    def local_steps(self, step: int) -> int:
        return self.steps[self.comm.cluster]

    def after_backward(self, grad: torch.Tensor, step: int, compute_s: float) -> torch.Tensor:
        self.times.append(self.ctx.device_s())
        del self.times[: -self.WINDOW]
        return super().after_backward(grad, step, compute_s)

    def _weights(self) -> dict[str, float]:
        """Each cluster's weight in the outer average: its share of the samples processed
        this round (batch share x local steps per step)."""
        shares = self.ctx.cluster_shares or {self.comm.cluster: 1.0}
        raw = {c: shares.get(c, 0.0) * self.steps[c] for c in self.comm.clusters}
        total = sum(raw.values()) or 1.0
        return {c: v / total for c, v in raw.items()}

    def _outer_step(self, step: int, *, average: bool = False) -> None:
        params = self.ctx.params
        cur = flatten([p.detach() for p in params])
        delta = flatten(self.anchor) - cur
        # the median device time of one local step over the last WINDOW steps (CPU time times
        # the emulated slowdown, `SyncContext.device_s`; a median over more than one round, so
        # neither a stalled step nor a short round makes a cluster look slow)
        self.comm.compute_ema = statistics.median(self.times) if self.times else 0.0
        mine = self.steps[self.comm.cluster]
        ran = mine  # this round's local steps per step
        if len(self.comm.clusters) > 1:
            if self.comm.is_leader:
                # FedNova-style: this cluster's drift per local step of a tick (its
                # pseudo-gradient over its steps per tick), then weighted by samples
                weight = self._weights()[self.comm.cluster] / max(1, mine)
                done = self.comm.wan_exchange(delta * weight, step, self.compression)
                delta = done.total
                times = [float(i.get("compute", 0.0)) for i in done.infos]
                slowest = max(times)
                bound = self.spec.speed_bound
                self.steps = {
                    c: steps_per_tick(t, slowest, bound)
                    for c, t in zip(self.comm.clusters, times, strict=True)
                }
                mine = self.steps[self.comm.cluster]
            both = torch.cat([delta, torch.tensor([float(mine)], dtype=delta.dtype)])
            self.comm.broadcast(both)
            delta, mine = both[:-1], int(both[-1].item())
            self.steps[self.comm.cluster] = mine
        self.rounds += 1
        # the consensus is per tick (each drift over its steps per tick): per local step of
        # this cluster, that is `ran` times the sum over its `ran` x H local steps
        self._drift_round(flatten(self.anchor) - cur, delta * ran)
        self._move_anchor(delta, average=average)

    def stats(self) -> dict[str, float]:
        return {
            "rounds": float(self.rounds),
            "max_steps_per_step": float(max(self.steps.values())),
        }

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "steps": dict(self.steps)}

    def load_state_dict(
        self, state: Mapping[str, Any] | None, cluster_state: Mapping[str, Any] | None
    ) -> None:
        sat_out = dict(self.steps) if self.kept is not None else None
        super().load_state_dict(state, cluster_state)
        saved = (state or {}).get("steps") or {}
        # seated late: the state is older than the rounds this member has taken part in since
        self.steps = (
            sat_out
            if sat_out is not None
            else {c: int(saved.get(c, 1)) for c in self.comm.clusters}
        )
