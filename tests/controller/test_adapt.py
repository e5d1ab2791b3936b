"""A plan's `auto` parts under the control plane: the run starts on the plan's concrete pair
and may re-decide what the user left to `auto` (`TrainSpec.adapt`); each change it reports
becomes one job event naming the step, the new pair and why (issue 47, item 1)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select

from controller.jobs.request import spec_of
from controller.jobs.service import cancel
from controller.loop.progress import flush
from controller.loop.ray_run import train_spec_of
from controller.store.models import Job, JobEvent
from tests.controller.world import Net, east_west, progress, spec
from training.results import AutoChoice


@pytest.fixture
def net(db_url: str, tmp_path: Path) -> Iterator[Net]:
    n = east_west(db_url, tmp_path)
    yield n
    n.close()


def _launched(
    net: Net, tenant: str, sync: str, compression: str
) -> tuple[tuple[str, ...], str, str]:
    job_spec = spec("w", gpus=8).model_copy(update={"sync": sync, "compression": compression})
    job_id = net.submit(tenant, job_spec)
    assert net.place() == [job_id]
    with net.sessions() as s:
        job = s.get(Job, job_id)
        assert job is not None and job.placement is not None
        train = train_spec_of(net.launcher.config, job, spec_of(job), net.held(job_id))
        cancel(s, job, "seen")
        s.commit()
    return tuple(train.adapt), str(train.sync), str(train.compression)


def test_what_the_user_left_to_auto_the_run_may_re_decide_from_the_plan(net: Net) -> None:
    tenant = net.tenant("acme")
    adapt, sync, compression = _launched(net, tenant, "auto", "auto")
    assert adapt == ("sync", "compression")
    assert sync != "auto" and compression != "auto"  # it starts on the plan's pair
    assert _launched(net, tenant, "every-step", "none") == ((), "every-step", "none")


def test_each_re_decision_the_run_reports_is_one_job_event(net: Net) -> None:
    job_id = net.submit(net.tenant("acme"), spec("w", gpus=8))
    assert net.place() == [job_id]
    handle = net.start(job_id)
    first = AutoChoice(72, "local-sgd:64", "int4", "local-sgd:64 int4: step 0.01s (...)")
    second = AutoChoice(136, "local-sgd:8", "none", "local-sgd:8 none: step 0.005s (...)")
    for step, decided in ((64, []), (80, [first]), (96, [first]), (144, [first, second])):
        report = progress(step, handle.clusters)
        report.auto_decisions = list(decided)
        handle.on_progress(report)
        flush(net.sessions, handle)
    with net.sessions() as s:
        events = s.scalars(
            select(JobEvent)
            .where(JobEvent.job_id == job_id, JobEvent.kind == "warning")
            .order_by(JobEvent.id)
        ).all()
    assert [e.data["step"] for e in events] == [72, 136]  # once each, in order
    assert events[0].message.startswith("step 72: the run now syncs local-sgd:64 with int4")
    assert events[0].data["why"] == first.why
