"""Submission group commit (`api.submissions`): one transaction for the submissions that
arrive together, each answered on its own; a key used twice; failures as 503.

On SQLite and PostgreSQL, with the batcher's real writer thread and the real database; a
batch is made deterministic by holding its one writer until every submission has joined.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from sqlalchemy import func, select, text

from api.group_commit import BatchFailed
from api.submissions import SubmissionBatcher
from controller.jobs.service import Submission, Submitted
from controller.store.db import make_engine
from controller.store.models import Job, JobEvent
from controller.values.errors import Forbidden, Invalid, NotFound, TooMany
from grammar.states import JobState
from tests.api.batches import one_batch
from tests.controller.world import Net, spec


@pytest.fixture
def net(db_url: str, tmp_path: Path) -> Iterator[Net]:
    n = Net(db_url, tmp_path)
    n.cluster("a", gpus=8)
    try:
        yield n
    finally:
        n.close()


def _batcher(net: Net, max_queued: int = 0) -> SubmissionBatcher:
    return SubmissionBatcher(net.sessions, task_modules=(), max_queued=max_queued, workers=1)


def _stored(net: Net) -> dict[str, int]:
    """Each stored job's name, with how many events it has (a new job: its PENDING one)."""
    with net.sessions() as s:
        rows = s.execute(
            select(Job.name, func.count(JobEvent.id))
            .join(JobEvent, JobEvent.job_id == Job.id)
            .group_by(Job.name)
        )
        return dict(rows.all())


def test_each_submission_of_a_batch_is_answered_on_its_own(net: Net) -> None:
    """A submission refused (a grant, an unknown tenant) wrote nothing and gets its own
    problem; the rest of its batch is written, each job with its first event."""
    tenant = net.tenant("t")
    batcher = _batcher(net)
    items = [
        Submission(spec("one", gpus=2), tenant),
        Submission(spec("too-high", gpus=2, qos={"priority": 5}), tenant),
        Submission(spec("nobody", gpus=2), "no-such-tenant"),
        Submission(spec("too-big", gpus=64), tenant),
        Submission(spec("two", gpus=2), tenant, "key-2"),
    ]
    results = anyio.run(one_batch, batcher, items)
    assert batcher.batches == 1 and batcher.items == 5
    one, high, nobody, big, two = results
    assert isinstance(one, Submitted) and one.created and one.job.state is JobState.PENDING
    assert isinstance(two, Submitted) and two.created and two.job.idempotency_key == "key-2"
    assert isinstance(high, Forbidden) and high.field == "qos.priority"
    assert isinstance(nobody, NotFound) and nobody.field == "tenant"
    assert isinstance(big, Invalid) and big.field == "gpus"
    assert _stored(net) == {"one": 1, "two": 1}


def test_the_queue_cap_counts_what_its_own_batch_accepted(net: Net) -> None:
    tenant = net.tenant("t")
    net_batcher = _batcher(net, max_queued=3)
    items = [Submission(spec(f"j{i}", gpus=1), tenant) for i in range(5)]
    results = anyio.run(one_batch, net_batcher, items)
    assert [type(r).__name__ for r in results] == ["Submitted"] * 3 + ["TooMany"] * 2
    assert all(isinstance(r, TooMany) and r.status == 429 for r in results[3:])
    assert _stored(net) == {"j0": 1, "j1": 1, "j2": 1}
    # The next batch counts the stored ones.
    [late] = anyio.run(one_batch, net_batcher, [Submission(spec("late", gpus=1), tenant)])
    assert isinstance(late, TooMany)


def test_a_key_used_twice_makes_one_job(net: Net) -> None:
    """Twice in one batch, or once stored before: the insert fails with nothing written,
    each submission is then written alone, and every use of the key gets its one job (a
    different body under it: 422 naming the header)."""
    tenant = net.tenant("t")
    batcher = _batcher(net)
    first, again, other = anyio.run(
        one_batch,
        batcher,
        [
            Submission(spec("keyed", gpus=2), tenant, "k"),
            Submission(spec("keyed", gpus=2), tenant, "k"),
            Submission(spec("plain", gpus=2), tenant),
        ],
    )
    assert isinstance(first, Submitted) and first.created
    assert isinstance(again, Submitted) and not again.created and again.job.id == first.job.id
    assert isinstance(other, Submitted) and other.created
    retry, changed, fresh = anyio.run(
        one_batch,
        batcher,
        [
            Submission(spec("keyed", gpus=2), tenant, "k"),
            Submission(spec("keyed", gpus=4), tenant, "k"),
            Submission(spec("fresh", gpus=2), tenant, "f"),
        ],
    )
    assert isinstance(retry, Submitted) and not retry.created and retry.job.id == first.job.id
    assert isinstance(changed, Invalid) and changed.field == "Idempotency-Key"
    assert isinstance(fresh, Submitted) and fresh.created
    assert _stored(net) == {"keyed": 1, "plain": 1, "fresh": 1}


def _fail_job_inserts(url: str, on: bool) -> None:
    """A trigger that makes the database refuse every new job (a real error from the real
    database), or its removal."""
    engine = make_engine(url)
    sqlite = engine.dialect.name == "sqlite"
    with engine.begin() as conn:
        if sqlite and on:
            conn.execute(
                text(
                    "CREATE TRIGGER fail_jobs BEFORE INSERT ON jobs "
                    "BEGIN SELECT RAISE(ABORT, 'injected failure'); END"
                )
            )
        elif sqlite:
            conn.execute(text("DROP TRIGGER fail_jobs"))
        elif on:
            conn.execute(
                text(
                    "CREATE FUNCTION fail_jobs() RETURNS trigger AS $$ BEGIN "
                    "RAISE EXCEPTION 'injected failure'; END $$ LANGUAGE plpgsql"
                )
            )
            conn.execute(
                text(
                    "CREATE TRIGGER fail_jobs BEFORE INSERT ON jobs "
                    "FOR EACH ROW EXECUTE FUNCTION fail_jobs()"
                )
            )
        else:
            conn.execute(text("DROP TRIGGER fail_jobs ON jobs"))
            conn.execute(text("DROP FUNCTION fail_jobs()"))
    engine.dispose()


def test_a_database_error_fails_every_submission_of_the_batch_with_503(
    net: Net, db_url: str
) -> None:
    tenant = net.tenant("t")
    batcher = _batcher(net)
    _fail_job_inserts(db_url, on=True)
    try:
        items = [Submission(spec(f"j{i}", gpus=1), tenant, f"k{i}") for i in range(3)]
        results = anyio.run(one_batch, batcher, items)
    finally:
        _fail_job_inserts(db_url, on=False)
    assert all(isinstance(r, BatchFailed) for r in results), results
    assert all(r.status == 503 and r.retry_after_s == 1 for r in results)  # type: ignore[union-attr]
    assert "job submission" in str(results[0])
    assert _stored(net) == {}  # rolled back: nothing of the batch stored
    # The batcher goes on: the next batch is written, the same keys make their jobs.
    results = anyio.run(one_batch, batcher, items)
    assert all(isinstance(r, Submitted) and r.created for r in results)
    assert _stored(net) == {"j0": 1, "j1": 1, "j2": 1}
