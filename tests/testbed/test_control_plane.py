"""The control plane on the namespace WAN testbed: `cpn serve` in the hub namespace with the
testbed's Ray, one `cpn agent` per datacenter namespace measuring the real shaped links, and a
tenant's job placed on those measurements and trained across the namespaces (no emulation).
The same code path as `python -m bench.wan_serve`.

Uplinks of 40 and 160 Mbit/s: every path between the two datacenters crosses the 40 Mbit/s
one (out of a, or into a), so both directions must measure near 40 Mbit/s, far from 160.
"""

from __future__ import annotations

import pytest

from bench import wan_serve
from testbed.net import namespaces
from tests.testbed.test_testbed import _unavailable

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


def test_job_through_cpn_serve_on_measured_shaped_links() -> None:
    reason = _unavailable()
    if reason:
        pytest.skip(f"WAN testbed skipped: {reason}")
    result = wan_serve.run(
        "a:40:1,b:160:1", steps=60, jobs=1, timeout=300, probe_interval=2, gpus=2
    )
    assert namespaces() == []  # torn down

    links = {(x["src"], x["dst"]): x for x in result["links"]}
    assert set(links) == {("a", "b"), ("b", "a")}
    for x in links.values():
        assert x["shaped_mbit"] == 40
        # tbf shapes link-layer bytes; the probe counts payload (~95 % of them)
        assert 0.6 * 40 <= x["measured_mbit"] <= 1.1 * 40, x

    [job] = result["jobs"]
    assert job["placement"] == {"a": 1, "b": 1}  # one GPU each: the job spans the WAN
    assert job["steps"] == 60
    est, obs = job["estimate"], job["observed"]
    assert est["step_s"] > 0 and obs["step_s"] > 0 and obs["compute_s"] > 0
    # what cpn metered crossed the real uplinks (with headers, Ray's and the agents' traffic:
    # their probes keep running, so there is no upper bound here; test_testbed has one)
    assert 0 < obs["wan_bytes"] <= sum(job["uplink_bytes"].values())
