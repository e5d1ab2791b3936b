"""The heartbeat hot path under load, and the principal cache's revocation rules.

On SQLite and PostgreSQL, against a real uvicorn server on a real socket.
"""

from __future__ import annotations

import asyncio
import time

import httpx
from sqlalchemy import update

from controller.store.db import make_engine
from controller.store.models import ApiKey, utcnow
from tests.conftest import LiveServer


def _agents(live: LiveServer, n: int) -> list[tuple[str, str, str]]:
    """n clusters, each with its agent key: (cluster, token, key id)."""
    out = []
    with live.client() as admin:
        for i in range(n):
            name = f"c{i:03d}"
            admin.create_cluster(name, "r1")
            key = admin.create_api_key("agent", name)
            out.append((name, key["token"], key["id"]))
    return out


def _beat(live: LiveServer, cluster: str, token: str) -> int:
    r = httpx.post(
        f"{live.url}/v1/agent/heartbeat",
        json={"cluster": cluster, "gpus": []},
        headers={"Authorization": f"Bearer {token}"},
        timeout=30,
    )
    return r.status_code


def test_concurrent_beats_beyond_the_pool_all_succeed(live_server: LiveServer) -> None:
    """More requests in flight than pooled connections and worker threads: none may starve.

    Before, the auth dependency held a pooled connection while waiting for a thread, and 100
    concurrent beats deadlocked until the pool's 30 s timeout answered 500s.
    """
    agents = _agents(live_server, 20)
    gpus = [{"model": "A100-80GB", "memory_gib": 80, "count": 8, "allocatable": 8}]

    async def run() -> list[int]:
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(base_url=live_server.url, limits=limits, timeout=60) as c:

            async def beat(i: int) -> int:
                name, token, _ = agents[i % len(agents)]
                r = await c.post(
                    "/v1/agent/heartbeat",
                    json={"cluster": name, "gpus": gpus},
                    headers={"Authorization": f"Bearer {token}"},
                )
                return r.status_code

            return await asyncio.gather(*(beat(i) for i in range(200)))

    started = time.monotonic()
    codes = asyncio.run(run())
    assert codes == [200] * 200
    assert time.monotonic() - started < 25  # far from the pool timeout a deadlock would hit
    with live_server.client() as admin:
        got = admin.get("/v1/clusters/c007")
        assert got["state"] == "READY" and got["gpus"][0]["count"] == 8


def test_revocation_made_elsewhere_reaches_a_cached_key(live_server: LiveServer) -> None:
    """A key revoked by another replica (here: plain SQL) stops working without a restart."""
    [(name, token, _)] = _agents(live_server, 1)
    assert _beat(live_server, name, token) == 200  # now cached in the server
    engine = make_engine(live_server.database_url)
    with engine.begin() as conn:
        conn.execute(update(ApiKey).where(ApiKey.scope == name).values(revoked_at=utcnow()))
    engine.dispose()
    deadline = time.monotonic() + 10
    while _beat(live_server, name, token) != 401:
        assert time.monotonic() < deadline, "a key revoked in the database was still accepted"
        time.sleep(0.05)


def test_revoked_key_is_refused_at_once(live_server: LiveServer) -> None:
    """Revoked through the API of this process: the very next request is refused."""
    [(name, token, key_id)] = _agents(live_server, 1)
    for _ in range(3):
        assert _beat(live_server, name, token) == 200
    with live_server.client() as admin:
        admin.request("DELETE", f"/v1/api-keys/{key_id}")
    assert _beat(live_server, name, token) == 401
