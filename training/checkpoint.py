"""Checkpoint stores: a small interface so other stores (object storage) can come later.

A checkpoint is one torch-serialised dict (model, optimizer, compressor states per cluster,
sync state, data position) written atomically as `step-NNNNNNNN.pt`; `latest()` finds the
newest complete one.

Checkpoints are data, never code: they are read with `torch.load(weights_only=True)`, and
`plain` makes what is saved loadable that way (tensors, dicts, lists, tuples, numbers,
strings). Each carries the identity of the run that wrote it (`run_id`, `epoch`);
`check_identity` refuses another run's file. A directory records its run in a `run-id` file
(`claim`), so `cpn train --resume` knows its own id without being told.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import tempfile
import uuid
from abc import ABC, abstractmethod
from enum import Enum
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import torch

_NAME = re.compile(r"^step-(\d{8})\.pt$")
ID_FILE = "run-id"
_RUN_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
FORMAT = 2
"""The checkpoint format: 2 is weights-only-loadable and carries `run_id` and `epoch`."""


class CheckpointRefused(ValueError):
    """A checkpoint this run must not (or cannot safely) read; the message says the fix."""


def plain(value: Any, where: str = "state") -> Any:
    """`value` as what `torch.load(weights_only=True)` reads back: tensors, containers of
    plain values, numbers, strings. numpy arrays and scalars become tensors and numbers,
    enums their values; anything else is a TypeError naming where it is."""
    import numpy as np

    if value is None or isinstance(value, bool | int | float | str | torch.Tensor):
        return value
    if isinstance(value, Enum):
        return plain(value.value, where)
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value.copy())
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, torch.Size | torch.dtype | torch.device):
        return value
    if isinstance(value, dict):
        return {plain(k, f"{where} key"): plain(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, list | tuple):
        items = [plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    raise TypeError(
        f"checkpoint {where}: a {type(value).__name__} cannot be saved; "
        "save tensors, numbers, strings and containers of them"
    )


def check_identity(state: dict[str, Any], run_id: str, epoch: int, where: str) -> None:
    """Refuse a checkpoint written by another run, by an older cpn, or by a newer attempt
    of this run (a stale run must not take over its successor's checkpoints)."""
    if state.get("version") != FORMAT or "run_id" not in state:
        raise CheckpointRefused(
            f"checkpoint {where}: written in an older format (version {state.get('version')!r})"
            " that cannot be read safely; restart without --resume (use an empty checkpoint "
            "directory)"
        )
    if state["run_id"] != run_id:
        raise CheckpointRefused(
            f"checkpoint {where}: written by run {state['run_id']!r}, not this run ({run_id!r}); "
            "a job resumes only from its own checkpoints: remove the file or use another "
            "directory"
        )
    if int(state.get("epoch", 0)) > epoch:
        raise CheckpointRefused(
            f"checkpoint {where}: written by a later attempt (epoch {state['epoch']}) than this "
            f"one ({epoch}); this run is stale and stops"
        )


class CheckpointStore(ABC):
    """Where checkpoints go. Implementations must make `save` atomic."""

    @abstractmethod
    def save(self, step: int, state: dict[str, Any]) -> None: ...

    @abstractmethod
    def steps(self) -> list[int]:
        """Steps with a complete checkpoint, ascending."""

    @abstractmethod
    def load(self, step: int) -> dict[str, Any]:
        """The checkpoint of `step`, read as data only; CheckpointRefused when it is not."""

    @abstractmethod
    def claim(self, run_id: str | None) -> str:
        """The run this store belongs to: recorded on first use (`run_id`, or a fresh id),
        CheckpointRefused when it belongs to another run."""

    @abstractmethod
    def where(self, step: int) -> str:
        """The checkpoint of `step`, named for error messages."""

    def latest(self) -> tuple[int, dict[str, Any]] | None:
        found = self.steps()
        return (found[-1], self.load(found[-1])) if found else None


class DirectoryStore(CheckpointStore):
    """Checkpoints as files in a local (or mounted shared) directory; keeps the newest `keep`."""

    def __init__(self, path: str | Path, keep: int = 3) -> None:
        self.path = Path(path)
        self.keep = keep

    def save(self, step: int, state: dict[str, Any]) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        buf = io.BytesIO()
        torch.save(plain(state), buf)
        fd, tmp = tempfile.mkstemp(dir=self.path, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(buf.getvalue())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path / f"step-{step:08d}.pt")
        for old in self.steps()[: -self.keep]:
            (self.path / f"step-{old:08d}.pt").unlink(missing_ok=True)

    def steps(self) -> list[int]:
        if not self.path.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.path.iterdir() if (m := _NAME.match(p.name)))

    def where(self, step: int) -> str:
        return str(self.path / f"step-{step:08d}.pt")

    def load(self, step: int) -> dict[str, Any]:
        path = self.where(step)
        try:
            state = torch.load(path, weights_only=True)
        except pickle.UnpicklingError as exc:  # objects that are not plain data: never run
            raise CheckpointRefused(
                f"checkpoint {path}: holds objects other than tensors and plain values (an "
                "older cpn's format, or not a checkpoint); it is not read. Restart without "
                "--resume (use an empty checkpoint directory)"
            ) from exc
        if not isinstance(state, dict):
            raise CheckpointRefused(f"checkpoint {path}: not a cpn checkpoint")
        return state

    def claim(self, run_id: str | None) -> str:
        if run_id is not None and not _RUN_ID.match(run_id):
            raise ValueError(f"run_id {run_id!r}: use 1-128 letters, digits, '.', '_', ':', '-'")
        id_file = self.path / ID_FILE
        if id_file.is_file():
            owner = id_file.read_text().strip()
            if run_id is not None and owner != run_id:
                raise CheckpointRefused(
                    f"checkpoint directory {self.path}: belongs to run {owner!r}, not {run_id!r};"
                    " use another directory"
                )
            return owner
        owner = run_id or uuid.uuid4().hex
        self.path.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path, prefix=".tmp-")
        with os.fdopen(fd, "w") as f:
            f.write(owner + "\n")
        os.replace(tmp, id_file)
        return owner


def open_store(uri: str) -> CheckpointStore:
    """A store for a plain path or a `file://` URI; ValueError names other schemes."""
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        return DirectoryStore(unquote(parsed.netloc + parsed.path))
    if parsed.scheme in ("",) or (len(parsed.scheme) == 1 and os.name == "nt"):
        return DirectoryStore(uri)
    raise ValueError(
        f"checkpoint {uri!r}: scheme {parsed.scheme!r} is not supported; "
        "use a directory path or a file:// URI"
    )
