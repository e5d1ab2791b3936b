"""A datacenter's uplink changed on a running testbed (`Testbed.set_rate`, `tc qdisc change`):
tc shows the new rate on both ends and real traffic, both ways, moves at it, then at the old
one again. Namespaces and tc only (no Ray): a few seconds.

Each transfer sends 2.5 MB: at least 2 s at 10 Mbit/s (tbf lets no more through, bar a 1 ms
bucket), 0.2 s at 100 Mbit/s; the fast one must take under a third of the slow one, which a
loaded host does not blur.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import asdict

import pytest

from bench.linkchange import tc_rate
from testbed import HUB_NS, UPLINK_IF, Testbed, down, load, net, parse_dcs
from testbed.layout import HUB_IP
from testbed.net import namespaces
from tests.testbed.test_testbed import _unavailable

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

NBYTES = 2_500_000
PORT = 29690
_SERVE = (
    "import socket,sys\n"
    "s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
    "s.bind((sys.argv[1],int(sys.argv[2])));s.listen(1);print('ready',flush=True)\n"
    "c,_=s.accept();n=0\n"
    "while (b:=c.recv(1<<16)):n+=len(b)\n"
    "c.sendall(str(n).encode());c.close()\n"
)
_SEND = (
    "import socket,sys,time\n"
    "c=socket.create_connection((sys.argv[1],int(sys.argv[2])));t=time.perf_counter()\n"
    "c.sendall(b'x'*int(sys.argv[3]));c.shutdown(socket.SHUT_WR)\n"
    "n=int(c.recv(64));print(n,time.perf_counter()-t)\n"
)


def _transfer(src_ns: str, dst_ns: str, dst_ip: str) -> float:
    """Seconds to move NBYTES from a process in `src_ns` to one in `dst_ns`, all received."""
    server = subprocess.Popen(
        ["ip", "netns", "exec", dst_ns, sys.executable, "-c", _SERVE, dst_ip, str(PORT)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        out = net.in_ns(src_ns, sys.executable, "-c", _SEND, dst_ip, str(PORT), str(NBYTES))
        got, seconds = out.split()
        assert int(got) == NBYTES
        return float(seconds)
    finally:
        server.wait(timeout=30)


def test_set_rate_changes_the_uplink_both_ways_on_a_running_testbed() -> None:
    reason = _unavailable()
    if reason:
        pytest.skip(f"WAN testbed skipped: {reason}")
    layout = parse_dcs("a:100:1", 100.0, 1)
    dc = layout.dc("a")
    bed = Testbed(
        datacenters=[{**asdict(d), "netns": d.netns, "ip": d.ip} for d in layout.datacenters],
        ray_address="",
        token="not-the-recorded-testbed",
    )
    try:
        down()
        net.build(layout)
        ends = ((dc.netns, UPLINK_IF), (HUB_NS, dc.hub_if))
        out_of, into = (dc.netns, HUB_NS, HUB_IP), (HUB_NS, dc.netns, dc.ip)

        bed.set_rate("a", 10.0)
        assert [tc_rate(net.qdisc(ns, dev)) for ns, dev in ends] == ["10Mbit", "10Mbit"]
        assert bed.datacenter("a").mbit == 10.0  # the record follows
        assert load() is None  # and no other testbed's state file is written
        slow = [_transfer(*out_of), _transfer(*into)]

        bed.set_rate("a", 100.0)
        assert [tc_rate(net.qdisc(ns, dev)) for ns, dev in ends] == ["100Mbit", "100Mbit"]
        fast = [_transfer(*out_of), _transfer(*into)]

        for way, s, f in zip(("out of a", "into a"), slow, fast, strict=True):
            assert s >= 0.8 * NBYTES * 8 / 10e6, f"{way} at 10 Mbit/s took only {s:.2f} s"
            assert f < s / 3, f"{way}: {f:.2f} s at 100 Mbit/s vs {s:.2f} s at 10"
        with pytest.raises(KeyError, match="no datacenter 'z'"):
            bed.set_rate("z", 10.0)
        with pytest.raises(ValueError, match="> 0"):
            bed.set_rate("a", 0.0)
    finally:
        down()
    assert namespaces() == []
