"""A cluster's state, as every layer names it: the control plane stores it, the scheduler plans
around it, the API and the console show it.

PENDING until its agent's first heartbeat; READY while heartbeats arrive; SUSPECT after a few
missed ones (it keeps its work, takes new work still); DOWN once its lease's grace expired.
"""

from __future__ import annotations

from enum import StrEnum


class ClusterState(StrEnum):
    PENDING = "PENDING"
    READY = "READY"
    SUSPECT = "SUSPECT"
    DOWN = "DOWN"


LIVE = (ClusterState.READY, ClusterState.SUSPECT)
"""The states of a cluster whose agent holds a lease: it runs work and is offered new work."""
