"""Named fault-injection points, in the manner of etcd's gofail and FreeBSD's fail(9).

`failpoint("settle.after_usage")` marks a place in the code where a crash must leave the books
consistent. It does nothing unless `CPN_FAILPOINTS` (comma-separated names, read once when
this module is imported) names it; then it writes the marker file
`$CPN_FAILPOINT_DIR/<name>` (the process id in it) and blocks the calling thread forever, so a
test that waits for the marker can SIGKILL the process exactly there. Unarmed, it costs one
lookup in an empty frozenset.

The points (grep for `failpoints.failpoint(` to find them):

- `settle.after_usage`: a finished run's settlement has released its GPUs, metered its usage
  and written its ledger entries and its new state, but has not committed.
- `place.before_commit`: a placement has reserved a job's GPUs and made it SCHEDULED, but has
  not committed.
- `place.after_commit`: a placement committed; the job has not been launched.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

ENV = "CPN_FAILPOINTS"
DIR_ENV = "CPN_FAILPOINT_DIR"

log = logging.getLogger("cpn.failpoints")


def _armed(value: str) -> frozenset[str]:
    return frozenset(name.strip() for name in value.split(",") if name.strip())


ARMED: frozenset[str] = _armed(os.environ.get(ENV, ""))
"""The points armed in this process, fixed at import."""


def failpoint(name: str) -> None:
    """Nothing, unless `name` is armed: then mark it reached and block this thread forever."""
    if name in ARMED:
        _reached(name)


def _reached(name: str) -> None:
    directory = Path(os.environ.get(DIR_ENV) or ".")
    directory.mkdir(parents=True, exist_ok=True)
    partial = directory / f".{name}.{os.getpid()}"
    partial.write_text(f"{os.getpid()}\n")
    partial.replace(directory / name)  # the marker appears whole, never half-written
    log.warning("failpoint %s reached in pid %d: blocking until killed", name, os.getpid())
    threading.Event().wait()
