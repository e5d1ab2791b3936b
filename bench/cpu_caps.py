"""CPU budgets for benchmark processes: a cgroup of the `cpu` controller (v1, as on this
machine) whose processes together get at most `cores` of CPU time (CFS quota).

On a machine with fewer cores than a benchmark has processes, every curve shows the cores:
`bench.replicas` gives each replica and PostgreSQL a fixed budget of their own instead, so
adding a replica adds CPU as adding a machine would, and PostgreSQL saturates at its own
budget, not when the machine does. Needs root and a writable /sys/fs/cgroup/cpu.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

CPU_CGROUPS = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000


def unavailable() -> str | None:
    """Why CPU budgets cannot be set here, or None."""
    if not (CPU_CGROUPS / "cpu.cfs_quota_us").exists():
        return f"no cgroup v1 cpu controller at {CPU_CGROUPS} (CPU budgets need one)"
    if not os.access(CPU_CGROUPS, os.W_OK):
        return f"{CPU_CGROUPS} is not writable: run as root for CPU budgets"
    return None


@dataclass(frozen=True)
class CpuThrottle:
    """What a cgroup's budget did: CFS periods it ran in, and in how many it hit its quota."""

    periods: int
    throttled: int

    @property
    def share(self) -> float:
        """Of the periods it ran in, the share it wanted more CPU than its budget: near 1, it
        is saturated."""
        return self.throttled / self.periods if self.periods else 0.0

    def __add__(self, other: CpuThrottle) -> CpuThrottle:
        return CpuThrottle(self.periods + other.periods, self.throttled + other.throttled)

    def __sub__(self, other: CpuThrottle) -> CpuThrottle:
        return CpuThrottle(self.periods - other.periods, self.throttled - other.throttled)


def total_throttle(caps: Sequence[CpuCap]) -> CpuThrottle:
    """The periods and throttled periods of `caps` together."""
    return sum((cap.throttle() for cap in caps), CpuThrottle(0, 0))


@dataclass(frozen=True)
class CpuCap:
    """A cgroup `cpu_cap` made: its folder, and the cores its processes share."""

    path: Path
    cores: float

    def add(self, pid: int) -> None:
        """Move process `pid` (all its threads; children it forks later follow it)."""
        (self.path / "cgroup.procs").write_text(f"{pid}\n")

    def throttle(self) -> CpuThrottle:
        stat = dict(
            line.split() for line in (self.path / "cpu.stat").read_text().splitlines() if line
        )
        return CpuThrottle(int(stat["nr_periods"]), int(stat["nr_throttled"]))


@contextlib.contextmanager
def cpu_cap(name: str, cores: float) -> Iterator[CpuCap]:
    """A new cgroup limited to `cores` of CPU time; its processes go back to the root cgroup
    and it is removed afterwards."""
    if cores <= 0:
        raise ValueError(f"cores must be > 0, not {cores}")
    why = unavailable()
    if why is not None:
        raise RuntimeError(why)
    path = CPU_CGROUPS / f"cpn-bench-{name}-{uuid.uuid4().hex[:6]}"
    path.mkdir()
    try:
        (path / "cpu.cfs_period_us").write_text(f"{PERIOD_US}\n")
        (path / "cpu.cfs_quota_us").write_text(f"{max(1000, round(cores * PERIOD_US))}\n")
        yield CpuCap(path, cores)
    finally:
        for pid in (path / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):  # gone meanwhile
                (CPU_CGROUPS / "cgroup.procs").write_text(f"{pid}\n")
        with contextlib.suppress(OSError):
            path.rmdir()
