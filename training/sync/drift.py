"""Client-drift correction for the modes of local updates on local data (SCAFFOLD's control
variates, in parameter space).

On label-skewed local data each cluster's local steps pull toward its own labels, so between
syncs the clusters drift apart and the average lands off the optimum (Karimireddy et al.,
SCAFFOLD, 2020). SCAFFOLD corrects every local step by `c - c_i`: the consensus update rate
minus this client's own. Its "option II" estimates both from what a round already yields, so
nothing more crosses the WAN: a cluster's own rate is its pseudo-gradient over the steps it
took (less the correction it applied), the consensus rate is the exchanged pseudo-gradient over
the same steps. Applied to the parameters after each local optimizer step (not to the
gradient) it is exact SCAFFOLD under plain SGD and leaves an adaptive optimizer's
preconditioning alone. Weighted by the clusters' shares the corrections sum to zero, so the
average update is unchanged: only the drift apart is removed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from training.collective import split


class DriftCorrection:
    """The control variates of one slice of the flat parameters (all of them, or one
    streaming fragment), per local step. Every rank of a cluster holds the same values (they
    are computed from the anchor and the parameters, equal across the cluster)."""

    def __init__(self, size: int, device: torch.device | str = "cpu") -> None:
        self.consensus = torch.zeros(size, device=device)
        """c: the clusters' (share-weighted) mean update per local step, last round."""
        self.own = torch.zeros(size, device=device)
        """c_i: this cluster's update per local step, last round, before correction."""
        self.correction = torch.zeros(size, device=device)
        """c - c_i: what each local step's parameters are moved against (subtracted)."""
        self.steps = 0
        """Local steps corrected since the slice last became the anchor."""

    def step(self) -> None:
        """One local step of the slice was corrected (by `move`, with `correction`)."""
        self.steps += 1

    def round(self, own_delta: torch.Tensor, total_delta: torch.Tensor, steps: int) -> None:
        """At the slice's sync: this cluster's pseudo-gradient (anchor - parameters) and the
        clusters' weighted sum of theirs, both over `steps` local steps. The new rates per
        step: its own less the correction it applied; the consensus (the mean of the owns).
        The slice is the anchor again: its count starts over."""
        n = max(1, steps)
        own = own_delta.to(self.own.device, self.own.dtype) / n
        self.own = own - self.correction
        self.consensus = total_delta.to(self.own.device, self.own.dtype) / n
        self.correction = self.consensus - self.own
        self.steps = 0

    def reset_steps(self) -> None:
        """The slice became the anchor without a round of its own (dropped, or averaged)."""
        self.steps = 0

    def seat(self, total_delta: torch.Tensor, steps: int) -> None:
        """A member seated late: it takes the consensus rate and, having no rate of its own
        yet, corrects nothing until its first round."""
        self.consensus = total_delta.to(self.own.device, self.own.dtype) / max(1, steps)
        self.own = self.consensus.clone()
        self.correction = torch.zeros_like(self.own)
        self.steps = 0

    def state(self) -> dict[str, Any]:
        return {"consensus": self.consensus.cpu(), "own": self.own.cpu(), "steps": self.steps}

    def load(self, state: Mapping[str, Any] | None, *, own: bool) -> None:
        """Take a saved state; without `own` (the saved cluster is another), the consensus
        alone, this cluster's rate set to it."""
        if not state or state["consensus"].numel() != self.consensus.numel():
            return
        self.consensus = state["consensus"].to(self.consensus.device).clone()
        self.own = (state["own"] if own else state["consensus"]).to(self.own.device).clone()
        self.steps = int(state["steps"]) if own else 0
        self.correction = self.consensus - self.own


def move(params: Sequence[torch.Tensor], correction: torch.Tensor) -> None:
    """After a local optimizer step: move `params` (in flat order) against one step's
    `correction` (flat, as long as they are together)."""
    if not bool(correction.any()):
        return
    with torch.no_grad():
        for p, c in zip(params, split(correction, [p.shape for p in params]), strict=True):
            p.sub_(c.to(p.dtype))
