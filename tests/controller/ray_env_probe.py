"""`python -m tests.controller.ray_env_probe DATABASE_URL`: start Ray as the launcher does
(`controller.loop.ray_run.RayConnection`) and print, as JSON, what a worker actor sees of its
environment: `os.environ`, its own initial environment and its parent's (the raylet's), as
/proc shows them to any process of the same user."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any


def initial_environ(pid: int | str) -> str:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    except OSError:
        return ""


class Probe:
    def look(self) -> dict[str, Any]:
        return {
            "environ": dict(os.environ),
            "own_initial": initial_environ("self"),
            "parent_initial": initial_environ(os.getppid()),
        }


def main(url: str) -> None:
    import ray

    from controller.loop.ray_run import LauncherConfig, RayConnection
    from controller.store.db import make_engine, make_sessionmaker
    from training import cluster_resource

    engine = make_engine(url)
    config = LauncherConfig(replica_id="probe", checkpoint_root=Path("."), ray_num_cpus=1)
    connection = RayConnection(make_sessionmaker(engine), config)
    try:
        assert connection.ensure({"probe": 1}, busy=False)
        driver = {k: v for k, v in os.environ.items() if k.startswith("CPN_")}
        actor: Any = ray.remote(Probe).options(
            num_cpus=0, resources={cluster_resource("probe"): 1.0}
        )
        worker = ray.get(actor.remote().look.remote(), timeout=120)
    finally:
        connection.shutdown()
        engine.dispose()
    print(json.dumps({"driver": driver, "worker": worker}))


if __name__ == "__main__":
    main(sys.argv[1])
