"""A WAN testbed on one host: one network namespace per datacenter, each joined to a hub bridge
by a veth uplink shaped with `tc tbf` in both directions, and one Ray node per namespace that
carries that datacenter's custom resource (`cpn-cluster-<name>`). The Ray head (and drivers:
`run_in_hub`) live in the hub namespace, so every byte between datacenters crosses two shaped
uplinks and shows on their interface counters.

`up(layout)`, `down()` (idempotent; finds crash leftovers by the `cpntb` prefix), `status()`;
`Testbed.set_rate` changes one datacenter's uplink mid-run (a WAN that degrades and recovers).
Part of the installed package (stdlib only, no other cpn package), so `cpn testbed` works from a
wheel or the image; `bench/` and `tests/` import it from here.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from testbed import net
from testbed.layout import (
    HUB_IP,
    HUB_NS,
    PREFIX,
    RAY_PORT,
    UPLINK_IF,
    Datacenter,
    Layout,
    parse_dcs,
)
from testbed.net import TestbedError, check_host

__all__ = [
    "HUB_NS",
    "PREFIX",
    "STATE_DIR",
    "UPLINK_IF",
    "Datacenter",
    "Layout",
    "Testbed",
    "TestbedError",
    "check_host",
    "down",
    "load",
    "parse_dcs",
    "status",
    "up",
]

# One state directory per prefix: a second testbed (CPN_TESTBED_PREFIX) must not share it.
_DEFAULT_DIR = "/tmp/cpn-testbed" + ("" if PREFIX == "cpntb" else f"-{PREFIX}")
STATE_DIR = Path(os.environ.get("CPN_TESTBED_DIR", _DEFAULT_DIR))
RAY_START_TIMEOUT_S = 120.0


@dataclass
class Testbed:
    """A running testbed as recorded in its state file."""

    __test__ = False  # not a pytest class

    datacenters: list[dict[str, Any]]
    ray_address: str
    token: str
    gloo_ifname: str = UPLINK_IF

    def env(self) -> dict[str, str]:
        """Environment for a process that joins the testbed's Ray (drivers, `cpn train`)."""
        return {
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": self.token,
            "RAY_USAGE_STATS_ENABLED": "0",
            "CPN_RAY_ADDRESS": self.ray_address,
            "CPN_GLOO_IFNAME": self.gloo_ifname,
        }

    def hub_argv(self, argv: list[str]) -> list[str]:
        """Wrap a command so it runs in the hub namespace (where a Ray driver must live)."""
        return ["ip", "netns", "exec", HUB_NS, *argv]

    def run_in_hub(
        self, argv: list[str], timeout: float, **kw: Any
    ) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, **self.env()}
        return subprocess.run(
            self.hub_argv(argv), env=env, capture_output=True, text=True, timeout=timeout, **kw
        )

    def uplink_bytes(self) -> dict[str, tuple[int, int]]:
        """{datacenter: (bytes out of it, bytes into it)} from its uplink's counters."""
        return {d["name"]: net.counters(d["netns"]) for d in self.datacenters}

    def datacenter(self, name: str) -> Datacenter:
        """The recorded datacenter `name` (KeyError names the ones there are)."""
        for d in self.datacenters:
            if d["name"] == name:
                return Datacenter(d["name"], int(d["index"]), float(d["mbit"]), int(d["workers"]))
        known = ", ".join(d["name"] for d in self.datacenters)
        raise KeyError(f"no datacenter {name!r} on this testbed (it has {known})")

    def set_rate(self, name: str, mbit: float) -> None:
        """Change datacenter `name`'s uplink to `mbit` in both directions on the running testbed
        (`tc qdisc change` on its side and on the hub's), as root from any namespace (a driver
        in the hub too). The recorded rate follows, here and in the state file when this is
        the testbed recorded there, so `status()` shows the rate now, not the one at `up`."""
        if not mbit > 0:
            raise ValueError(f"uplink rate must be > 0 Mbit/s, not {mbit}")
        dc = self.datacenter(name)
        net.reshape(dc.netns, UPLINK_IF, mbit)  # out of the datacenter
        net.reshape(HUB_NS, dc.hub_if, mbit)  # into it
        for d in self.datacenters:
            if d["name"] == name:
                d["mbit"] = float(mbit)
        recorded = load()
        if recorded is not None and recorded.token == self.token:
            _save(self)

    def kill_node(self, name: str) -> int:
        """Datacenter `name` loses power: SIGTERM then SIGKILL to every process in its namespace
        (its Ray node and the workers on it). Returns how many would not die (0 normally)."""
        return net.kill_ns_processes(self.datacenter(name).netns)

    def start_node(self, name: str, timeout: float = RAY_START_TIMEOUT_S) -> None:
        """Start datacenter `name`'s Ray node again (after `kill_node`) and wait until the head
        sees every datacenter's node alive."""
        dc = self.datacenter(name)
        res = json.dumps({f"cpn-cluster-{dc.name}": dc.workers})
        args = ["--address", self.ray_address, "--node-ip-address", dc.ip, "--resources", res]
        _ray_start(dc.netns, args, self.token)
        _wait_nodes(self, 1 + len(self.datacenters), timeout)

    def cut(self, name: str) -> None:
        """Cut datacenter `name`'s uplink: every packet in or out of it is dropped."""
        dc = self.datacenter(name)
        net.cut(dc.netns, UPLINK_IF)  # out of the datacenter
        net.cut(HUB_NS, dc.hub_if)  # into it

    def mend(self, name: str) -> None:
        """Carry packets on datacenter `name`'s uplink again at its rate (after `cut`)."""
        dc = self.datacenter(name)
        net.shape(dc.netns, UPLINK_IF, dc.mbit)
        net.shape(HUB_NS, dc.hub_if, dc.mbit)


