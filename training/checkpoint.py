"""Checkpoint stores: a small interface so other stores (object storage) can come later.

A checkpoint is one torch-serialised dict (model, optimizer, compressor states per cluster,
sync state, data position) written atomically as `step-NNNNNNNN.pt`; `latest()` finds the
newest complete one.
"""

from __future__ import annotations

import io
import os
import re
import tempfile
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import torch

_NAME = re.compile(r"^step-(\d{8})\.pt$")


class CheckpointStore(ABC):
    """Where checkpoints go. Implementations must make `save` atomic."""

    @abstractmethod
    def save(self, step: int, state: dict[str, Any]) -> None: ...

    @abstractmethod
    def steps(self) -> list[int]:
        """Steps with a complete checkpoint, ascending."""

    @abstractmethod
    def load(self, step: int) -> dict[str, Any]: ...

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
        torch.save(state, buf)
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

    def load(self, step: int) -> dict[str, Any]:
        state: dict[str, Any] = torch.load(self.path / f"step-{step:08d}.pt", weights_only=False)
        return state


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
