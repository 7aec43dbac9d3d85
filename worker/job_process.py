"""Whole jobs in a process of their own, for the worker threads that live in the API's process.

The embedded mode runs its job queue inside `qpcfarm serve`. A job is more than its compile:
claiming it, writing its stage and heartbeat, checking the model blob's sha256, storing and
hashing the QPC, reading its requirements back, recording the result: measured under a burst
of submits, that work held more than half of the API process's GIL time besides the compile.
So each worker thread owns one child process (spawned once, reused, at a lower CPU priority)
that runs `worker.runner.process_job` with its own database engine and blob store, exactly as
a Celery worker would; the thread only hands it job ids and waits. The compile itself runs one
level further down, in the job process's own `CompileProcess` under the farm's memory and
time limits, as in a Celery worker.

The job row stays the truth: the child claims, beats and finishes the job through the
database, and a cancel reaches it there. A child that dies mid-job (a crash, the OOM killer)
is replaced; the job it held is failed at once (`compiler_crashed` for a compile,
`worker_crashed` for a profile) if it is still running under the child's worker name, and a
job whose claim the child never wrote stays queued for the next one. SQLite writers of the
two processes take turns on one file lock (`app.domain.db.session.WriterLock`).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Literal

from sqlalchemy import update
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

from app.domain.blobs import BlobStore
from app.domain.queue import JobKind
from app.domain.services.limits import Limits, compile_limits
from worker.fair_share import WINDOW_S

if TYPE_CHECKING:
    from app.domain.settings import Settings

log = logging.getLogger(__name__)

NICENESS = 10
"""How much lower than the API the child runs: requests get the CPU first, jobs the rest."""


@dataclass(frozen=True)
class JobProcessConfig:
    """What a child needs to open the same farm: database URL, blob store, job timings."""

    database_url: str
    store_kind: Literal["filesystem", "database"]
    store_root: str | None
    """The filesystem store's folder (None for the database store, which uses the database
    through a pool of its own, as in the API)."""
    heartbeat_s: float
    stale_after_s: float
    compile_limits: Limits = Limits()
    """The limits of the job process's compile child (`app.domain.services.limits`)."""
    work_root: str | None = None
    """Where job folders go (`worker.workdirs`; None: the default)."""
    fair_share_window_s: float = WINDOW_S
    """The look-back of `worker.fair_share` (the farm's `fair_share_window_s`)."""


def config_for(settings: Settings, store: BlobStore) -> JobProcessConfig | None:
    """The config that opens the configured database and this store again in a child, or
    None when that cannot be done (an in-memory SQLite, a store of another kind): jobs then
    run in the worker threads themselves."""
    from app.domain.blobs.database import DatabaseBlobStore
    from app.domain.blobs.filesystem import FilesystemBlobStore

    url = make_url(settings.database_url)
    if url.get_backend_name() == "sqlite" and url.database in (None, "", ":memory:"):
        return None
    if isinstance(store, FilesystemBlobStore):
        kind: Literal["filesystem", "database"] = "filesystem"
        root: str | None = str(store.root)
    elif isinstance(store, DatabaseBlobStore):
        kind, root = "database", None
    else:
        return None
    return JobProcessConfig(
        settings.database_url,
        kind,
        root,
        settings.heartbeat_s,
        settings.stale_after_s,
        compile_limits(settings),
        None if settings.work_dir is None else str(settings.work_dir),
        settings.fair_share_window_s,
    )


def _child_main(conn: Connection, config: JobProcessConfig) -> None:
    """The child's loop: one job per request, until the pipe closes."""
    try:
        os.nice(NICENESS)
    except OSError:  # not permitted here: same priority as the API
        pass
    from pathlib import Path

    from app.domain.farm import open_farm
    from app.domain.settings import Settings
    from worker.compile_process import CompileProcess
    from worker.runner import process_job

    farm = open_farm(
        Settings(database_url=config.database_url, blob_store=config.store_kind),
        blob_root=None if config.store_root is None else Path(config.store_root),
    )
    sessions, store = farm.sessions, farm.store

    compiler = CompileProcess(config.compile_limits).start()
    work_root = None if config.work_root is None else Path(config.work_root)
    conn.send(("ready",))
    while True:
        try:
            kind, job_id, worker_name = conn.recv()
        except EOFError:
            return
        try:
            status = process_job(
                uuid.UUID(job_id),
                kind=kind,
                session_factory=sessions,
                store=store,
                worker_name=worker_name,
                heartbeat_s=config.heartbeat_s,
                stale_after_s=config.stale_after_s,
                compiler=compiler if kind == "compile" else None,
                work_root=work_root,
                fair_share_window_s=config.fair_share_window_s,
            )
            conn.send(("done", None if status is None else status.value))
        except Exception as exc:  # noqa: BLE001 - a database outage: the reaper retries the job
            log.exception("%s %s: worker error; the reaper will retry it", kind, job_id)
            conn.send(("error", type(exc).__name__))


