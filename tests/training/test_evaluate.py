"""`training.tasks.evaluate`: the quality every worker and every benchmark peer reports."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from training.tasks import evaluate, load_task


class Constant(nn.Module):
    """Equal logits for every class, except a small lead for class `lead`."""

    def __init__(self, classes: int, lead: int) -> None:
        super().__init__()
        self.logits = nn.Parameter(torch.zeros(classes))
        with torch.no_grad():
            self.logits[lead] = 1e-3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits.expand(len(x), -1)


def test_loss_and_accuracy_over_every_batch_and_the_mode_kept() -> None:
    task = load_task("builtin:mnist1d-cnn")
    classes = 10
    ye = torch.arange(1000) % classes  # 100 of each class: 1,000 = one batch of 512 and 488
    xe = torch.zeros(len(ye), 1)
    model = Constant(classes, lead=3)
    model.train()
    ev = evaluate(task, model, xe, ye)
    assert ev.accuracy == pytest.approx(0.1)  # class 3 only, in both batches
    assert ev.loss == pytest.approx(math.log(classes), rel=1e-3)  # cross-entropy at chance
    assert model.training  # left as found
    model.eval()
    evaluate(task, model, xe[:7], ye[:7], batch=2)  # a short last batch
    assert not model.training
    # the mean is over samples, not batches: 3 samples, batches of 2 and 1
    ye3 = torch.tensor([3, 3, 0])
    assert evaluate(task, model, xe[:3], ye3, batch=2).accuracy == pytest.approx(2 / 3)
