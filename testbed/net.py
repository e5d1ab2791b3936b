"""Namespaces, veth pairs, the hub bridge and tc shaping, through the `ip` and `tc` tools."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time

from testbed.layout import BRIDGE, HUB_IP, HUB_NS, PREFIX, UPLINK_IF, Layout, tbf_args


class TestbedError(RuntimeError):
    """A one-line reason the testbed cannot be built or used."""

    __test__ = False  # not a pytest class


def check_host() -> None:
    """Raise TestbedError unless we are root with `ip` and `tc` and namespaces work."""
    if os.geteuid() != 0:
        raise TestbedError("the testbed needs root (network namespaces and tc); run it as root")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise TestbedError(f"the testbed needs the `{tool}` tool (iproute2); install it")


def sh(*argv: str, check: bool = True) -> str:
    res = subprocess.run(list(argv), capture_output=True, text=True, timeout=60)
    if check and res.returncode != 0:
        msg = (res.stderr or res.stdout).strip().splitlines()
        raise TestbedError(f"`{' '.join(argv)}` failed: {msg[-1] if msg else res.returncode}")
    return res.stdout


def in_ns(ns: str, *argv: str, check: bool = True) -> str:
    return sh("ip", "netns", "exec", ns, *argv, check=check)


def namespaces() -> list[str]:
    """The testbed's namespaces that exist now (found by prefix: crash leftovers too)."""
    out = sh("ip", "-j", "netns", "list", check=False).strip()
    items = json.loads(out) if out else []
    return sorted(i["name"] for i in items if i["name"].startswith(f"{PREFIX}-"))


def build(layout: Layout) -> None:
    """Hub namespace with the bridge; one namespace per datacenter on a shaped veth uplink."""
    sh("ip", "netns", "add", HUB_NS)
    in_ns(HUB_NS, "ip", "link", "set", "lo", "up")
    in_ns(HUB_NS, "ip", "link", "add", BRIDGE, "type", "bridge")
    in_ns(HUB_NS, "ip", "addr", "add", f"{HUB_IP}/24", "dev", BRIDGE)
    in_ns(HUB_NS, "ip", "link", "set", BRIDGE, "up")
    for dc in layout.datacenters:
        sh("ip", "netns", "add", dc.netns)
        in_ns(dc.netns, "ip", "link", "set", "lo", "up")
        # both ends are born inside their namespaces: nothing ever lands in the host's
        sh(
            "ip", "link", "add", dc.hub_if, "netns", HUB_NS,
            "type", "veth", "peer", "name", UPLINK_IF, "netns", dc.netns,
        )  # fmt: skip
        in_ns(HUB_NS, "ip", "link", "set", dc.hub_if, "master", BRIDGE)
        in_ns(HUB_NS, "ip", "link", "set", dc.hub_if, "up")
        in_ns(dc.netns, "ip", "addr", "add", f"{dc.ip}/24", "dev", UPLINK_IF)
        in_ns(dc.netns, "ip", "link", "set", UPLINK_IF, "up")
        shape(dc.netns, UPLINK_IF, dc.mbit)  # uplink: out of the datacenter
        shape(HUB_NS, dc.hub_if, dc.mbit)  # downlink: into the datacenter


def shape(ns: str, dev: str, mbit: float) -> None:
    in_ns(ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", *tbf_args(mbit))


def reshape(ns: str, dev: str, mbit: float) -> None:
    """Change the rate of a shaped interface in place (`tc qdisc change`): the tbf keeps its
    queue, so a run crossing the link sees a slower (or faster) WAN, not a reset one. Works
    from any namespace as root (`ip netns exec`), e.g. from a driver in the hub."""
    in_ns(ns, "tc", "qdisc", "change", "dev", dev, "root", "tbf", *tbf_args(mbit))


def cut(ns: str, dev: str) -> None:
    """Drop every packet leaving `dev`: a `pfifo` of no room replaces its shaping (`tc`'s
    drop actions and `matchall` are not in every kernel; this is). Silence, not a reset, is
    what a failed WAN path looks like from the other end. `shape` undoes it."""
    in_ns(ns, "tc", "qdisc", "replace", "dev", dev, "root", "pfifo", "limit", "0")


def counters(ns: str, dev: str = UPLINK_IF) -> tuple[int, int]:
    """(tx_bytes, rx_bytes) of an interface, link-layer bytes (Ethernet + IP + TCP + payload)."""
    out = sh("ip", "-n", ns, "-s", "-j", "link", "show", "dev", dev)
    stats = json.loads(out)[0]["stats64"]
    return int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])


def qdisc(ns: str, dev: str) -> str:
    return sh("ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", dev, check=False).strip()


def kill_ns_processes(ns: str, grace_s: float = 5.0) -> int:
    """End every process inside `ns` (all were started by the testbed): TERM, then KILL."""

    def pids() -> list[int]:
        out = sh("ip", "netns", "pids", ns, check=False)
        return [int(p) for p in out.split() if p.isdigit() and int(p) != os.getpid()]

    found = pids()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in found:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and pids():
            time.sleep(0.1)
        found = pids()
        if not found:
            break
    return len(found)


def destroy() -> list[str]:
    """Delete every testbed namespace (their veths, bridge and qdiscs go with them)."""
    gone = []
    for ns in namespaces():
        kill_ns_processes(ns)
        sh("ip", "netns", "del", ns, check=False)
        gone.append(ns)
    # a crash between `veth add` and the move could only leave prefixed links in the host
    out = sh("ip", "-j", "link", "show", check=False).strip()
    for link in json.loads(out) if out else []:
        if link["ifname"].startswith(PREFIX):
            sh("ip", "link", "del", link["ifname"], check=False)
            gone.append(link["ifname"])
    return gone
