"""Every documented compression and sync value is quoted and placed by the real control plane.

These values were once refused at submission although the API's own schema documented them;
the runtime half of the promise (each one also runs) is tests/training/test_documented_values.py.
"""

from __future__ import annotations

import pytest

from controller.loop.placement import place_pending
from controller.store.db import make_engine, make_sessionmaker
from grammar import DOCUMENTED_COMPRESSIONS, DOCUMENTED_SYNCS, parse_compression, parse_sync
from tests.service.conftest import Network, spec

VALUES = [("compression", v) for v in DOCUMENTED_COMPRESSIONS] + [
    ("sync", v) for v in DOCUMENTED_SYNCS
]


@pytest.mark.parametrize(("field", "value"), VALUES, ids=[f"{f}={v}" for f, v in VALUES])
def test_documented_value_is_quoted_and_placed(network: Network, field: str, value: str) -> None:
    # 20 GPUs (the tenant's quota): more than any one cluster has, so the plan spans the WAN
    # and the value's model (bytes, steps factor) is what the planner weighs
    body = spec(gpus=20, steps=200, qos={"max_clusters": 2}, **{field: value})
    quote = network.tenant.quote(body)
    assert quote.options, quote
    for option in quote.options:
        chosen = getattr(option, field)
        parsed = parse_compression(chosen) if field == "compression" else parse_sync(chosen)
        assert not parsed.is_auto
        if value != "auto":
            assert chosen == value
        assert len(option.clusters) == 2

    job = network.tenant.submit(body)
    engine = make_engine(network.server.database_url)
    try:
        placed = place_pending(make_sessionmaker(engine), owner="test-replica")
        assert [p.job_id for p in placed] == [job.id]
    finally:
        engine.dispose()
    got = network.tenant.get(f"/v1/jobs/{job.id}")
    assert got["state"] == "SCHEDULED", got
    if value != "auto":
        assert got["placement"][field] == value
