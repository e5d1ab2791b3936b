"""Checkpoint stores: a directory (local or a shared mount) or an object store via fsspec.

A checkpoint is one torch-serialised dict (model, optimizer, compressor states per cluster,
sync state, data position) written atomically as `step-NNNNNNNN.pt`; `latest()` finds the
newest complete one. A cluster's own part may be written beside it, from that cluster, as
`step-NNNNNNNN.<cluster>.pt` (`save_part`): the checkpoint names its parts and `load` merges
them, so a cluster's optimizer and compressor state never crosses the WAN to be saved. Parts
are written first and the checkpoint last, so a checkpoint that exists is whole.
`open_store(uri)` picks the store: a path or `file://` is a
`DirectoryStore`, `s3://bucket/prefix` (or any other installed fsspec protocol) an
`ObjectStore`. Both keep the same names under their root, so the rules below are written once.

Checkpoints are data, never code: they are read with `torch.load(weights_only=True)`, and
`plain` makes what is saved loadable that way (tensors, dicts, lists, tuples, numbers,
strings). Each carries the identity of the run that wrote it (`run_id`, `epoch`);
`check_identity` refuses another run's file. A directory records its run in a `run-id` file
(`claim`), so `cpn train --resume` knows its own id without being told.

Fencing: a store records in a `fence` file the highest run epoch that has started on it
(`fence`, called by the driver at start); `save` refuses a state of a lower epoch (`StaleRun`),
so a run whose job was adopted and relaunched elsewhere cannot overwrite its successor's
checkpoints. The check reads the fence before each write: on stores without conditional
writes a write already under way when the successor starts can still land (one at most).
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import re
import tempfile
import uuid
from abc import ABC, abstractmethod
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

import torch

from training.location import scheme

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

_NAME = re.compile(r"^step-(\d{8})\.pt$")
_PART = re.compile(r"^step-(\d{8})\.([a-z0-9][a-z0-9._-]{0,62})\.pt$")
PARTS = "parts"
"""The key of a checkpoint listing the clusters whose parts were written beside it."""
BEST_FILE = "best.pt"
"""The model of the run's best evaluation (`save_best`): the job's artefact unless its spec
asks for the last checkpoint. Never pruned with the step checkpoints."""
ID_FILE = "run-id"
FENCE_FILE = "fence"
_RUN_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
FORMAT = 2
"""The checkpoint format: 2 is weights-only-loadable and carries `run_id` and `epoch`."""


class CheckpointRefused(ValueError):
    """A checkpoint this run must not (or cannot safely) read; the message says the fix."""


class StaleRun(CheckpointRefused):
    """A later attempt of this run has started on the store: this one must stop writing."""


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


def fence_verdict(recorded: int | None, epoch: int) -> bool:
    """Whether a run of `epoch` may go on where `recorded` is the highest epoch started."""
    return recorded is None or recorded <= epoch


def _state_epoch(state: dict[str, Any]) -> int:
    return int(state.get("epoch", 0) or 0)


class CheckpointStore(ABC):
    """Where checkpoints go: the rules (naming, keeping, fencing, claiming, reading as data)
    over four primitives a store implements on named blobs under its root; `_write` must be
    atomic (a reader sees the old blob or the whole new one)."""

    keep: int
    kind = "location"
    """What the root is called in messages ("directory", "location")."""

    @abstractmethod
    def _read(self, name: str) -> bytes | None:
        """The blob `name`, None when there is none."""

    @abstractmethod
    def _write(self, name: str, data: bytes) -> None:
        """Write `name` atomically, creating the root when needed."""

    @abstractmethod
    def _names(self) -> list[str]:
        """Names of the blobs under the root ([] when it does not exist yet)."""

    @abstractmethod
    def _remove(self, name: str) -> None: ...

    @abstractmethod
    def _where(self, name: str) -> str:
        """The blob `name`, named for error messages."""

    @property
    @abstractmethod
    def root(self) -> str:
        """The root, named for error messages."""

    def prepare(self) -> None:  # noqa: B027 (a no-op unless the store needs one)
        """Make the root usable before a run starts (a directory is created); a no-op where
        roots need no creating (object stores)."""

    def where(self, step: int) -> str:
        """The checkpoint of `step`, named for error messages."""
        return self._where(f"step-{step:08d}.pt")

    def steps(self) -> list[int]:
        """Steps with a complete checkpoint, ascending."""
        return sorted(int(m.group(1)) for n in self._names() if (m := _NAME.match(n)))

    def fenced_epoch(self) -> int | None:
        """The highest run epoch that has started on this store (None: none recorded)."""
        data = self._read(FENCE_FILE)
        return int(data.decode().strip()) if data is not None else None

    def check_fence(self, epoch: int) -> int | None:
        """The recorded fence; StaleRun when a run of a later epoch than `epoch` has started
        on this store."""
        recorded = self.fenced_epoch()
        if not fence_verdict(recorded, epoch):
            raise StaleRun(
                f"checkpoint {self.kind} {self.root}: attempt {recorded} of this run has started"
                f" here, this is attempt {epoch}; this run is stale and stops"
            )
        return recorded

    def fence(self, epoch: int) -> None:
        """Record that a run of `epoch` starts here (monotonic); StaleRun when a later one
        already has."""
        if self.check_fence(epoch) != epoch:
            self._write(FENCE_FILE, f"{epoch}\n".encode())

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Write the checkpoint of `step` atomically, then drop all but the newest `keep`;
        StaleRun (nothing written) when the fence is past the state's epoch."""
        self.check_fence(_state_epoch(state))
        buf = io.BytesIO()
        torch.save(plain(state), buf)
        self._write(f"step-{step:08d}.pt", buf.getvalue())
        oldest = self.steps()[-self.keep :][0]  # a newer step's parts may be on their way
        for name in self._names():
            m = _NAME.match(name) or _PART.match(name)
            if m and int(m.group(1)) < oldest:
                self._remove(name)

    def save_part(self, step: int, cluster: str, epoch: int, part: dict[str, Any]) -> None:
        """Write `cluster`'s part of the checkpoint of `step` (before the checkpoint itself,
        which lists it under `parts`); StaleRun (nothing written) when the fence is past
        `epoch`."""
        if not _PART.match(f"step-{step:08d}.{cluster}.pt"):
            raise ValueError(f"cluster {cluster!r}: not a name a checkpoint part can carry")
        self.check_fence(epoch)
        buf = io.BytesIO()
        torch.save(plain(part), buf)
        self._write(f"step-{step:08d}.{cluster}.pt", buf.getvalue())

    def save_best(self, state: dict[str, Any]) -> None:
        """Write the best evaluation's model atomically over the previous best; StaleRun
        (nothing written) when the fence is past the state's epoch."""
        self.check_fence(_state_epoch(state))
        buf = io.BytesIO()
        torch.save(plain(state), buf)
        self._write(BEST_FILE, buf.getvalue())

    def where_best(self) -> str:
        return self._where(BEST_FILE)

    def best(self) -> dict[str, Any] | None:
        """The best evaluation's file, read as data only (None: none written yet)."""
        if BEST_FILE not in self._names():
            return None
        return self._load(BEST_FILE, self.where_best())

    def load(self, step: int) -> dict[str, Any]:
        """The checkpoint of `step` with its clusters' parts merged in, read as data only;
        CheckpointRefused when it is not."""
        state = self._load(f"step-{step:08d}.pt", self.where(step))
        for cluster in state.pop(PARTS, None) or []:
            name = f"step-{step:08d}.{cluster}.pt"
            state.setdefault("clusters", {})[cluster] = self._load(name, self._where(name))
        return state

    def _load(self, name: str, where: str) -> dict[str, Any]:
        data = self._read(name)
        if data is None:
            raise CheckpointRefused(f"checkpoint {where}: gone (removed while this run read it)")
        try:
            state = torch.load(io.BytesIO(data), weights_only=True)
        except pickle.UnpicklingError as exc:  # objects that are not plain data: never run
            raise CheckpointRefused(
                f"checkpoint {where}: holds objects other than tensors and plain values (an "
                "older cpn's format, or not a checkpoint); it is not read. Restart without "
                f"--resume (use an empty checkpoint {self.kind})"
            ) from exc
        if not isinstance(state, dict):
            raise CheckpointRefused(f"checkpoint {where}: not a cpn checkpoint")
        return state

    def claim(self, run_id: str | None) -> str:
        """The run this store belongs to: recorded on first use (`run_id`, or a fresh id),
        CheckpointRefused when it belongs to another run."""
        if run_id is not None and not _RUN_ID.match(run_id):
            raise ValueError(f"run_id {run_id!r}: use 1-128 letters, digits, '.', '_', ':', '-'")
        data = self._read(ID_FILE)
        if data is not None:
            owner = data.decode().strip()
            if run_id is not None and owner != run_id:
                raise CheckpointRefused(
                    f"checkpoint {self.kind} {self.root}: belongs to run {owner!r}, not "
                    f"{run_id!r}; use another {self.kind}"
                )
            return owner
        owner = run_id or uuid.uuid4().hex
        self._write(ID_FILE, (owner + "\n").encode())
        return owner

    def latest(self) -> tuple[int, dict[str, Any]] | None:
        found = self.steps()
        return (found[-1], self.load(found[-1])) if found else None


