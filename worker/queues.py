"""The job queues: Celery over a broker (the farm) or threads of the API process (embedded),
built from settings. Both carry ids only; the database row is the job."""

from __future__ import annotations

import logging
import uuid
from typing import TYPE_CHECKING

from app.domain.queue import JobKind, JobQueue

if TYPE_CHECKING:
    from celery import Celery
    from sqlalchemy.orm import Session, sessionmaker

    from app.domain.blobs import BlobStore
    from app.domain.settings import Settings

log = logging.getLogger(__name__)

BROKER_EPOCH_KEY = "qpcfarm:broker-epoch"
"""The Redis key holding the run_id of the broker the farm's messages were sent to."""


class CeleryQueue:
    """Sends `qpcfarm.compile(id)` or `qpcfarm.profile(id)` through the Celery broker of
    `settings.broker_url`. With a `session_factory`, a compile job that names a compiler goes
    to that compiler's queue (`app.domain.compilers.queue_name`: only workers having it
    consume it), looked up in its row; every other message goes to the default queue."""

    def __init__(
        self, settings: Settings, session_factory: sessionmaker[Session] | None = None
    ) -> None:
        from worker.celery_app import make_celery_app

        self._sessions = session_factory
        self._app = make_celery_app(settings)
        # The broker's transport (kombu's redis transport, the redis client) is imported on
        # the first send: here, at start-up, instead of holding the GIL inside the first
        # submit while the other requests wait. A kombu Connection connects only when used.
        self._app.connection_for_write().release()

    @property
    def celery(self) -> Celery:
        return self._app

    def enqueue(self, job_id: uuid.UUID, kind: JobKind = "compile") -> None:
        from app.domain.job_kinds import JOB_KINDS

        try:
            queue = self._queue_of(job_id, kind)
            self._app.send_task(JOB_KINDS[kind].task_name, args=[str(job_id)], queue=queue)
        except Exception:  # broker down: the job stays queued and the reaper sends it later
            log.warning(
                "could not enqueue %s %s; the reaper will retry", kind, job_id, exc_info=True
            )

    def _queue_of(self, job_id: uuid.UUID, kind: JobKind) -> str | None:
        """The queue of the compiler a compile job names, or that made the QPC a profile job
        runs (a vendor QPC needs a worker with the SDK); None: the default queue."""
        if self._sessions is None:
            return None
        from sqlalchemy import select

        from app.domain.compilers import QAIC, Compiler, parse, queue_name
        from app.domain.db.models import CompileJob, ProfileJob, Qpc

        if kind == "compile":
            query = select(CompileJob.compiler).where(CompileJob.id == job_id)
        else:
            query = select(Qpc.compiler_version).join(ProfileJob, ProfileJob.qpc_id == Qpc.id)
            query = query.where(ProfileJob.id == job_id)
        with self._sessions() as session:
            named = session.execute(query).scalar_one_or_none()
        if not named or (kind != "compile" and not named.startswith(f"{QAIC}@")):
            return None
        backend, version = parse(named)
        return queue_name(Compiler(backend, version or ""))

    def broker_lost_messages(self) -> bool:
        """Whether the Redis broker restarted or lost its keys since any reaper last looked
        (`app.domain.queue.BrokerWatch`). The broker's epoch is its `run_id` (new at every start),
        kept under `BROKER_EPOCH_KEY`: a restart changes the run_id, a flush removes the key.
        GETSET makes exactly one reaper of the farm see each change. Other brokers: False
        (the requeue threshold covers them)."""
        with self._app.connection_for_write() as connection:
            if connection.transport.driver_type != "redis":
                return False
            client = connection.default_channel.client
            run_id = str(client.info("server")["run_id"])
            previous = client.getset(BROKER_EPOCH_KEY, run_id)
        if isinstance(previous, bytes):
            previous = previous.decode()
        return previous != run_id

    def ping(self) -> bool:
        try:
            with self._app.connection_for_write() as connection:
                connection.ensure_connection(max_retries=1, timeout=2)
            return True
        except Exception:
            return False

    def close(self) -> None:
        self._app.close()


def queue_from_settings(
    settings: Settings, session_factory: sessionmaker[Session], store: BlobStore
) -> JobQueue:
    """The configured queue: Celery when a broker URL is set, else a started in-process
    worker (which re-enqueues the database's pending jobs as it starts, reaps for itself,
    and runs each job in a child process that opens `settings.database_url` and the store
    again). In farm mode the reaper runs in `qpcfarm serve` and in every `qpcfarm worker`."""
    if settings.broker_url:
        return CeleryQueue(settings, session_factory)
    from app.domain.compilers import local_compilers
    from app.domain.services.limits import compile_limits
    from worker.inprocess import InProcessQueue
    from worker.job_process import config_for
    from worker.reaper import collector_for, reap_interval

    return InProcessQueue(
        session_factory,
        store,
        concurrency=settings.worker_concurrency,
        heartbeat_s=settings.heartbeat_s,
        stale_after_s=settings.stale_after_s,
        requeue_after_s=settings.requeue_after_s,
        reap_interval_s=reap_interval(settings),
        job_process=config_for(settings, store),
        compile_limits=compile_limits(settings),
        work_root=settings.work_dir,
        compilers=local_compilers(settings),
        collector=collector_for(settings, session_factory, store),
        collect_interval_s=settings.gc_interval_s,
        fair_share_window_s=settings.fair_share_window_s,
    ).start()