class JobProcess:
    """One child job process, started on first use and replaced when it dies."""

    def __init__(self, config: JobProcessConfig, session_factory: Callable[[], Session]) -> None:
        self._config = config
        self._sessions = session_factory
        self._ctx = multiprocessing.get_context("spawn")
        self._process: Any = None
        self._conn: Connection | None = None
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        return None if self._process is None else int(self._process.pid)

    def start(self) -> JobProcess:
        """Spawn the child now (its imports take a while) and wait until it is ready."""
        with self._lock:
            self._ensure()
        return self

    def _ensure(self) -> Connection:
        if self._process is None or not self._process.is_alive():
            self._kill()
            parent, child = self._ctx.Pipe()
            self._process = self._ctx.Process(
                target=_child_main,
                args=(child, self._config),
                name="qpcfarm-jobs",
                daemon=True,
            )
            self._process.start()
            child.close()
            self._conn = parent
            try:
                parent.recv()  # ("ready",): the child opened the database and the store
            except (EOFError, OSError):
                code = self._process.exitcode
                self._kill()
                raise RuntimeError(f"the job process exited while starting (code {code})") from None
        assert self._conn is not None
        return self._conn

    def run(self, kind: JobKind, job_id: uuid.UUID, worker_name: str) -> str | None:
        """Run job `job_id` in the child; its final status (None: not this worker's to run).
        A child that dies fails the job it held (see the module's docstring)."""
        with self._lock:
            conn = self._ensure()
            try:
                conn.send((kind, str(job_id), worker_name))
                message = conn.recv()
            except (EOFError, OSError):
                code = self._process.exitcode if self._process is not None else None
                self._kill()
                self._fail_crashed(kind, job_id, worker_name, code)
                return "failed"
            if message[0] == "error":
                raise RuntimeError(f"the job process failed on {kind} {job_id} ({message[1]})")
            return message[1]  # type: ignore[no-any-return]

    def _fail_crashed(
        self, kind: JobKind, job_id: uuid.UUID, worker_name: str, exit_code: int | None
    ) -> None:
        from app.domain.db.base import utcnow
        from app.domain.db.models import JobStatus
        from app.domain.db.session import unit_of_work
        from app.domain.job_kinds import JOB_KINDS

        spec = JOB_KINDS[kind]
        table: Any = spec.table
        message = (
            f"the worker process died (exit code {exit_code}) while {spec.doing} the job; "
            "the model may need more memory than the farm has"
        )
        log.error("%s %s: %s", kind, job_id, message)
        with self._sessions() as session, unit_of_work(session):
            session.execute(
                update(table)
                .where(
                    table.id == job_id,
                    table.status == JobStatus.running,
                    table.worker == worker_name[:255],
                )
                .values(
                    status=JobStatus.failed,
                    error_code=spec.crash_code,
                    error_message=message,
                    error_detail={"exit_code": exit_code},
                    finished_at=utcnow(),
                ),
                execution_options={"synchronize_session": False},
            )

    def _kill(self) -> None:
        if self._process is not None and self._process.is_alive():
            self._process.kill()
            self._process.join(5)
        if self._conn is not None:
            self._conn.close()
        self._process = self._conn = None

    def close(self, timeout: float = 2.0) -> None:
        """Close the pipe: the child ends after the job it is running (killed after
        `timeout` s; a job it held is then re-taken after a restart, its heartbeat stale)."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
            if self._process is not None:
                self._process.join(timeout)
                if self._process.is_alive():
                    self._process.kill()
                    self._process.join(5)
            self._process = self._conn = None
