"""The outer optimizer of local SGD / DiLoCo and its streaming form, from the run's settings."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from training.spec import TrainSpec


def make_outer(anchor: Sequence[torch.Tensor], spec: TrainSpec) -> torch.optim.SGD:
    """SGD over the `anchor` tensors with the run's outer lr and momentum, Nesterov's when
    `spec.outer_nesterov` (torch allows it only with momentum)."""
    return torch.optim.SGD(
        list(anchor),
        lr=spec.outer_lr,
        momentum=spec.outer_momentum,
        nesterov=spec.outer_nesterov and spec.outer_momentum > 0,
    )
