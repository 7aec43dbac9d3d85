"""Run one job by kind and id: the whole of a worker's job, shared by Celery and the
in-process worker.

The job row is the truth. `process_job` claims the job (a conditional UPDATE: a duplicate
message, a finished or cancelled job, or one another live worker holds, gets None and nothing
happens), runs it while a heartbeat thread keeps the row fresh, and stores the outcome
(`worker.compile_jobs`, `worker.profile_jobs`). After `MAX_ATTEMPTS` claims whose workers
died, the job fails `worker_lost` instead of being run again.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Callable
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.domain.blobs import BlobStore
from app.domain.db.models import JobStatus, ProfileJob
from app.domain.queue import JobKind
from worker import compile_jobs, profile_jobs
from worker.claims import DEFAULT_HEARTBEAT_S, DEFAULT_STALE_AFTER_S
from worker.compile_process import CompileProcess

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 3
"""Claims a job may take before it is failed as `worker_lost`: a model that kills its worker
(out of memory, a crash) must not be retried by the sweep forever."""

PROGRESS_INTERVAL_S = 0.5


def default_worker_name(suffix: str = "") -> str:
    """`host:pid[:suffix]`: where a running job is, for people and for the logs."""
    name = f"{socket.gethostname()}:{os.getpid()}"
    return f"{name}:{suffix}" if suffix else name


def kind_of(session: Session, job_id: uuid.UUID) -> JobKind:
    """The kind of a job id (messages sent before each kind had its own task carried a
    profile's id to the compile task)."""
    found = session.execute(
        select(ProfileJob.id).where(ProfileJob.id == job_id)
    ).scalar_one_or_none()
    session.commit()
    return "profile" if found is not None else "compile"


def process_job(
    job_id: uuid.UUID,
    *,
    session_factory: Callable[[], Session],
    store: BlobStore,
    worker_name: str,
    kind: JobKind | None = None,
    heartbeat_s: float = DEFAULT_HEARTBEAT_S,
    stale_after_s: float = DEFAULT_STALE_AFTER_S,
    progress_interval_s: float = PROGRESS_INTERVAL_S,
    max_attempts: int = MAX_ATTEMPTS,
    progress_cb: compile_jobs.ProgressCallback | None = None,
    compiler: CompileProcess | None = None,
    work_root: Path | None = None,
) -> JobStatus | None:
    """Claim and run job `job_id` of `kind` (None: looked up); returns its final status, or
    None when this call did not get the job (unknown, finished, cancelled, or running on a
    live worker).

    With `compiler`, a compile runs in that child process, under its limits, instead of
    this one (every worker passes one; tests may compile in process). The job's files live
    in a private folder under `work_root` (`worker.workdirs`). Transient database errors
    while claiming propagate (the Celery task retries them); every
    error of the work itself ends the job `failed` with a structured error.
    """
    session = session_factory()
    try:
        if kind is None:
            kind = kind_of(session, job_id)
        if kind == "profile":
            return _profile(session, job_id, session_factory, store, worker_name, heartbeat_s,
                            stale_after_s, max_attempts, work_root)  # fmt: skip
        job = compile_jobs.claim(session, job_id, worker_name, stale_after_s=stale_after_s)
        if job is None:
            log.info("job %s: not claimable (finished, cancelled or taken); skipped", job_id)
            return None
        if job.attempts > max_attempts:
            compile_jobs.fail(session, job, "worker_lost", _lost(job.attempts, "compiling"),
                              {"attempts": job.attempts - 1})  # fmt: skip
            return job.status
        log.info("job %s: claimed by %s (attempt %d)", job_id, worker_name, job.attempts)
        with compile_jobs.heartbeat(session_factory, job, heartbeat_s) as beat:
            compile_jobs.run_compile(
                session,
                store,
                job,
                progress_cb,
                beat.stop_requested,
                progress_interval_s=progress_interval_s,
                compiler=compiler,
                work_root=work_root,
            )
        log.info("job %s: %s", job_id, job.status.value)
        return job.status
    finally:
        session.close()


def _lost(attempts: int, doing: str) -> str:
    return (
        f"the job's worker stopped {attempts - 1} times while {doing} it; giving up (the "
        "model may need more memory than a worker has)"
    )


def _profile(
    session: Session,
    job_id: uuid.UUID,
    session_factory: Callable[[], Session],
    store: BlobStore,
    worker_name: str,
    heartbeat_s: float,
    stale_after_s: float,
    max_attempts: int,
    work_root: Path | None,
) -> JobStatus | None:
    job = profile_jobs.claim(session, job_id, worker_name, stale_after_s=stale_after_s)
    if job is None:
        log.info("profile %s: not claimable (finished or taken); skipped", job_id)
        return None
    if job.attempts > max_attempts:
        profile_jobs.fail(session, job, "worker_lost", _lost(job.attempts, "running"),
                          {"attempts": job.attempts - 1})  # fmt: skip
        return job.status
    log.info("profile %s: claimed by %s (attempt %d)", job_id, worker_name, job.attempts)
    with profile_jobs.heartbeat(session_factory, job, heartbeat_s):
        profile_jobs.run_profile(session, store, job, work_root)
    log.info("profile %s: %s", job_id, job.status.value)
    return job.status
