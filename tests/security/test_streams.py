"""Event streams cannot stall the control plane (issue 14, item 1), on live servers.

Each server here is the real app under uvicorn over a real database of each backend. Jobs
stay PENDING (no controller loop), and their events are written to the database the way the
controller writes them, so a stream has something to carry whenever a check needs it.
Waits are bounded polls of real state (a stream's next line, a freed slot), never sleeps.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from agents.protocol import GpuInventory, Heartbeat
from api.client import ApiError, Client
from api.processes import wait_until
from api.streams import StreamSlots
from controller.store.db import make_engine
from controller.store.models import JobEvent
from tests.conftest import LiveServer, start_server
from tests.security.conftest import Answer, assert_problem, call
from tests.service.conftest import build_network, spec

GUARD_S = 60.0
"""How long a check waits for a stream to do what it must before failing (not a timing
assertion: only a broken server takes anywhere near this long)."""


# ---- the pure slot counts -------------------------------------------------------------------


def test_slots_cap_each_key_and_come_back_once() -> None:
    slots = StreamSlots(per_key=2, max_s=300.0)
    a1, a2 = slots.acquire("a", 0.0), slots.acquire("a", 1.0)
    assert a1 is not None and a2 is not None
    assert slots.acquire("a", 2.0) is None
    assert slots.acquire("b", 2.0) is not None  # another key has its own count
    a1.release()
    a1.release()  # a second release gives nothing more back
    assert slots.open("a") == 1
    assert slots.acquire("a", 3.0) is not None
    assert slots.acquire("a", 3.0) is None


def test_retry_after_is_when_the_oldest_stream_ends_within_bounds() -> None:
    slots = StreamSlots(per_key=1, max_s=10.0)
    assert slots.acquire("a", 100.0) is not None
    assert slots.retry_after("a", 104.2) == 6  # the oldest runs at most until 110
    assert slots.retry_after("a", 200.0) == 1  # overdue: never 0
    long = StreamSlots(per_key=1, max_s=3600.0)
    assert long.acquire("a", 0.0) is not None
    assert long.retry_after("a", 0.0) == 30  # capped: most streams end long before


# ---- a live world ---------------------------------------------------------------------------


@dataclass
class Stage:
    """A live server with a priced network, a tenant with `keys` keys, and a PENDING job."""

    live: LiveServer
    tenant_id: str
    keys: list[dict[str, Any]]
    job_id: str
    agent_token: str

    @property
    def url(self) -> str:
        return self.live.url

    def add_events(self, n: int, mark: str = "step") -> list[int]:
        """Write `n` progress events of the job, as the controller does; their ids."""
        engine = make_engine(self.live.database_url)
        try:
            with Session(engine) as session, session.begin():
                rows = [
                    JobEvent(job_id=self.job_id, kind="progress", message=f"{mark} {i}")
                    for i in range(n)
                ]
                session.add_all(rows)
                session.flush()
                return [r.id for r in rows]
        finally:
            engine.dispose()

    def event_ids(self) -> list[int]:
        engine = make_engine(self.live.database_url)
        try:
            with Session(engine) as session:
                return list(
                    session.scalars(
                        select(JobEvent.id)
                        .where(JobEvent.job_id == self.job_id)
                        .order_by(JobEvent.id)
                    )
                )
        finally:
            engine.dispose()


@contextmanager
def stage(db_url: str, keys: int = 1, **settings: Any) -> Iterator[Stage]:
    live = start_server(database_url=db_url, run_controller=False, **settings)
    net = build_network(live)
    try:
        minted = [net.admin.create_api_key("tenant", net.tenant_id) for _ in range(keys)]
        job = Client(live.url, minted[0]["token"]).submit(spec(name="streamed"))
        agent = net.admin.create_api_key("agent", "us-east")["token"]
        yield Stage(live, net.tenant_id, minted, job.id, agent)
    finally:
        for c in (net.admin, net.tenant, net.other):
            c.close()
        live.stop()


class OpenStream:
    """One event stream held open, read line by line on demand."""

    def __init__(
        self,
        stack: ExitStack,
        http: httpx.Client,
        path: str,
        token: str,
        last_event_id: int | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {token}", "Accept": "text/event-stream"}
        if last_event_id is not None:
            headers["Last-Event-ID"] = str(last_event_id)
        self.response = stack.enter_context(http.stream("GET", path, headers=headers))
        self.status = self.response.status_code
        self._lines = self.response.iter_lines() if self.status == 200 else iter(())

    def until(self, wanted: str) -> list[str]:
        """Lines up to and including the first that starts with `wanted` (the stream ending
        first, or `GUARD_S` passing, fails the check)."""
        seen: list[str] = []
        deadline = time.monotonic() + GUARD_S
        for line in self._lines:
            seen.append(line)
            if line.startswith(wanted):
                return seen
            assert time.monotonic() < deadline, f"no {wanted!r} within {GUARD_S:g} s: {seen[-5:]}"
        raise AssertionError(f"stream ended before {wanted!r}: {seen[-5:]}")

    def rest(self) -> list[str]:
        """Every line until the server ends the stream (bounded by `GUARD_S`)."""
        seen: list[str] = []
        deadline = time.monotonic() + GUARD_S
        for line in self._lines:
            seen.append(line)
            assert time.monotonic() < deadline, f"stream still open after {GUARD_S:g} s"
        return seen

    def close(self) -> None:
        self.response.close()


def _events(lines: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """(event, data) of the messages in `lines`."""
    out, kind = [], "message"
    for line in lines:
        if line.startswith("event: "):
            kind = line[len("event: ") :]
        elif line.startswith("data: "):
            out.append((kind, json.loads(line[len("data: ") :])))
            kind = "message"
    return out


def _ids(events: list[tuple[str, dict[str, Any]]]) -> list[int]:
    """Ids of the job's events among `events` (not the stream's own end, resume, error)."""
    return [d["id"] for k, d in events if k not in ("end", "resume", "error")]


def _beat(http: httpx.Client, token: str) -> Answer:
    body = Heartbeat(
        cluster="us-east",
        gpus=[GpuInventory(model="A100", memory_gib=80, count=8, allocatable=8)],
    ).model_dump(mode="json", exclude_unset=True)
    return call(http, "POST", "/v1/agent/heartbeat", token, json=body)


def _path(s: Stage) -> str:
    return f"/v1/jobs/{s.job_id}/events?stream=true"


# ---- the cap --------------------------------------------------------------------------------


def test_a_key_past_its_stream_cap_gets_a_429_problem_with_retry_after(db_url: str) -> None:
    with (
        stage(db_url, keys=2, max_streams_per_key=2) as s,
        httpx.Client(base_url=s.url, timeout=30) as http,
        ExitStack() as stack,
    ):
        first, second = s.keys[0]["token"], s.keys[1]["token"]
        held = [OpenStream(stack, http, _path(s), first) for _ in range(2)]
        assert [h.status for h in held] == [200, 200]
        for h in held:
            h.until("retry:")  # the server is streaming to both

        refused = call(http, "GET", _path(s), first)
        assert_problem(refused, 429)
        assert int(refused.headers["Retry-After"]) >= 1
        assert "CPN_MAX_STREAMS_PER_KEY" in refused.body["detail"]

        other = OpenStream(stack, http, _path(s), second)  # another key: its own count
        assert other.status == 200

        held[0].close()  # a closed stream gives its place back

        def admitted() -> bool:
            answer = call(http, "GET", f"/v1/jobs/{s.job_id}/events", first, params={"limit": 1})
            assert answer.status == 200
            again = OpenStream(stack, http, _path(s), first)
            if again.status == 200:
                return True
            again.close()
            return False

        wait_until(admitted, GUARD_S, "the closed stream's slot to come back")


# ---- the lifetime and resuming --------------------------------------------------------------


def test_a_stream_ends_at_its_lifetime_with_where_to_resume(db_url: str) -> None:
    with (
        stage(db_url, stream_max_s=0.5) as s,
        httpx.Client(base_url=s.url, timeout=30) as http,
        ExitStack() as stack,
    ):
        token = s.keys[0]["token"]
        s.add_events(3, "before")
        got = _events(OpenStream(stack, http, _path(s), token).rest())
        assert got[-1][0] == "resume", got[-3:]
        sent = _ids(got)
        assert sent == s.event_ids()
        assert got[-1][1]["last_event_id"] == sent[-1]

        later = s.add_events(2, "after")
        resumed = OpenStream(stack, http, _path(s), token, last_event_id=sent[-1])
        again = _events(resumed.rest())
        assert _ids(again) == later
        assert again[-1][0] == "resume"


def test_the_client_resumes_across_lifetimes_and_loses_no_event(db_url: str) -> None:
    """`Client.events` (what `cpn submit --wait` follows) over streams that last half a
    second, while events keep coming: every event arrives once, in order."""
    with stage(db_url, stream_max_s=0.5) as s:
        token = s.keys[0]["token"]
        opened: list[str] = []
        client = Client(s.url, token)
        client._http.event_hooks["request"].append(
            lambda request: opened.append(str(request.url.path))
        )
        stop = threading.Event()

        def produce() -> None:
            for i in range(40):  # about 2 s of events: several stream lifetimes
                s.add_events(1, f"live {i}")
                if stop.wait(0.05):
                    return
            Client(s.url, token).cancel(s.job_id)

        producer = threading.Thread(target=produce, daemon=True)
        producer.start()
        try:
            seen = [e["id"] for e in client.events(s.job_id)]
        finally:
            stop.set()
            producer.join(timeout=GUARD_S)
            client.close()
        assert seen == s.event_ids()
        assert len(seen) == len(set(seen))
        streams = [p for p in opened if p.endswith("/events")]
        assert len(streams) >= 2, "the server never ended a stream at its lifetime"


# ---- revoked and expired keys ---------------------------------------------------------------


def test_a_revoked_keys_open_stream_ends_with_a_401(db_url: str) -> None:
    with (
        stage(db_url, keys=2) as s,
        httpx.Client(base_url=s.url, timeout=30) as http,
        ExitStack() as stack,
    ):
        doomed, kept = s.keys
        streams = [OpenStream(stack, http, _path(s), k["token"]) for k in (doomed, kept)]
        for stream in streams:
            stream.until(": keep-alive")
        answer = call(http, "DELETE", f"/v1/api-keys/{doomed['id']}", s.live.admin_token)
        assert answer.status == 200
        ended = _events(streams[0].rest())
        assert ended[-1][0] == "error"
        assert ended[-1][1]["status"] == 401
        s.add_events(1, "for the live key")
        assert streams[1].until("event: progress")  # the other key's stream goes on


def test_an_expiring_keys_stream_ends_and_the_client_says_why(db_url: str) -> None:
    with stage(db_url) as s:
        soon = (datetime.now(UTC) + timedelta(seconds=2)).isoformat()
        key = Client(s.url, s.live.admin_token).create_api_key(
            "tenant", s.tenant_id, expires_at=soon
        )
        with Client(s.url, key["token"]) as client, pytest.raises(ApiError) as ended:
            for _ in client.events(s.job_id):
                pass
        assert ended.value.status == 401


# ---- heartbeats while streams are open ------------------------------------------------------


def test_heartbeats_and_requests_go_on_with_twice_the_pool_in_open_streams(db_url: str) -> None:
    """A pool of 2 connections and 4 open streams: with a stream holding a connection, the
    third stream, the job read and the beats would wait out the pool timeout (503)."""
    pool = 2
    with (
        stage(db_url, keys=2, db_pool_size=pool, db_max_overflow=0, db_pool_timeout_s=5) as s,
        httpx.Client(base_url=s.url, timeout=30) as http,
        ExitStack() as stack,
    ):
        streams = [
            OpenStream(stack, http, _path(s), s.keys[i % 2]["token"]) for i in range(2 * pool)
        ]
        assert [st.status for st in streams] == [200] * (2 * pool)
        for st in streams:
            st.until(": keep-alive")  # each has polled the database at least once

        beats = [_beat(http, s.agent_token) for _ in range(20)]
        assert [b.status for b in beats] == [200] * 20, [str(b) for b in beats if b.status != 200]
        read = call(http, "GET", f"/v1/jobs/{s.job_id}", s.keys[0]["token"])
        assert read.status == 200, str(read)

        (new,) = s.add_events(1, "while crowded")
        for st in streams:
            assert st.until(f"id: {new}")  # every stream still polls


def test_heartbeats_need_nothing_from_the_pool_tenants_use(db_url: str) -> None:
    """Every connection of the API's pool taken (as a crowd of slow tenant requests would):
    beats still go through, on the agents' own pool; a tenant request waits it out (503)."""
    with (
        stage(db_url, db_pool_size=2, db_max_overflow=0, db_pool_timeout_s=2) as s,
        httpx.Client(base_url=s.url, timeout=30) as http,
        ExitStack() as stack,
    ):
        app: Any = s.live.server.config.app
        assert app.state.cpn.agent_engine is not app.state.cpn.engine
        for _ in range(2):
            stack.enter_context(app.state.cpn.engine.connect())
        beats = [_beat(http, s.agent_token) for _ in range(10)]
        assert [b.status for b in beats] == [200] * 10, [str(b) for b in beats if b.status != 200]
        assert_problem(call(http, "GET", f"/v1/jobs/{s.job_id}", s.keys[0]["token"]), 503)
