"""How a `cpn serve` process is set up: logging, the collector, a non-dumpable environment,
and `--workers N`, N API processes behind one listening socket.

One process is GIL-bound to one core; workers use the others. What a worker holds in memory
stays per worker: rate-limit buckets and event-stream slots (so a key may get up to N times
each limit from one server, as it may from N replicas), the key cache (revocations reach the
others within its check period, as they reach other replicas). Console sign-ins live in the
database. Counters and histograms are summed over the workers at each scrape
(prometheus_client's multiprocess mode), and the background loops run in the one worker that
`api.election` elects.
"""

from __future__ import annotations

import gc
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from api.config import Settings
from api.metrics import MULTIPROC_ENV

if TYPE_CHECKING:
    from fastapi import FastAPI

LOG_LEVEL_ENV = "CPN_SERVE_LOG_LEVEL"
"""How `cpn serve --workers` tells its worker processes its --log-level."""


def configure_logging(log_level: str) -> None:
    """cpn's own loggers (controller loop, launcher, lease monitor) at the same level as
    uvicorn's; uvicorn keeps its handlers and does not propagate, so nothing doubles."""
    level = log_level.upper()
    logging.basicConfig(
        level=level if level in logging.getLevelNamesMapping() else logging.DEBUG,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


GC_THRESHOLDS = (50_000, 20, 100)
"""The cyclic collector's thresholds in a serving process (Python's: 700, 10, 10)."""


def settle_collector() -> None:
    """Freeze what start-up built and collect generation 0 less often.

    A request allocates thousands of container objects (pydantic models, SQLAlchemy rows,
    ASGI scopes), so Python's default threshold ran a collection every request or two, and
    each older collection walked the app, its routes, schemas and mappers, which live as long
    as the process. Frozen, they are never walked again; with `GC_THRESHOLDS` a collection
    runs every few dozen requests, and the cyclic garbage held meanwhile stays small. It cut
    the heartbeat tail latency on both databases (measured: bench/results/api-throughput.md)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


PRIVATE_UMASK = 0o077
"""What `cpn serve` creates (the SQLite database and its side files, logs, checkpoints under
its root) is its owner's alone."""


def private_umask() -> None:
    os.umask(PRIVATE_UMASK)


def shield_environment() -> None:
    """Make this process non-dumpable: other processes of the same user (the embedded Ray's
    workers run tenant code) can then no longer read /proc/<pid>/environ, which holds the
    control plane's secrets. Root and CAP_SYS_PTRACE still can: use a separate Ray
    (CPN_RAY_ADDRESS) when tenants are not trusted."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_dumpable = 4
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_dumpable, 0, 0, 0, 0)


def serve(settings: Settings, host: str, port: int, log_level: str, workers: int) -> None:
    """Bind once, start `workers` processes on the socket (uvicorn's supervisor restarts any
    that die), and remove the workers' shared folder at exit."""
    import uvicorn

    folder = Path(tempfile.mkdtemp(prefix="cpn-serve-"))
    (folder / "metrics").mkdir()
    # Workers are spawned (not forked) and read their settings from the environment.
    os.environ[MULTIPROC_ENV] = str(folder / "metrics")
    os.environ["CPN_WORKERS_DIR"] = str(folder)
    os.environ["CPN_RUN_CONTROLLER"] = "true" if settings.run_controller else "false"
    try:
        uvicorn.run(
            "api.process:worker_app",
            factory=True,
            host=host,
            port=port,
            log_level=log_level,
            workers=workers,
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def worker_app() -> FastAPI:
    """One worker's app (uvicorn's factory, in the spawned process)."""
    from api.app import create_app

    configure_logging(os.environ.get(LOG_LEVEL_ENV, "info"))
    shield_environment()
    app = create_app(Settings())
    settle_collector()
    return app
