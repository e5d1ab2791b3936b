"""The ceiling for the jobs API: `POST /v1/jobs` and `GET /v1/jobs` with no auth and no database.

It parses the same `JobSpec` body and answers the same `JobOut` / `Page[JobOut]` shapes from
memory, served by uvicorn exactly as `cpn serve` serves the control plane, so what
`bench.api` measures beside it is the cost of cpn's own work per request (auth, planning,
the transaction, the query).

Run: `.venv/bin/python -m bench.bare_api --port 0`.
"""

from __future__ import annotations

import argparse
import uuid
from datetime import UTC, datetime
from typing import Annotated

from fastapi import FastAPI, Query, Response, status

from api.schemas import Page
from wire.jobs import JobOut
from wire.spec import JobSpec


def create_app() -> FastAPI:
    app = FastAPI(title="bare jobs endpoint")
    jobs: list[JobOut] = []

    @app.post("/v1/jobs", status_code=status.HTTP_201_CREATED, response_model=JobOut)
    def submit(spec: JobSpec, response: Response) -> JobOut:
        now = datetime.now(UTC)
        lo, hi = spec.gpu_range
        job = JobOut(
            id=str(uuid.uuid4()),
            tenant_id="bare",
            name=spec.name,
            state="PENDING",
            reason="waiting for the scheduler",
            priority=spec.qos.priority,
            qos_class=spec.qos.qos_class,
            preemptible=spec.qos.is_preemptible,
            gpus_min=lo,
            gpus_max=hi,
            spec=spec.model_dump(mode="json"),
            quote_id=None,
            held_price=None,
            placement=None,
            attempts=0,
            created_at=now,
            updated_at=now,
            started_at=None,
            finished_at=None,
            ends_at=None,
            version=1,
        )
        jobs.append(job)
        response.headers["ETag"] = '"1"'
        return job

    @app.get("/v1/jobs", response_model=Page[JobOut])
    def list_jobs(
        limit: Annotated[int, Query(ge=1, le=500)] = 100,
        offset: Annotated[int, Query(ge=0)] = 0,
    ) -> Page[JobOut]:
        end = max(0, len(jobs) - offset)
        newest = jobs[max(0, end - limit) : end][::-1]
        return Page(items=newest, total=len(jobs), limit=limit, offset=offset)

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args()
    import uvicorn

    # The same call `cpn serve` makes (api/cli/serve.py): uvicorn's defaults otherwise.
    uvicorn.run(create_app(), host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
