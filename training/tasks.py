"""The task interface for user code, and the built-in tasks (no downloads).

A job names an entrypoint `module:function` (or `builtin:NAME`). The function takes no
arguments and returns a `Task`: a model factory, a loss, training and evaluation data (a pair
of tensors or a map-style dataset of (x, y) items) and optimizer settings. The runtime seeds
torch before calling the model factory, so every worker starts from the same weights, and
shards each global batch across workers by their batch share.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
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


# ---------------------------------------------------------------- built-in tasks


def _cache_dir() -> Path | None:
    """Where generated data is kept across processes: CPN_CACHE_DIR, else the XDG cache."""
    if root := os.environ.get("CPN_CACHE_DIR"):
        return Path(root)
    try:
        return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cpn"
    except RuntimeError:  # no home directory (a bare container user): no cache
        return None


@functools.lru_cache(maxsize=2)
def _mnist1d(seed: int = 42) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """MNIST-1D, generated once per machine: generating it costs every worker seconds of CPU."""
    from importlib.metadata import version

    root = _cache_dir()
    path = root / f"mnist1d-{version('mnist1d')}-seed{seed}.pt" if root else None
    if path is not None:
        try:
            x, y, xt, yt = torch.load(path, weights_only=True)
            return x, y, xt, yt
        except Exception:  # missing or unreadable: generate it and (re)write the cache
            pass
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.seed = seed
    d = make_dataset(args)  # procedural; never the download path
    data = (
        torch.tensor(d["x"], dtype=torch.float32),
        torch.tensor(d["y"], dtype=torch.long),
        torch.tensor(d["x_test"], dtype=torch.float32),
        torch.tensor(d["y_test"], dtype=torch.long),
    )
    if path is not None:  # written aside, then renamed: a reader never sees half a file
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(data, tmp)
            os.replace(tmp, path)
        except OSError:  # read-only: each process generates its own
            tmp.unlink(missing_ok=True)
    return data


def mnist1d_mlp() -> Task:
    x, y, xt, yt = _mnist1d()

    def model() -> nn.Module:
        return nn.Sequential(
            nn.Linear(40, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10)
        )

    return Task(
        model,
        nn.functional.cross_entropy,
        (x, y),
        (xt, yt),
        OptimizerSpec("sgd", lr=0.1, momentum=0.9),
        batch_size=128,
        target_accuracy=0.6,
    )


class _Unsqueeze(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.unsqueeze(1)


def mnist1d_cnn() -> Task:
    x, y, xt, yt = _mnist1d()

    def model() -> nn.Module:
        return nn.Sequential(
            _Unsqueeze(),
            nn.Conv1d(1, 32, 5, padding=2),
            nn.ReLU(),
            nn.Conv1d(32, 32, 3, padding=1, stride=2),
            nn.ReLU(),
            nn.Conv1d(32, 32, 3, padding=1, stride=2),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(32 * 10, 10),
        )

    return Task(
        model,
        nn.functional.cross_entropy,
        (x, y),
        (xt, yt),
        OptimizerSpec("sgd", lr=0.05, momentum=0.9),
        batch_size=128,
        target_accuracy=0.8,
    )


def digits_cnn() -> Task:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(x), generator=g)
    cut = int(0.8 * len(x))
    tr, te = perm[:cut], perm[cut:]

    def model() -> nn.Module:
        return nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(32 * 2 * 2, 10),
        )

    return Task(
        model,
        nn.functional.cross_entropy,
        (x[tr], y[tr]),
        (x[te], y[te]),
        OptimizerSpec("sgd", lr=0.1, momentum=0.9),
        batch_size=64,
        target_accuracy=0.9,
    )


_STDLIB_FILES = (
    "argparse.py",
    "textwrap.py",
    "string.py",
    "shutil.py",
    "random.py",
    "tempfile.py",
    "difflib.py",
    "fractions.py",
)


@functools.lru_cache(maxsize=1)
def _stdlib_text() -> str:
    """Source of a fixed set of stdlib modules: text that ships with every Python."""
    root = Path(sys.modules["os"].__file__ or "").parent
    parts = [
        (root / name).read_text(encoding="utf-8", errors="replace")
        for name in _STDLIB_FILES
        if (root / name).exists()
    ]
    return "\n".join(parts)


class CharTransformer(nn.Module):
    """A tiny causal transformer over characters."""

    mask: torch.Tensor

    def __init__(self, vocab: int, ctx: int, dim: int = 64, layers: int = 2, heads: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(ctx, dim))
        layer = nn.TransformerEncoderLayer(
            dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer(
            "mask", nn.Transformer.generate_square_subsequent_mask(ctx), persistent=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = self.embed(x) + self.pos[:t]
        h = self.blocks(h, mask=self.mask[:t, :t], is_causal=True)
        return self.head(h)


def _char_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def char_transformer(ctx: int = 32) -> Task:
    text = _stdlib_text()
    codes = torch.tensor(
        [min(max(ord(c) - 32, 0), 95) if c != "\n" else 95 for c in text], dtype=torch.long
    )  # printable ASCII + newline, 96 symbols
    n = (len(codes) - 1) // ctx
    xs = codes[: n * ctx].reshape(n, ctx)
    ys = codes[1 : n * ctx + 1].reshape(n, ctx)
    cut = int(0.9 * n)

    def model() -> nn.Module:
        return CharTransformer(96, ctx)

    return Task(
        model,
        _char_loss,
        (xs[:cut], ys[:cut]),
        (xs[cut:], ys[cut:]),
        OptimizerSpec("adam", lr=3e-3),
        batch_size=64,
        target_accuracy=0.4,
    )


def _gpt_stdlib() -> Task:
    from training.tasks_wan import gpt_stdlib  # the WAN-bound tasks build on this module

    return gpt_stdlib()


def _wide_mlp() -> Task:
    from training.tasks_wan import wide_mlp

    return wide_mlp()


BUILTIN: dict[str, Callable[[], Task]] = {
    "mnist1d-mlp": mnist1d_mlp,
    "mnist1d-cnn": mnist1d_cnn,
    "digits-cnn": digits_cnn,
    "char-transformer": char_transformer,
    "gpt-stdlib": _gpt_stdlib,
    "wide-mlp": _wide_mlp,
}


def check_entry(entry: str) -> None:
    """Validate an entrypoint string without importing it (ValueError says the fix)."""
    kind, sep, name = entry.partition(":")
    if not sep or not kind or not name:
        raise ValueError(f"task {entry!r}: write builtin:NAME or module:function")
    if kind == "builtin" and name not in BUILTIN:
        raise ValueError(
            f"task {entry!r}: unknown builtin; use one of "
            + ", ".join(f"builtin:{k}" for k in BUILTIN)
        )


def load_task(entry: str) -> Task:
    """Resolve `builtin:NAME` or `module:function` and call it.

    Runs in the workers only: the control plane checks an entrypoint's text and never imports
    it. ValueError (the job fails, no retry) when the module or function is missing, is not a
    function, or returns anything but a `Task`."""
    check_entry(entry)
    kind, _, name = entry.partition(":")
    if kind == "builtin":
        return BUILTIN[name]()
    try:
        fn = getattr(importlib.import_module(kind), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"task {entry!r} cannot be loaded: {exc}") from None
    if not callable(fn):
        raise ValueError(
            f"task {entry!r}: {name} is not a function (it is {type(fn).__name__}); name a "
            "function that takes no arguments and returns training.tasks.Task"
        )
    task = fn()
    if not isinstance(task, Task):
        raise ValueError(
            f"task {entry!r}: the function returned {type(task).__name__}, not "
            "training.tasks.Task; return a Task (model, loss, data, optimizer)"
        )
    return task
