"""bench.cpu_caps: the CPU budgets `bench.replicas` gives replicas and PostgreSQL."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.cpu_caps import CPU_CGROUPS, CpuThrottle, cpu_cap, unavailable


def test_throttle_share_is_of_the_periods_run_between_two_readings() -> None:
    before, after = CpuThrottle(periods=100, throttled=10), CpuThrottle(periods=300, throttled=190)
    assert (after - before).share == pytest.approx(0.9)
    assert CpuThrottle(0, 0).share == 0.0  # never ran: not saturated
    # several caps together: the share of all their periods
    assert (CpuThrottle(100, 90) + CpuThrottle(300, 10)).share == pytest.approx(0.25)


def test_a_budget_below_nothing_is_refused() -> None:
    with pytest.raises(ValueError, match="cores must be > 0"), cpu_cap("zero", 0):
        pass


def _cgroup_of(pid: int) -> str:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            return path
    raise AssertionError(f"no cpu cgroup line for {pid}")


@pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))
def test_a_process_runs_in_its_budget_and_goes_back_when_it_ends() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with cpu_cap("test", 0.5) as cap:
            assert (cap.path / "cpu.cfs_quota_us").read_text().strip() == "50000"
            cap.add(child.pid)
            assert _cgroup_of(child.pid) == "/" + cap.path.name
            assert cap.throttle().throttled >= 0  # cpu.stat parses
        assert not cap.path.exists()
        assert _cgroup_of(child.pid) == "/"  # back in the root cgroup, still running
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()
    assert not any(p.name.startswith("cpn-bench-test-") for p in CPU_CGROUPS.iterdir())
