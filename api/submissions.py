"""Group commit for job submissions (`api.group_commit`): submissions that arrive together
are written in one transaction, each answered once its job is durable.

A submission's commit and the reads every submission repeats (the network's offered GPUs,
its tenant's grant, the tenant's queue) were most of what the database cost it. A batch
answers each submission on its own (`controller.jobs.service.submit_many`): one refused (a
grant, the queue cap, a spec that can never fit) gets its own problem, and the rest are
written. A key already used makes the batch's insert fail with nothing written; each of its
submissions is then written alone, as one transaction each, which answers a retry with its
key's job (one the database still refuses then is a 503 alone: others may be committed
already).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from api.group_commit import BatchFailed, GroupCommit
from controller.jobs import service as jobs
from controller.jobs.service import Submission, SubmitOutcome, Submitted
from controller.store.table_stats import BurstAnalyzer
from controller.values.errors import CpnError

log = logging.getLogger("cpn.api")


class SubmissionBatcher(GroupCommit[Submission, Submitted]):
    """Coalesces concurrent job submissions into group commits.

    `task_modules`: CPN_TASK_MODULES; `max_queued`: CPN_MAX_QUEUED_JOBS (0: no cap);
    `analyzer`: told of every job created (PostgreSQL), so a tenant's burst gets its list's
    row estimate updated (`controller.store.table_stats`)."""

    def __init__(
        self,
        sessions: sessionmaker[Session],
        *,
        task_modules: Sequence[str],
        max_queued: int,
        workers: int,
        analyzer: BurstAnalyzer | None = None,
    ) -> None:
        super().__init__(self._write, what="job submission", workers=workers)
        self.sessions = sessions
        self.task_modules = tuple(task_modules)
        self.max_queued = max_queued
        self.analyzer = analyzer

    def _write(self, items: list[Submission]) -> list[SubmitOutcome]:
        outcomes = self._store(items)
        if self.analyzer is not None:
            self.analyzer.inserted(
                item.tenant_id
                for item, outcome in zip(items, outcomes, strict=True)
                if isinstance(outcome, Submitted) and outcome.created
            )
        return outcomes

    def _store(self, items: list[Submission]) -> list[SubmitOutcome]:
        with self.sessions() as session:
            try:
                outcomes = jobs.submit_many(session, items, self.task_modules, self.max_queued)
                session.commit()
                return outcomes
            except IntegrityError:
                session.rollback()
        return [self._alone(item) for item in items]

    def _alone(self, item: Submission) -> SubmitOutcome:
        with self.sessions() as session:
            try:
                submitted = jobs.submit(session, item, self.task_modules, self.max_queued)
            except CpnError as exc:
                return exc
            except IntegrityError as exc:  # its key's job gone meanwhile, a tenant deleted
                # this one alone: the batch's others may be committed already
                log.error("a job submission failed: %s", exc)
                return BatchFailed(
                    "the database could not store this job submission (it was rolled back); "
                    "retry shortly"
                )
            session.commit()
            return submitted
