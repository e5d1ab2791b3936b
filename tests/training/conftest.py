"""One local Ray for the whole training test session, with a custom resource per test cluster."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

CLUSTERS = {"a": 4, "b": 4, "c": 4, "d": 4}


def _ensure_session_ray() -> None:
    """Start the session's Ray unless it is the one running. A controller test in the same
    process (under xdist a worker mixes folders) replaces it with a Ray sized to its own
    clusters (controller.loop.ray_run re-sizes a local Ray), so this is checked before every
    test."""
    import ray

    from training.runner import local_resources

    wanted = local_resources(CLUSTERS)
    if ray.is_initialized():
        have = ray.cluster_resources()
        if all(have.get(k) == v for k, v in wanted.items()):
            return
        ray.shutdown()
    ray.init(num_cpus=2, resources=wanted, include_dashboard=False, log_to_driver=False)


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    ray = pytest.importorskip("ray")
    _ensure_session_ray()
    yield
    ray.shutdown()


@pytest.fixture(autouse=True)
def _session_ray_is_current(request: pytest.FixtureRequest) -> None:
    if "ray_session" in request.fixturenames:
        _ensure_session_ray()
