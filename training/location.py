"""Where checkpoints live, as text: a directory path or a URI (`file://`, `s3://bucket/prefix`,
any fsspec protocol). Kept free of torch and fsspec so the control plane can reason about a
checkpoint root without loading either."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlparse

LOCAL_SCHEMES = frozenset({"", "file"})


def scheme(uri: str | Path) -> str:
    """The URI scheme of `uri`, '' for a plain path (a Windows drive letter is a path)."""
    text = str(uri)
    if "://" not in text:
        return ""
    found = urlparse(text).scheme.lower()
    return "" if len(found) == 1 and os.name == "nt" else found


def is_object_store(uri: str | Path) -> bool:
    """True for a URI that is not a local (or mounted) directory: s3://, gs://, memory://..."""
    return scheme(uri) not in LOCAL_SCHEMES


def child(root: str | Path, name: str) -> str:
    """`name` under `root`: a path joined as a path, a URI joined with '/'."""
    if scheme(root):
        return str(root).rstrip("/") + "/" + name
    return str(Path(root) / name)


def absolute(root: str | Path) -> str:
    """`root` made independent of the working directory: a path resolved, a URI unchanged."""
    return str(root) if scheme(root) else str(Path(root).resolve())
