"""The embedded mode's worker: a few threads in the API process consuming job ids.

It is the same `process_job` the Celery workers run, fed from a `queue.Queue` instead of a
broker, and run in a child process per thread (`worker.job_process`), so that neither the
compile nor the rest of a job's work (hashing blobs, storing the QPC, the job's database
writes) takes the API process's CPU and GIL. A database the child cannot open again (an
in-memory SQLite) keeps jobs in the threads, with only the compile in a child.

The queue lives in memory, so on start it re-enqueues from the database every job that
is queued, and every running job whose heartbeat went stale (the process that ran it died):
a restart loses nothing. It also removes the work folders that killed jobs left behind
(`worker.workdirs`). With `reap_interval_s` it also reaps for itself (only it can run
the embedded mode's jobs), re-taking jobs whose message was lost or whose thread died.
"""

from __future__ import annotations

import logging
import queue
import threading
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from sqlalchemy.orm import Session, sessionmaker

from app.domain.blobs import BlobStore
from app.domain.compilers import Compiler
from app.domain.db.session import session_scope
from app.domain.job_kinds import JOB_KINDS
from app.domain.queue import JobKind
from app.domain.services.limits import Limits
from app.domain.timing import HEARTBEAT_S, REQUEUE_AFTER_S, STALE_AFTER_S
from worker.advertise import Advertiser
from worker.claims import queued_ids, stale_ids
from worker.compile_process import CompileProcess
from worker.fair_share import WINDOW_S
from worker.job_process import JobProcess, JobProcessConfig
from worker.reaper import Reaper
from worker.runner import default_worker_name, process_job
from worker.workdirs import remove_abandoned

log = logging.getLogger(__name__)

_STOP = object()
"""Sentinel put once per thread by `close`."""