class DirectoryStore(CheckpointStore):
    """Checkpoints as files in a local (or mounted shared) directory; keeps the newest `keep`.
    Writes go to a temporary file, fsynced, then renamed over the name."""

    kind = "directory"

    def __init__(self, path: str | Path, keep: int = 3) -> None:
        self.path = Path(path)
        self.keep = keep

    @property
    def root(self) -> str:
        return str(self.path)

    def prepare(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)

    def _read(self, name: str) -> bytes | None:
        try:
            return (self.path / name).read_bytes()
        except FileNotFoundError:
            return None

    def _write(self, name: str, data: bytes) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path / name)

    def _names(self) -> list[str]:
        return [p.name for p in self.path.iterdir()] if self.path.is_dir() else []

    def _remove(self, name: str) -> None:
        (self.path / name).unlink(missing_ok=True)

    def _where(self, name: str) -> str:
        return str(self.path / name)


ATOMIC_PUT = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"})
"""Object stores where writing one object is atomic (a reader never sees part of it)."""


class ObjectStore(CheckpointStore):
    """Checkpoints as objects under `uri` (`s3://bucket/prefix`, any fsspec protocol), for a
    store every datacenter's workers reach. One object written is atomic on object stores;
    elsewhere a temporary name is written and moved. S3 reads its endpoint and credentials
    from the standard environment (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
    AWS_REGION, or botocore's other sources); the bucket must exist."""

    def __init__(self, uri: str, keep: int = 3) -> None:
        self.uri = uri.rstrip("/")
        self.fs, path = _filesystem(self.uri)
        self.base = path.rstrip("/")
        self.keep = keep
        protocols = self.fs.protocol
        names = {protocols} if isinstance(protocols, str) else set(protocols)
        self.atomic = bool(names & ATOMIC_PUT)

    @property
    def root(self) -> str:
        return self.uri

    def _key(self, name: str) -> str:
        return f"{self.base}/{name}"

    def _read(self, name: str) -> bytes | None:
        try:
            data: bytes = self.fs.cat_file(self._key(name))
        except FileNotFoundError:
            return None
        return data

    def _write(self, name: str, data: bytes) -> None:
        if self.atomic:
            self.fs.pipe_file(self._key(name), data)
            return
        self.fs.makedirs(self.base, exist_ok=True)
        tmp = self._key(f".tmp-{uuid.uuid4().hex}")
        self.fs.pipe_file(tmp, data)
        self.fs.mv(tmp, self._key(name))

    def _names(self) -> list[str]:
        self.fs.invalidate_cache(self.base)  # another process may have written since
        try:
            found = self.fs.ls(self.base, detail=False)
        except FileNotFoundError:
            return []
        return [str(p).rstrip("/").rsplit("/", 1)[-1] for p in found]

    def _remove(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._key(name))

    def _where(self, name: str) -> str:
        return f"{self.uri}/{name}"


