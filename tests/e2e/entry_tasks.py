"""User entrypoints that are not what a job needs, and one that reports what a worker sees.

Allowed by the end-to-end worlds' CPN_TASK_MODULES=tests.e2e; workers import them, never the
control plane."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

NOT_A_FUNCTION = 3


def not_a_task() -> int:
    return 42


def look_around() -> None:
    """Fail with what this worker can see of the control plane's secrets (as a tenant's code
    would leak them: through its error, which the tenant reads in the job's events)."""
    token = os.environ.get("CPN_ADMIN_TOKEN")
    database = os.environ.get("CPN_DATABASE_URL")
    try:
        parent = Path(f"/proc/{os.getppid()}/environ").read_bytes()
    except OSError:
        parent = b""
    raise ValueError(
        f"admin token {'visible: ' + token if token else 'absent'}; "
        f"database url {'visible: ' + database if database else 'absent'}; "
        f"parent environment {'has' if b'CPN_ADMIN_TOKEN=' in parent else 'lacks'} the token"
    )


def chatty() -> Any:
    """The built-in MLP task, saying so on stdout and on stderr as it loads (a job's log)."""
    import sys

    from training.tasks import load_task

    print(f"chatty: loaded in pid {os.getpid()}")
    print("chatty: a line on stderr", file=sys.stderr)
    return load_task("builtin:mnist1d-mlp")
