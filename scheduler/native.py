"""The decision code compiled by mypyc, used when a build of exactly these sources is present.

The planner's search is pure Python over floats and tuples, and at 100 clusters it is what a
simulated job costs. mypyc compiles the same typed source to C: the same float operations in
the same order, so the same plans, bit for bit, in less time
(measured: bench/results/sim-summary.md).
`make compile` builds it into `scheduler/_native/`, stamped with a digest of every source of
`scheduler` and `grammar` and of the interpreter's ABI. A build whose digest does not match
the sources beside it is not used, so an edited source never runs stale compiled code.
`CPN_COMPILED=0` ignores any build (the test suite does: some of its tests look inside the
interpreted search); `CPN_COMPILED_DIR` names another build folder.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import MutableSequence
from pathlib import Path

MODULES = (
    "calibrate",
    "compression",
    "cost",
    "gpus",
    "memory",
    "optimizer",
    "pipeline_cost",
    "rules",
    "waiting",
)
"""What is compiled: the decisions. `types` stays interpreted (a snapshot copies itself
through its `__dict__`, which compiled classes do not have)."""

PACKAGE = Path(__file__).resolve().parent
DEFAULT_DIR = PACKAGE / "_native"
MANIFEST = "manifest.json"


def _grammar_dir() -> Path:
    spec = importlib.util.find_spec("grammar")
    assert spec is not None and spec.origin is not None, "grammar is part of cpn"
    return Path(spec.origin).resolve().parent


def digest(package: Path = PACKAGE, grammar: Path | None = None) -> str:
    """What a build is of: every source it may have compiled against, and the ABI."""
    h = hashlib.sha256()
    h.update(f"{sys.implementation.cache_tag} {sysconfig.get_config_var('SOABI')}".encode())
    for root in (package, grammar or _grammar_dir()):
        for path in sorted(root.rglob("*.py")):
            if "_native" in path.parts or "__pycache__" in path.parts:
                continue
            h.update(f"{root.name}/{path.relative_to(root).as_posix()}\0".encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def build_dir() -> Path:
    return Path(os.environ.get("CPN_COMPILED_DIR") or DEFAULT_DIR)


def enable(package_path: MutableSequence[str]) -> bool:
    """Put a current build ahead of the sources on the package's path; False (and nothing
    changed) when there is none, it is stale, or `CPN_COMPILED=0`."""
    if os.environ.get("CPN_COMPILED", "1") == "0":
        return False
    where = build_dir()
    try:
        manifest = json.loads((where / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(manifest, dict) or manifest.get("digest") != digest():
        return False
    package_path.insert(0, str(where / "scheduler"))
    # the modules' shared runtime, imported by its own top-level name
    sys.path.append(str(where / "lib"))
    return True


def build(out: Path | None = None) -> Path:
    """Compile MODULES with mypyc into `out` (default `build_dir()`); needs mypy (the dev
    extra) and a C compiler. Compiles a copy, so the source tree gets no build files."""
    out = out or build_dir()
    grammar = _grammar_dir()
    stamp = digest(PACKAGE, grammar)
    skip = shutil.ignore_patterns("_native", "__pycache__", "*.so")
    with tempfile.TemporaryDirectory(prefix="cpn-mypyc-") as tmp:
        root = Path(tmp)
        shutil.copytree(PACKAGE, root / "scheduler", ignore=skip)
        shutil.copytree(grammar, root / "grammar", ignore=skip)
        if digest(root / "scheduler", root / "grammar") != stamp:
            raise RuntimeError("the sources changed while they were copied: run it again")
        done = subprocess.run(
            [sys.executable, "-m", "mypyc", *(f"scheduler/{m}.py" for m in MODULES)],
            cwd=root,
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise RuntimeError(f"mypyc failed:\n{done.stdout[-4000:]}{done.stderr[-4000:]}")
        staged = out.with_name(out.name + ".new")
        shutil.rmtree(staged, ignore_errors=True)
        (staged / "scheduler").mkdir(parents=True)
        (staged / "lib").mkdir()
        for name in MODULES:
            (so,) = (root / "scheduler").glob(f"{name}.*.so")
            shutil.move(so, staged / "scheduler" / so.name)
        for so in root.glob("*.so"):  # the shared runtime of the group
            shutil.move(so, staged / "lib" / so.name)
        (staged / MANIFEST).write_text(json.dumps({"digest": stamp, "modules": MODULES}))
    shutil.rmtree(out, ignore_errors=True)
    staged.rename(out)
    return out
