"""The namespace WAN testbed end to end: 2 datacenters on shaped uplinks, a real multi-node Ray,
`cpn train` across it, and the bytes on the uplinks' interface counters against cpn's report.

Byte tolerance. cpn counts the serialized payload of each leader-to-leader message. The
interface counters see more: Ethernet+IP+TCP headers (66 B per segment of at most 1448 B, about
4.6 %), the ACKs of the opposite direction (about 2 %), the size all-gather before each payload,
and fixed costs of the run: gloo rendezvous, the initial broadcast of the model from rank 0, and
Ray's control traffic (task calls, results, heartbeats) for the node in that namespace. So each
direction must carry at least what cpn reported and at most 1.15x it plus 1.5 MiB; the run is
sized so the payload (about 10 MB a direction) dominates the fixed part. Intra-datacenter
all-reduces (2 workers per datacenter) stay inside the namespace and must not show up.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from testbed import PREFIX, Testbed, TestbedError, check_host, down, parse_dcs, up
from testbed.net import namespaces

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _unavailable() -> str | None:
    try:
        check_host()
    except TestbedError as exc:
        return str(exc)
    probe = subprocess.run(
        ["ip", "netns", "add", f"{PREFIX}-probe"], capture_output=True, text=True, timeout=30
    )
    if probe.returncode != 0:
        return f"network namespaces unavailable: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", f"{PREFIX}-probe"], capture_output=True, timeout=30)
    return None


def test_train_across_shaped_uplinks_matches_interface_bytes() -> None:
    reason = _unavailable()
    if reason:
        pytest.skip(f"WAN testbed skipped: {reason}")
    try:
        testbed = up(parse_dcs("a:100:2,b:100:2", 100.0, 2))
        _train_and_check(testbed)
    finally:
        down()
    assert namespaces() == []  # nothing left behind
    assert down() == []  # and down on a clean host is harmless


def _train_and_check(testbed: Testbed) -> None:
    before = testbed.uplink_bytes()
    argv = [sys.executable, "-m", "api.cli", "train", "--task", "builtin:mnist1d-mlp"]
    argv += ["--clusters", "a:2,b:2", "--steps", "100", "--compression", "none"]
    argv += ["--ray-address", testbed.ray_address, "--gloo-ifname", testbed.gloo_ifname, "--json"]
    res = testbed.run_in_hub(argv, timeout=180)
    after = testbed.uplink_bytes()
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(res.stdout)
    assert report["steps"] == 100
    assert report["wan_emulated"] is False
    assert report["final_accuracy"] > 0.2  # it trained (10 classes: chance is 0.1)

    sent = {"a": report["wan_bytes"]["a->b"], "b": report["wan_bytes"]["b->a"]}
    assert min(sent.values()) > 5_000_000  # the payload dominates the fixed costs
    for dc, other in (("a", "b"), ("b", "a")):
        tx = after[dc][0] - before[dc][0]
        rx = after[dc][1] - before[dc][1]
        for what, measured, reported in (("out of", tx, sent[dc]), ("into", rx, sent[other])):
            lo, hi = reported, 1.15 * reported + 1.5 * 2**20
            assert lo <= measured <= hi, (
                f"bytes {what} {dc}: interface {measured:,} B, cpn reported {reported:,} B "
                f"(allowed {lo:,.0f}..{hi:,.0f})"
            )