def _state_file() -> Path:
    return STATE_DIR / "state.json"


def _save(bed: Testbed) -> None:
    """Write the state file whole (a reader never sees half of it), readable by root only."""
    tmp = _state_file().with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(bed), f)
    tmp.replace(_state_file())


def load() -> Testbed | None:
    try:
        return Testbed(**json.loads(_state_file().read_text()))
    except (OSError, ValueError, TypeError):
        return None


def _ray_bin() -> str:
    here = Path(sys.executable).parent / "ray"
    return str(here) if here.exists() else (shutil.which("ray") or "ray")


def _ray_env(token: str) -> dict[str, str]:
    return {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": token,
        "RAY_USAGE_STATS_ENABLED": "0",
    }


def _ray_start(ns: str, args: list[str], token: str) -> None:
    argv = ["ip", "netns", "exec", ns, _ray_bin(), "start", *args]
    argv += ["--num-cpus", "0", "--object-store-memory", str(100 * 1024 * 1024)]
    argv += ["--disable-usage-stats"]
    res = subprocess.run(
        argv, env=_ray_env(token), capture_output=True, text=True, timeout=RAY_START_TIMEOUT_S
    )
    if res.returncode != 0:
        tail = (res.stderr or res.stdout).strip().splitlines()
        raise TestbedError(f"ray start in {ns} failed: {tail[-1] if tail else res.returncode}")


def _wait_nodes(bed: Testbed, n: int, timeout: float) -> None:
    """Wait until the head sees `n` alive nodes (head + one per datacenter)."""
    code = (
        "import ray,sys;ray.init(address=sys.argv[1],log_to_driver=False);"
        "print(sum(1 for x in ray.nodes() if x['Alive']))"
    )
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        res = bed.run_in_hub([sys.executable, "-c", code, bed.ray_address], timeout=60)
        last = (res.stdout.strip().splitlines() or [res.stderr.strip()[-200:]])[-1]
        if res.returncode == 0 and last.isdigit() and int(last) >= n:
            return
        time.sleep(1.0)
    raise TestbedError(f"Ray nodes did not all join within {timeout:.0f} s (last: {last})")


def up(layout: Layout) -> Testbed:
    """Build the namespaces, links and shaping, start Ray; tear down whatever exists first."""
    check_host()
    down()
    STATE_DIR.mkdir(parents=True, exist_ok=True, mode=0o700)
    token = secrets.token_hex(32)
    bed = Testbed(
        datacenters=[{**asdict(d), "netns": d.netns, "ip": d.ip} for d in layout.datacenters],
        ray_address=layout.ray_address,
        token=token,
    )
    try:
        net.build(layout)
        temp = STATE_DIR / "ray"
        _ray_start(
            HUB_NS,
            [
                "--head",
                "--node-ip-address", HUB_IP,
                "--port", str(RAY_PORT),
                "--include-dashboard=false",
                "--temp-dir", str(temp),
            ],
            token,
        )  # fmt: skip
        for dc in layout.datacenters:
            res = json.dumps({f"cpn-cluster-{dc.name}": dc.workers})
            _ray_start(
                dc.netns,
                ["--address", layout.ray_address, "--node-ip-address", dc.ip, "--resources", res],
                token,
            )
        _save(bed)
        _wait_nodes(bed, 1 + len(layout.datacenters), RAY_START_TIMEOUT_S)
    except BaseException:
        down()
        raise
    return bed


def down() -> list[str]:
    """Remove everything a testbed created, crashed or not; returns what was removed."""
    check_host()
    gone = net.destroy()
    shutil.rmtree(STATE_DIR, ignore_errors=True)
    return gone


def status() -> dict[str, Any]:
    """What exists now: namespaces, shaping, uplink counters, Ray processes per namespace."""
    check_host()
    bed = load()
    out: dict[str, Any] = {
        "namespaces": net.namespaces(),
        "ray_address": bed.ray_address if bed else None,
        "datacenters": [],
    }
    for d in bed.datacenters if bed else []:
        ns = d["netns"]
        present = ns in out["namespaces"]
        tx, rx = net.counters(ns) if present else (0, 0)
        pids = net.sh("ip", "netns", "pids", ns, check=False).split() if present else []
        out["datacenters"].append(
            {
                "name": d["name"],
                "netns": ns,
                "ip": d["ip"],
                "mbit": d["mbit"],
                "workers": d["workers"],
                "qdisc": net.qdisc(ns, UPLINK_IF) if present else "",
                "tx_bytes": tx,
                "rx_bytes": rx,
                "processes": len(pids),
            }
        )
    return out
