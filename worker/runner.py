"""Run one compile job by id: the whole of a worker's job, shared by Celery and the in-process
worker.

The job row is the truth. `process_job` claims the job (a conditional UPDATE: a duplicate
message, a finished or cancelled job, or one another live worker holds, gets None and nothing
happens), compiles it while a heartbeat thread keeps the row fresh, and stores the outcome.
Stage and progress are written as the compiler reports them (every stage change, otherwise at
most every `progress_interval_s`); a cancel, or losing the job to another worker, stops the
compile at its next progress report or heartbeat (`jobs.run_compile` raises its private stop
exception from the progress callback, a BaseException no `except Exception` in the compiler
swallows). The QPC is stored by sha256, so a job run twice stores one QPC.

Profile jobs share the queue and the task: a message carries an id, and the id's table says
the kind (`profiles.is_profile`), so `process_job` hands a profile id to `process_profile`.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Callable

from sqlalchemy.orm import Session

from app.blobs import BlobStore
from app.db.models import JobStatus
from app.services import jobs, profiles

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 3
"""Claims a job may take before it is failed as `worker_lost`: a model that kills its worker
(out of memory, a crash) must not be retried by the sweep forever."""

PROGRESS_INTERVAL_S = 0.5


def default_worker_name(suffix: str = "") -> str:
    """`host:pid[:suffix]`: where a running job is, for people and for the logs."""
    name = f"{socket.gethostname()}:{os.getpid()}"
    return f"{name}:{suffix}" if suffix else name


def process_job(
    job_id: uuid.UUID,
    *,
    session_factory: Callable[[], Session],
    store: BlobStore,
    worker_name: str,
    heartbeat_s: float = jobs.DEFAULT_HEARTBEAT_S,
    stale_after_s: float = jobs.DEFAULT_STALE_AFTER_S,
    progress_interval_s: float = PROGRESS_INTERVAL_S,
    max_attempts: int = MAX_ATTEMPTS,
    progress_cb: jobs.ProgressCallback | None = None,
) -> JobStatus | None:
    """Claim and run job `job_id`; returns its final status, or None when this call did not
    get the job (unknown, finished, cancelled, or running on a live worker).

    Transient database errors while claiming propagate (the Celery task retries them); every
    error of the compile itself ends the job `failed` with a structured error.
    """
    session = session_factory()
    try:
        if profiles.is_profile(session, job_id):
            return process_profile(
                session,
                job_id,
                session_factory=session_factory,
                store=store,
                worker_name=worker_name,
                heartbeat_s=heartbeat_s,
                stale_after_s=stale_after_s,
                max_attempts=max_attempts,
            )
        job = jobs.claim(session, job_id, worker_name, stale_after_s=stale_after_s)
        if job is None:
            log.info("job %s: not claimable (finished, cancelled or taken); skipped", job_id)
            return None
        if job.attempts > max_attempts:
            jobs.fail(
                session,
                job,
                "worker_lost",
                f"the job's worker stopped {job.attempts - 1} times while compiling it; "
                "giving up (the model may need more memory than a worker has)",
                {"attempts": job.attempts - 1},
            )
            return job.status
        log.info("job %s: claimed by %s (attempt %d)", job_id, worker_name, job.attempts)
        assert job.worker is not None
        with jobs.Heartbeat(session_factory, job.id, job.worker, heartbeat_s) as heartbeat:
            jobs.run_compile(
                session,
                store,
                job,
                progress_cb,
                heartbeat.stop_requested,
                progress_interval_s=progress_interval_s,
            )
        log.info("job %s: %s", job_id, job.status.value)
        return job.status
    finally:
        session.close()


def process_profile(
    session: Session,
    job_id: uuid.UUID,
    *,
    session_factory: Callable[[], Session],
    store: BlobStore,
    worker_name: str,
    heartbeat_s: float = jobs.DEFAULT_HEARTBEAT_S,
    stale_after_s: float = jobs.DEFAULT_STALE_AFTER_S,
    max_attempts: int = MAX_ATTEMPTS,
) -> JobStatus | None:
    """Claim and run profile job `job_id` on `session`, as `process_job` does a compile."""
    job = profiles.claim(session, job_id, worker_name, stale_after_s=stale_after_s)
    if job is None:
        log.info("profile %s: not claimable (finished or taken); skipped", job_id)
        return None
    if job.attempts > max_attempts:
        profiles.fail(
            session,
            job,
            "worker_lost",
            f"the profile's worker stopped {job.attempts - 1} times while running it; giving up",
            {"attempts": job.attempts - 1},
        )
        return job.status
    log.info("profile %s: claimed by %s (attempt %d)", job_id, worker_name, job.attempts)
    with profiles.Heartbeat(session_factory, job, heartbeat_s):
        profiles.run_profile(session, store, job)
    log.info("profile %s: %s", job_id, job.status.value)
    return job.status