class InProcessQueue:
    """A `JobQueue` (see app.domain.queue) run by `concurrency` daemon threads of this process;
    its items are (kind, job id)."""

    def __init__(
        self,
        session_factory: sessionmaker[Session],
        store: BlobStore,
        *,
        concurrency: int = 1,
        heartbeat_s: float = HEARTBEAT_S,
        stale_after_s: float = STALE_AFTER_S,
        requeue_after_s: float = REQUEUE_AFTER_S,
        reap_interval_s: float | None = None,
        isolate_compiles: bool = True,
        job_process: JobProcessConfig | None = None,
        compile_limits: Limits | None = None,
        work_root: Path | None = None,
        compilers: Sequence[Compiler] | None = None,
        collector: Callable[[], object] | None = None,
        collect_interval_s: float = 0.0,
        fair_share_window_s: float = WINDOW_S,
    ) -> None:
        self._fair_share_window_s = fair_share_window_s
        self._collector = collector
        self._collect_interval_s = collect_interval_s
        self._sessions = session_factory
        self._compilers = list(compilers or [])
        """Advertised while the queue runs (`worker.advertise`): what a job may name here."""
        self._advertiser: Advertiser | None = None
        self._store = store
        self._concurrency = max(1, concurrency)
        self._heartbeat_s = heartbeat_s
        self._stale_after_s = stale_after_s
        self._requeue_after_s = requeue_after_s
        self._ids: queue.Queue[object] = queue.Queue()
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._reap_interval_s = reap_interval_s
        self._reaper: Reaper | None = None
        self._isolate = isolate_compiles
        """Each thread compiles in a child process of its own (`worker.compile_process`): the
        API's process keeps its CPU and GIL for requests."""
        self._job_config = job_process
        """Given: each thread runs whole jobs in a child process of its own, which opens the
        same database and store again (`worker.job_process`; `queue_from_settings` gives it)."""
        self._compile_limits = compile_limits or (
            job_process.compile_limits if job_process is not None else Limits()
        )
        self._work_root = work_root

    @property
    def isolated(self) -> bool:
        """Whether jobs run in child processes (else in the threads, compiles in children)."""
        return self._job_config is not None

    def start(self) -> InProcessQueue:
        """Re-enqueue what the database says is pending, then start the threads."""
        if self._threads:
            return self
        try:
            remove_abandoned(self._work_root)
        except OSError:  # a folder we may not remove: the reaper tries again
            log.warning("could not remove abandoned work folders", exc_info=True)
        for item in self.recover():
            self._ids.put(item)
        for index in range(self._concurrency):
            thread = threading.Thread(
                target=self._run,
                args=(default_worker_name(f"inproc-{index}"),),
                name=f"qpcfarm-worker-{index}",
                daemon=True,
            )
            thread.start()
            self._threads.append(thread)
        if self._reap_interval_s is not None:
            self._reaper = Reaper(
                self._sessions,
                self,
                self._reap_interval_s,
                stale_after_s=self._stale_after_s,
                requeue_after_s=self._requeue_after_s,
                work_root=self._work_root,
                collector=self._collector,
                collect_interval_s=self._collect_interval_s,
            ).start()
        if self._compilers:
            self._advertiser = Advertiser(
                self._sessions,
                default_worker_name("inproc"),
                self._compilers,
                stale_after_s=self._stale_after_s,
            ).start()
        return self

    def recover(self) -> list[tuple[JobKind, uuid.UUID]]:
        """(kind, id) of the jobs to run after a restart: all queued compiles (oldest first)
        and profiles, then the running ones presumed dead (`claims.stale_ids`)."""
        queued: list[tuple[JobKind, uuid.UUID]] = []
        stale: list[tuple[JobKind, uuid.UUID]] = []
        with session_scope(self._sessions) as session:
            for kind, spec in JOB_KINDS.items():
                queued += [(kind, i) for i in queued_ids(session, spec.table)]
            for kind, spec in JOB_KINDS.items():
                ids = stale_ids(
                    session,
                    spec.table,
                    stale_after_s=self._stale_after_s,
                    requeue_after_s=self._requeue_after_s,
                )
                stale += [(kind, i) for i in ids]
        seen = set(queued)
        return queued + [item for item in stale if item not in seen]

    def enqueue(self, job_id: uuid.UUID, kind: JobKind = "compile") -> None:
        if self._closed:
            raise RuntimeError("the in-process job queue is closed")
        self._ids.put((kind, job_id))

    def ping(self) -> bool:
        """True while every worker thread is alive."""
        return (
            not self._closed
            and bool(self._threads)
            and all(thread.is_alive() for thread in self._threads)
        )

    def pending(self) -> int:
        """Job ids waiting for a thread (approximate)."""
        return self._ids.qsize()

    def close(self, timeout: float | None = 5.0) -> None:
        """Stop taking jobs and wait up to `timeout` s for running compiles. A compile still
        running then is left to its daemon thread; its job is picked up again after a restart
        (its heartbeat goes stale)."""
        if self._closed:
            return
        self._closed = True
        if self._reaper is not None:
            self._reaper.stop()
        if self._advertiser is not None:
            self._advertiser.stop()
        for _ in self._threads:
            self._ids.put(_STOP)
        for thread in self._threads:
            thread.join(timeout)

    def _run(self, worker_name: str) -> None:
        if self._job_config is not None:
            jobs = JobProcess(self._job_config, self._sessions)
            try:
                jobs.start()  # its imports now, not in the first job's latency
            except Exception:  # tried again for each job; a job meanwhile stays queued
                log.exception("the job process of %s did not start", worker_name)
            try:
                self._serve(worker_name, None, jobs)
            finally:
                jobs.close()
            return
        compiler = CompileProcess(self._compile_limits) if self._isolate else None
        try:
            self._serve(worker_name, compiler, None)
        finally:
            if compiler is not None:
                compiler.close()

    def _serve(
        self, worker_name: str, compiler: CompileProcess | None, jobs: JobProcess | None
    ) -> None:
        while True:
            item = self._ids.get()
            if item is _STOP or self._closed:  # left queued in the database for a restart
                return
            assert isinstance(item, tuple)
            kind, job_id = item
            try:
                if jobs is not None:
                    jobs.run(kind, job_id, worker_name)
                    continue
                process_job(
                    job_id,
                    kind=kind,
                    compiler=compiler,
                    session_factory=self._sessions,
                    store=self._store,
                    worker_name=worker_name,
                    heartbeat_s=self._heartbeat_s,
                    stale_after_s=self._stale_after_s,
                    work_root=self._work_root,
                    fair_share_window_s=self._fair_share_window_s,
                )
            except Exception:  # a database outage: the reaper re-enqueues the job later
                log.exception("%s %s: worker error; the reaper will retry it", kind, job_id)
