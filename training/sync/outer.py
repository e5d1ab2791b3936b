"""The outer optimizer of local SGD / DiLoCo and its streaming form, from the run's settings."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from training.spec import TrainSpec


def make_outer(anchor: Sequence[torch.Tensor], spec: TrainSpec) -> torch.optim.SGD:
    """SGD over the `anchor` tensors with the run's outer lr and momentum
    (`TrainSpec.outer_settings`), Nesterov's when `spec.outer_nesterov` (torch allows it
    only with momentum)."""
    lr, momentum = spec.outer_settings
    return torch.optim.SGD(
        list(anchor), lr=lr, momentum=momentum, nesterov=spec.outer_nesterov and momentum > 0
    )
