"""One local Ray for the whole training test session, with a custom resource per test cluster."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

CLUSTERS = {"a": 4, "b": 4, "c": 4, "d": 4}


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    ray = pytest.importorskip("ray")
    from training.runner import local_resources

    ray.init(
        num_cpus=2,
        resources=local_resources(CLUSTERS),
        include_dashboard=False,
        log_to_driver=False,
    )
    yield
    ray.shutdown()
