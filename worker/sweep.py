"""The sweep: re-enqueue jobs whose message was lost or whose worker died.

The broker only carries job ids; the database says which jobs still need a worker
(`jobs.stale_jobs`: queued too long since their last enqueue, or running with a stale
heartbeat). Any number of sweepers may run (every API process, optionally every Celery worker):
`stale_jobs` stamps what it returns so the next sweep leaves it alone for a while, and a
duplicate message is harmless because `claim` is conditional.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import uuid
from typing import TYPE_CHECKING

from sqlalchemy.orm import Session, sessionmaker

from app.db.session import session_scope
from app.services import jobs, profiles

if TYPE_CHECKING:
    from app.queue import JobQueue
    from app.settings import Settings

log = logging.getLogger(__name__)


def sweep_interval(settings: Settings) -> float:
    """How often to sweep: a third of the stale threshold (a dead worker's job restarts within
    ~1.3x `stale_after_s`), between 1 and 30 s."""
    return max(1.0, min(30.0, settings.stale_after_s / 3))


def sweep_once(
    session_factory: sessionmaker[Session],
    queue: JobQueue,
    now: dt.datetime | None = None,
    *,
    stale_after_s: float = jobs.DEFAULT_STALE_AFTER_S,
    requeue_after_s: float = jobs.DEFAULT_REQUEUE_AFTER_S,
) -> list[uuid.UUID]:
    """Enqueue the stale jobs (compiles and profiles) again, committed first, then enqueued;
    returns their ids."""
    with session_scope(session_factory) as session:
        ids = jobs.stale_jobs(
            session, now, stale_after_s=stale_after_s, requeue_after_s=requeue_after_s
        )
        ids += profiles.pending_ids(
            session, now, stale_after_s=stale_after_s, requeue_after_s=requeue_after_s
        )
    for job_id in ids:
        log.warning("sweep: job %s looks lost or its worker died; enqueueing it again", job_id)
        queue.enqueue(job_id)
    return ids


class Sweeper:
    """A daemon thread calling `sweep_once` every `interval_s` until `stop()`."""

    def __init__(
        self,
        session_factory: sessionmaker[Session],
        queue: JobQueue,
        interval_s: float,
        *,
        stale_after_s: float = jobs.DEFAULT_STALE_AFTER_S,
        requeue_after_s: float = jobs.DEFAULT_REQUEUE_AFTER_S,
    ) -> None:
        self._sessions = session_factory
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
                sweep_once(
                    self._sessions,
                    self._queue,
                    stale_after_s=self._stale_after_s,
                    requeue_after_s=self._requeue_after_s,
                )
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
    ).start()
