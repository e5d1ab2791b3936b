"""What user code hands the runtime: a `Task`, its optimizer, and how its quality is measured."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

Data = tuple[torch.Tensor, torch.Tensor] | Dataset[Any]


@dataclass
class OptimizerSpec:
    """The local (inner) optimizer: sgd, adam or adamw."""

    name: str = "sgd"
    lr: float = 0.1
    momentum: float = 0.0
    weight_decay: float = 0.0

    def build(self, params: Any, lr: float | None = None, no_momentum: bool = False) -> Any:
        lr = self.lr if lr is None else lr
        if self.name == "sgd":
            mom = 0.0 if no_momentum else self.momentum
            return torch.optim.SGD(params, lr=lr, momentum=mom, weight_decay=self.weight_decay)
        if self.name == "adam":
            return torch.optim.Adam(params, lr=lr, weight_decay=self.weight_decay)
        if self.name == "adamw":
            return torch.optim.AdamW(params, lr=lr, weight_decay=self.weight_decay)
        raise ValueError(f"optimizer name {self.name!r}: use sgd, adam or adamw")


@dataclass
class Task:
    """What user code hands the runtime."""

    model: Callable[[], nn.Module]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    train: Data
    eval: Data
    optimizer: OptimizerSpec
    batch_size: int = 128
    target_accuracy: float | None = None  # what benchmarks race to
    cluster_data: Callable[[str, list[str]], Sequence[int]] | None = None
    """Data residency (`data: local`): the training-set indices cluster `name` of `clusters`
    holds; None: the built-in non-IID split by label (`training.residency`)."""
    cluster_train: Callable[[str, list[str]], Data] | None = None
    """Data residency (`data: local`): the samples cluster `name` of `clusters` holds, loaded
    where they live; a cluster's workers call it instead of reading `train`, so none reads
    another cluster's samples."""


def as_tensors(data: Data) -> tuple[torch.Tensor, torch.Tensor]:
    """Materialize a dataset as (inputs, targets) so batches are cheap index lookups."""
    if isinstance(data, tuple):
        x, y = data
        return torch.as_tensor(x), torch.as_tensor(y)
    items = [data[i] for i in range(len(data))]  # type: ignore[arg-type]
    xs = torch.stack([torch.as_tensor(it[0]) for it in items])
    ys = torch.stack([torch.as_tensor(it[1]) for it in items])
    return xs, ys


def accuracy(out: torch.Tensor, y: torch.Tensor) -> float:
    """Argmax accuracy over the last dim (classes, or next characters per position)."""
    return float((out.argmax(dim=-1) == y).float().mean())


@dataclass(frozen=True)
class Evaluation:
    """The model on the evaluation set."""

    accuracy: float
    loss: float
    """The task's loss, mean over samples (a language model's quality is its loss more than
    its next-token accuracy)."""


def evaluate(
    task: Task,
    model: nn.Module,
    xe: torch.Tensor,
    ye: torch.Tensor,
    device: torch.device | str | None = None,
    batch: int = 512,
) -> Evaluation:
    """`model` on the whole evaluation set, in batches; its train/eval mode is left as found.
    cpn's workers and the benchmarks' peers measure quality with this one function."""
    was_training = model.training
    model.eval()
    hits = loss = 0.0
    with torch.no_grad():
        for i in range(0, len(xe), batch):
            xb, yb = xe[i : i + batch], ye[i : i + batch]
            if device is not None:
                xb, yb = xb.to(device), yb.to(device)
            out = model(xb)
            hits += accuracy(out, yb) * len(yb)
            loss += float(task.loss(out, yb)) * len(yb)
    model.train(was_training)
    n = max(len(xe), 1)
    return Evaluation(accuracy=hits / n, loss=loss / n)