def _filesystem(uri: str) -> tuple[AbstractFileSystem, str]:
    """The fsspec filesystem of `uri` and the path in it; ValueError naming the URI when the
    protocol is unknown or its package is not installed."""
    try:
        from fsspec.core import url_to_fs
    except ImportError as exc:
        raise ValueError(
            f"checkpoint {uri!r}: object stores need fsspec (pip install 'cpn[s3]')"
        ) from exc
    try:
        fs, path = url_to_fs(uri)
    except ImportError as exc:
        raise ValueError(
            f"checkpoint {uri!r}: the package for {scheme(uri)}:// is not installed ({exc}); "
            "for s3:// pip install 'cpn[s3]'"
        ) from exc
    except ValueError as exc:
        raise ValueError(
            f"checkpoint {uri!r}: scheme {scheme(uri)!r} is not supported ({exc}); use a "
            "directory path, a file:// URI or an object store such as s3://bucket/prefix"
        ) from exc
    return fs, str(path)


def open_store(uri: str) -> CheckpointStore:
    """A `DirectoryStore` for a plain path or a `file://` URI, an `ObjectStore` for any other
    fsspec URI (s3://bucket/prefix); ValueError names a scheme that cannot be opened."""
    found = scheme(uri)
    if found == "file":
        parsed = urlparse(uri)
        return DirectoryStore(unquote(parsed.netloc + parsed.path))
    if not found:
        return DirectoryStore(uri)
    return ObjectStore(uri)
