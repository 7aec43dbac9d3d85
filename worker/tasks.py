"""The Celery tasks, one per kind of job (`qpcfarm.compile`, `qpcfarm.profile`): a job id in,
`worker.runner.process_job` on it.

The message carries only the id; the task re-reads the row and the logic lives in the
runner. Only named transient database errors are retried (with backoff); any other error of
a compile is stored on the job by the runner. Database engines, the blob store and the
compile child (`worker.compile_process`: compiles run there, under the farm's memory and
time limits, never in the Celery process itself) are built per process on first use (a
prefork child never reuses its parent's connections or children). A worker's start removes
the work folders that killed jobs left behind (`worker.workdirs`).
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from app.domain.db.faults import DATABASE_FAULTS
from app.domain.job_kinds import JOB_KINDS
from app.domain.queue import JobKind

if TYPE_CHECKING:
    from celery import Celery
    from sqlalchemy.orm import Session

    from app.domain.blobs import BlobStore
    from app.domain.farm import Farm
    from app.domain.settings import Settings
    from worker.compile_process import CompileProcess

log = logging.getLogger(__name__)

TRANSIENT_ERRORS: tuple[type[Exception], ...] = DATABASE_FAULTS
"""Database errors worth retrying: the server restarting, a dropped connection, a full pool."""


@dataclass
class _Resources:
    pid: int
    farm: Farm
    compiler: CompileProcess

    @property
    def session_factory(self) -> Callable[[], Session]:
        return self.farm.sessions

    @property
    def store(self) -> BlobStore:
        return self.farm.store


class ProcessResources:
    """The database session factory, blob store and compile child of the current process,
    rebuilt after a fork (Celery's prefork children each get their own)."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._lock = threading.Lock()
        self._current: _Resources | None = None

    def get(self) -> _Resources:
        with self._lock:
            pid = os.getpid()
            if self._current is None or self._current.pid != pid:
                self._current = self._build(pid)
            return self._current

    def _build(self, pid: int) -> _Resources:
        from app.domain.farm import open_farm
        from app.domain.services.limits import compile_limits
        from worker.compile_process import CompileProcess

        return _Resources(
            pid,
            open_farm(self._settings),
            CompileProcess(compile_limits(self._settings)).start(),
        )


def register_tasks(app: Celery, settings: Settings) -> dict[str, Any]:
    """Add one task per kind of job to `app` (`qpcfarm.compile`, `qpcfarm.profile`); returns
    them by kind. A compile task given a profile's id (a message from before the kinds had
    tasks of their own) looks the kind up."""
    from celery import signals

    from worker.runner import default_worker_name, process_job
    from worker.workdirs import remove_abandoned

    resources = ProcessResources(settings)

    def clean_work_folders(**_: Any) -> None:
        remove_abandoned(settings.work_dir)

    signals.worker_init.connect(clean_work_folders, weak=False, dispatch_uid="qpcfarm-workdirs")

    def make(kind: JobKind) -> Any:
        @app.task(
            name=JOB_KINDS[kind].task_name,
            acks_late=True,
            ignore_result=True,
            autoretry_for=TRANSIENT_ERRORS,
            retry_backoff=True,
            retry_backoff_max=60,
            retry_jitter=True,
            max_retries=5,
        )
        def run(job_id: str) -> str | None:
            try:
                parsed = uuid.UUID(job_id)
            except (ValueError, TypeError):
                log.error("ignoring a message with a malformed job id %r", job_id)
                return None
            current = resources.get()
            status = process_job(
                parsed,
                session_factory=current.session_factory,
                store=current.store,
                worker_name=default_worker_name("celery"),
                kind=None if kind == "compile" else kind,
                heartbeat_s=settings.heartbeat_s,
                stale_after_s=settings.stale_after_s,
                compiler=current.compiler,
                work_root=settings.work_dir,
                fair_share_window_s=settings.fair_share_window_s,
            )
            return None if status is None else status.value

        return run

    return {kind: make(kind) for kind in JOB_KINDS}
