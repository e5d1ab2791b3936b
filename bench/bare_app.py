"""The ceiling for heartbeat ingestion: the same endpoint with no auth, no database, no work.

It parses the same `Heartbeat` body and answers the same `HeartbeatAck` (with a fixed peer
list) and is served by uvicorn exactly as `cpn serve` serves the control plane, so what
`bench.heartbeats` measures beside it is the cost of cpn's own work per beat.

Run: `.venv/bin/python -m bench.bare_app --port 0 [--peers 16]`.
"""

from __future__ import annotations

import argparse
from datetime import UTC, datetime, timedelta

from fastapi import FastAPI

from agents.protocol import Heartbeat, HeartbeatAck, PeerProbe


def peer_name(i: int) -> str:
    return f"bench-{i:05d}"


def create_app(peers: int) -> FastAPI:
    table = [
        PeerProbe(cluster=peer_name(i), probe_url=f"http://10.0.{i // 250}.{i % 250}:7070")
        for i in range(peers)
    ]
    app = FastAPI(title="bare heartbeat endpoint")

    @app.post("/v1/agent/heartbeat", response_model=HeartbeatAck)
    def heartbeat(body: Heartbeat) -> HeartbeatAck:
        return HeartbeatAck(
            cluster=body.cluster,
            state="READY",
            lease_expires_at=datetime.now(UTC) + timedelta(seconds=40),
            heartbeat_interval_s=10.0,
            probe_interval_s=60.0,
            probe_bytes=4 * 1024 * 1024,
            peers=[p for p in table if p.cluster != body.cluster],
        )

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--peers", type=int, default=16, help="clusters listed as peers")
    args = parser.parse_args()
    import uvicorn

    # The same call `cpn serve` makes (api/cli/serve.py): uvicorn's defaults otherwise.
    uvicorn.run(create_app(args.peers), host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
