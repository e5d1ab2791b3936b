"""The task interface for user code, and the built-in tasks (no downloads).

A job names an entrypoint `module:function` (or `builtin:NAME`). The function takes no
arguments and returns a `Task`: a model factory, a loss, training and evaluation data (a pair
of tensors or a map-style dataset of (x, y) items) and optimizer settings. The runtime seeds
torch before calling the model factory, so every worker starts from the same weights, and
shards each global batch across workers by their batch share.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from training.tasks.base import (
    Data,
    Evaluation,
    OptimizerSpec,
    Task,
    accuracy,
    as_tensors,
    evaluate,
)
from training.tasks.builtin import (
    CharTransformer,
    char_gpt,
    char_transformer,
    digits_cnn,
    mnist1d_cnn,
    mnist1d_mlp,
)
from training.tasks.wan import gpt_stdlib, wide_mlp

__all__ = [
    "BUILTIN",
    "CharTransformer",
    "Data",
    "Evaluation",
    "OptimizerSpec",
    "Task",
    "accuracy",
    "as_tensors",
    "check_entry",
    "evaluate",
    "load_task",
]

BUILTIN: dict[str, Callable[[], Task]] = {
    "mnist1d-mlp": mnist1d_mlp,
    "mnist1d-cnn": mnist1d_cnn,
    "digits-cnn": digits_cnn,
    "char-transformer": char_transformer,
    "char-gpt": char_gpt,
    "gpt-stdlib": gpt_stdlib,
    "wide-mlp": wide_mlp,
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
