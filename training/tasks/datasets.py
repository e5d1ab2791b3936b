"""The built-in tasks' data: generated or shipped with Python, never downloaded."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import torch


def _cache_dir() -> Path | None:
    """Where generated data is kept across processes: CPN_CACHE_DIR, else the XDG cache."""
    if root := os.environ.get("CPN_CACHE_DIR"):
        return Path(root)
    try:
        return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cpn"
    except RuntimeError:  # no home directory (a bare container user): no cache
        return None


@functools.lru_cache(maxsize=2)
def mnist1d_split(seed: int = 42) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
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
def stdlib_text() -> str:
    """Source of a fixed set of stdlib modules: text that ships with every Python."""
    root = Path(sys.modules["os"].__file__ or "").parent
    parts = [
        (root / name).read_text(encoding="utf-8", errors="replace")
        for name in _STDLIB_FILES
        if (root / name).exists()
    ]
    return "\n".join(parts)
