"""The reaper: hand out again the jobs whose message was lost or whose worker died. (Not the
configurator's sweeps, `app.domain.services.sweeps`, which the reaper also moves on.)

The broker only carries job ids; the database says which jobs still need a worker
(`claims.stale_ids`: queued too long since their last enqueue, or running with a stale
heartbeat). Any number of reapers may run (every API process, optionally every Celery worker):
`stale_jobs` stamps what it returns so the next reap leaves it alone for a while, and a
duplicate message is harmless because `claim` is conditional.

A broker that comes back without its messages (a Redis restart without persistence, a flush)
is noticed by the next reap (`app.domain.queue.BrokerWatch`), which then enqueues every queued job
at once instead of waiting `requeue_after_s` for each (workers would idle meanwhile). Each
round also removes the work folders of killed jobs (`worker.workdirs`).
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import update
from sqlalchemy.orm import Session, sessionmaker

from app.domain import timing
from app.domain.db.base import utcnow
from app.domain.db.session import session_scope
from app.domain.job_kinds import JOB_KINDS
from app.domain.queue import BrokerWatch, JobKind, commit_then_enqueue
from app.domain.timing import REQUEUE_AFTER_S, STALE_AFTER_S
from worker import fair_share
from worker.claims import queued_ids, stale_ids
from worker.workdirs import remove_abandoned

if TYPE_CHECKING:
    from app.domain.blobs import BlobStore
    from app.domain.queue import JobQueue
    from app.domain.settings import Settings

log = logging.getLogger(__name__)


def reap_interval(settings: Settings) -> float:
    """How often to reap (`timing.reap_interval` of the settings' stale threshold)."""
    return timing.reap_interval(settings.stale_after_s)


def reap_once(
    session_factory: sessionmaker[Session],
    queue: JobQueue,
    now: dt.datetime | None = None,
    *,
    stale_after_s: float = STALE_AFTER_S,
    requeue_after_s: float = REQUEUE_AFTER_S,
) -> list[uuid.UUID]:
    """Enqueue the stale jobs of every kind again, and the compiles a running quota held back
    that may start now (`fair_share.held_back_ids`), committed first, then enqueued; returns
    their ids."""
    found: list[tuple[JobKind, uuid.UUID]] = []
    with session_scope(session_factory) as session:
        for kind, spec in JOB_KINDS.items():
            ids = stale_ids(
                session,
                spec.table,
                now,
                stale_after_s=stale_after_s,
                requeue_after_s=requeue_after_s,
            )
            found += [(kind, job_id) for job_id in ids]
        held = fair_share.held_back_ids(session, now, quiet_s=timing.reap_interval(stale_after_s))
    for kind, job_id in found:
        log.warning(
            "reaper: %s %s looks lost or its worker died; enqueueing it again", kind, job_id
        )
        queue.enqueue(job_id, kind)
    for job_id in held:  # its team's running quota has room again
        queue.enqueue(job_id, "compile")
    return [job_id for _, job_id in found] + held


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
        for kind, spec in JOB_KINDS.items():
            table: Any = spec.table
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
        with session_factory() as session:
            queued = sweeps.advance(session, sweep_id)
            commit_then_enqueue(session, queue, queued)
        enqueued += len(queued)
    return enqueued


class Reaper:
    """A daemon thread calling `reap_once` every `interval_s` until `stop()`."""

    def __init__(
        self,
        session_factory: sessionmaker[Session],
        queue: JobQueue,
        interval_s: float,
        *,
        stale_after_s: float = STALE_AFTER_S,
        requeue_after_s: float = REQUEUE_AFTER_S,
        work_root: Path | None = None,
        collector: Callable[[], object] | None = None,
        collect_interval_s: float = 0.0,
    ) -> None:
        self._collector = collector
        """Retention's collector (`services.retention.collect` bound to the farm), run every
        `collect_interval_s` (0: never) by this reaper."""
        self._collect_interval_s = collect_interval_s
        self._last_collect = time.monotonic()
        self._sessions = session_factory
        self._work_root = work_root
        self._queue = queue
        self._interval = interval_s
        self._stale_after_s = stale_after_s
        self._requeue_after_s = requeue_after_s
        self._stop = threading.Event()
        self.rounds = 0
        self._thread = threading.Thread(target=self._run, name="qpcfarm-reaper", daemon=True)

    def start(self) -> Reaper:
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
                reap_once(
                    self._sessions,
                    self._queue,
                    stale_after_s=self._stale_after_s,
                    requeue_after_s=self._requeue_after_s,
                )
                advance_sweeps(self._sessions, self._queue)
            except Exception:  # the database or broker is away: try at the next interval
                log.warning("reaping failed; retrying in %.0f s", self._interval, exc_info=True)
            self._maybe_collect()
            self.rounds += 1

    def _maybe_collect(self) -> None:
        if self._collector is None or self._collect_interval_s <= 0:
            return
        if time.monotonic() - self._last_collect < self._collect_interval_s:
            return
        self._last_collect = time.monotonic()
        try:
            self._collector()
        except Exception:  # the database or store is away: at the next interval
            log.warning("retention's collector failed", exc_info=True)


def start_reaper(
    session_factory: sessionmaker[Session],
    queue: JobQueue,
    settings: Settings,
    interval_s: float | None = None,
) -> Reaper:
    """Start reaping with the thresholds of `settings` (interval: `reap_interval`)."""
    return Reaper(
        session_factory,
        queue,
        interval_s if interval_s is not None else reap_interval(settings),
        stale_after_s=settings.stale_after_s,
        requeue_after_s=settings.requeue_after_s,
        work_root=settings.work_dir,
        collector=collector_for(settings, session_factory),
        collect_interval_s=settings.gc_interval_s,
    ).start()


def collector_for(
    settings: Settings, session_factory: sessionmaker[Session], store: BlobStore | None = None
) -> Callable[[], object]:
    """Retention's collector over the farm's database and blob store (built on first use)."""
    from app.domain.blobs import blob_store_from_settings
    from app.domain.services import retention

    def run() -> object:
        blobs = store if store is not None else blob_store_from_settings(settings, session_factory)
        with session_factory() as session:
            return retention.collect(session, blobs, default_days=settings.retention_days)

    return run
