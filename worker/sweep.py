"""The sweep: re-enqueue jobs whose message was lost or whose worker died.

The broker only carries job ids; the database says which jobs still need a worker
(`claims.stale_ids`: queued too long since their last enqueue, or running with a stale
heartbeat). Any number of sweepers may run (every API process, optionally every Celery worker):
`stale_jobs` stamps what it returns so the next sweep leaves it alone for a while, and a
duplicate message is harmless because `claim` is conditional.

A broker that comes back without its messages (a Redis restart without persistence, a flush)
is noticed by the next sweep (`app.domain.queue.BrokerWatch`), which then enqueues every queued job
at once instead of waiting `requeue_after_s` for each (workers would idle meanwhile). Each
sweep also removes the work folders of killed jobs (`worker.workdirs`).
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import update
from sqlalchemy.orm import Session, sessionmaker

from app.domain.db.base import utcnow
from app.domain.db.models import CompileJob, ProfileJob
from app.domain.db.session import session_scope
from app.domain.queue import BrokerWatch, JobKind
from worker.claims import (
    DEFAULT_REQUEUE_AFTER_S,
    DEFAULT_STALE_AFTER_S,
    JobTable,
    queued_ids,
    stale_ids,
)
from worker.workdirs import remove_abandoned

if TYPE_CHECKING:
    from app.domain.queue import JobQueue
    from app.domain.settings import Settings

log = logging.getLogger(__name__)

JOB_TABLES: dict[JobKind, JobTable] = {"compile": CompileJob, "profile": ProfileJob}


def sweep_interval(settings: Settings) -> float:
    """How often to sweep: a third of the stale threshold (a dead worker's job restarts within
    ~1.3x `stale_after_s`), between 1 and 30 s."""
    return max(1.0, min(30.0, settings.stale_after_s / 3))


def sweep_once(
    session_factory: sessionmaker[Session],
    queue: JobQueue,
    now: dt.datetime | None = None,
    *,
    stale_after_s: float = DEFAULT_STALE_AFTER_S,
    requeue_after_s: float = DEFAULT_REQUEUE_AFTER_S,
) -> list[uuid.UUID]:
    """Enqueue the stale jobs of every kind again, committed first, then enqueued; returns
    their ids."""
    found: list[tuple[JobKind, uuid.UUID]] = []
    with session_scope(session_factory) as session:
        for kind, table in JOB_TABLES.items():
            ids = stale_ids(
                session, table, now, stale_after_s=stale_after_s, requeue_after_s=requeue_after_s
            )
            found += [(kind, job_id) for job_id in ids]
    for kind, job_id in found:
        log.warning("sweep: %s %s looks lost or its worker died; enqueueing it again", kind, job_id)
        queue.enqueue(job_id, kind)
    return [job_id for _, job_id in found]


def requeue_if_broker_lost(
    session_factory: sessionmaker[Session], queue: JobQueue
) -> list[uuid.UUID]:
    """When `queue`'s broker lost its messages since the last look (`BrokerWatch`), enqueue
    every queued job again now (oldest first), stamped as enqueued; returns their ids."""
    if not isinstance(queue, BrokerWatch) or not queue.broker_lost_messages():
        return []
    found: list[tuple[JobKind, uuid.UUID]] = []
    now = utcnow()
    with session_scope(session_factory) as session:
        for kind, table in JOB_TABLES.items():
            ids = queued_ids(session, table)
            if ids:
                session.execute(
                    update(table).where(table.id.in_(ids)).values(enqueued_at=now),
                    execution_options={"synchronize_session": False},
                )
            found += [(kind, job_id) for job_id in ids]
    log.warning(
        "the broker came back without its messages (restarted or flushed); enqueueing the "
        "%d queued job(s) again",
        len(found),
    )
    for kind, job_id in found:
        queue.enqueue(job_id, kind)
    return [job_id for _, job_id in found]


def advance_sweeps(session_factory: sessionmaker[Session], queue: JobQueue) -> int:
    """Move every running configurator sweep on (`services.sweeps.advance`): an optimize
    sweep nobody is reading still reaches its next round, and a sweep whose API process
    restarted carries on. Returns the number of compile jobs enqueued."""
    from app.domain.services import sweeps

    with session_scope(session_factory) as session:
        ids = sweeps.active_sweep_ids(session)
    enqueued = 0
    for sweep_id in ids:
        with session_scope(session_factory) as session:
            queued = sweeps.advance(session, sweep_id)
        for job_id in queued:
            queue.enqueue(job_id)
        enqueued += len(queued)
    return enqueued


class Sweeper:
    """A daemon thread calling `sweep_once` every `interval_s` until `stop()`."""

    def __init__(
        self,
        session_factory: sessionmaker[Session],
        queue: JobQueue,
        interval_s: float,
        *,
        stale_after_s: float = DEFAULT_STALE_AFTER_S,
        requeue_after_s: float = DEFAULT_REQUEUE_AFTER_S,
        work_root: Path | None = None,
    ) -> None:
        self._sessions = session_factory
        self._work_root = work_root
        self._queue = queue
        self._interval = interval_s
        self._stale_after_s = stale_after_s
        self._requeue_after_s = requeue_after_s
        self._stop = threading.Event()
        self.sweeps = 0
        self._thread = threading.Thread(target=self._run, name="qpcfarm-sweeper", daemon=True)

    def start(self) -> Sweeper:
        self._thread.start()
        return self

    def stop(self, timeout: float | None = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                requeue_if_broker_lost(self._sessions, self._queue)
            except Exception:  # the broker is away: asked again at the next interval
                log.warning("could not reach the broker to check its epoch", exc_info=True)
            try:
                remove_abandoned(self._work_root)
            except OSError:
                log.warning("could not remove abandoned work folders", exc_info=True)
            try:
                sweep_once(
                    self._sessions,
                    self._queue,
                    stale_after_s=self._stale_after_s,
                    requeue_after_s=self._requeue_after_s,
                )
                advance_sweeps(self._sessions, self._queue)
            except Exception:  # the database or broker is away: try at the next interval
                log.warning("sweep failed; retrying in %.0f s", self._interval, exc_info=True)
            self.sweeps += 1


def start_sweeper(
    session_factory: sessionmaker[Session],
    queue: JobQueue,
    settings: Settings,
    interval_s: float | None = None,
) -> Sweeper:
    """Start sweeping with the thresholds of `settings` (interval: `sweep_interval`)."""
    return Sweeper(
        session_factory,
        queue,
        interval_s if interval_s is not None else sweep_interval(settings),
        stale_after_s=settings.stale_after_s,
        requeue_after_s=settings.requeue_after_s,
        work_root=settings.work_dir,
    ).start()
