"""Run one job by kind and id: the whole of a worker's job, shared by Celery and the
in-process worker, one path for every kind.

The job row is the truth. `process_job` claims the job (a conditional UPDATE: a duplicate
message, a finished or cancelled job, or one another live worker holds, gets None and nothing
happens), runs it while a heartbeat thread keeps the row fresh, and stores the outcome. What
differs per kind is declared once (`app.domain.job_kinds.JOB_KINDS`: table, task, claim
values) and the work itself (`RUNS`: `worker.compile_jobs`, `worker.profile_jobs`). After
`MAX_ATTEMPTS` claims whose workers died, the job fails `worker_lost` instead of being run
again.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.domain.blobs import BlobStore
from app.domain.db.models import CompileJob, JobStatus, ProfileJob
from app.domain.job_kinds import JOB_KINDS
from app.domain.queue import JobKind
from app.domain.timing import HEARTBEAT_S, MAX_ATTEMPTS, STALE_AFTER_S
from worker import claims, compile_jobs, fair_share, model_cache, profile_jobs
from worker.compile_process import CompileProcess
from worker.heartbeat import HeartbeatThread, JobHeartbeat

log = logging.getLogger(__name__)

PROGRESS_INTERVAL_S = 0.5


def default_worker_name(suffix: str = "") -> str:
    """`host:pid[:suffix]`: where a running job is, for people and for the logs."""
    name = f"{socket.gethostname()}:{os.getpid()}"
    return f"{name}:{suffix}" if suffix else name


def kind_of(session: Session, job_id: uuid.UUID) -> JobKind:
    """The kind of a job id (messages sent before each kind had its own task carried a
    profile's id to the compile task): the first table that holds it, else a compile."""
    found: JobKind = "compile"
    for kind, spec in JOB_KINDS.items():
        table: Any = spec.table
        if session.execute(select(table.id).where(table.id == job_id)).scalar_one_or_none():
            found = kind
            break
    session.commit()
    return found


@dataclass
class JobRun:
    """What the work of one claimed job gets: its session and row, the store, the heartbeat
    (whose `stop_requested` says the job was cancelled or taken over) and the worker's
    compile child and work folder."""

    session: Session
    store: BlobStore
    job: Any
    beat: HeartbeatThread
    compiler: CompileProcess | None
    work_root: Path | None
    progress_cb: compile_jobs.ProgressCallback | None
    progress_interval_s: float


def _run_compile(run: JobRun) -> None:
    assert isinstance(run.job, CompileJob)
    compile_jobs.run_compile(
        run.session,
        model_cache.for_worker(
            run.store,
            run.work_root,
            server_database=run.session.get_bind().dialect.name != "sqlite",
        ),
        run.job,
        run.progress_cb,
        run.beat.stop_requested,
        progress_interval_s=run.progress_interval_s,
        compiler=run.compiler,
        work_root=run.work_root,
    )


def _run_profile(run: JobRun) -> None:
    assert isinstance(run.job, ProfileJob)
    profile_jobs.run_profile(run.session, run.store, run.job, run.work_root)


RUNS: dict[JobKind, Callable[[JobRun], None]] = {"compile": _run_compile, "profile": _run_profile}
"""The work of each kind of job, once it is claimed and beating."""


def process_job(
    job_id: uuid.UUID,
    *,
    session_factory: Callable[[], Session],
    store: BlobStore,
    worker_name: str,
    kind: JobKind | None = None,
    heartbeat_s: float = HEARTBEAT_S,
    stale_after_s: float = STALE_AFTER_S,
    progress_interval_s: float = PROGRESS_INTERVAL_S,
    max_attempts: int = MAX_ATTEMPTS,
    progress_cb: compile_jobs.ProgressCallback | None = None,
    compiler: CompileProcess | None = None,
    work_root: Path | None = None,
    fair_share_window_s: float = fair_share.WINDOW_S,
) -> JobStatus | None:
    """Claim and run job `job_id` of `kind` (None: looked up); returns its final status, or
    None when this call did not get the job (unknown, finished, cancelled, or running on a
    live worker).

    A compile message is a doorbell (`worker.fair_share`): the call runs the fairest queued
    compile, which may be another than `job_id` (whose own message then runs another in
    turn), or re-takes `job_id` when its worker died.

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
        spec = JOB_KINDS[kind]
        job: CompileJob | ProfileJob | None
        if kind == "compile":  # the message is a doorbell: the fairest compile runs
            job = fair_share.claim_next(
                session, job_id, worker_name, stale_after_s=stale_after_s,
                window_s=fair_share_window_s,
            )  # fmt: skip
        else:
            job = claims.claim_job(session, kind, job_id, worker_name, stale_after_s=stale_after_s)
        if job is None:
            log.info("%s %s: not claimable (finished, cancelled or taken); skipped", kind, job_id)
            return None
        if job.attempts > max_attempts:
            message = (
                f"the job's worker stopped {job.attempts - 1} times while {spec.doing} it; "
                "giving up (the model may need more memory than a worker has)"
            )
            detail = {"attempts": job.attempts - 1}
            table: Any = spec.table
            claims.fail(session, table, job, "worker_lost", message, detail)
            return job.status
        log.info("%s %s: claimed by %s (attempt %d)", kind, job.id, worker_name, job.attempts)
        assert job.worker is not None
        with JobHeartbeat(session_factory, spec.table, job.id, job.worker, heartbeat_s) as beat:
            RUNS[kind](
                JobRun(
                    session, store, job, beat, compiler, work_root, progress_cb, progress_interval_s
                )  # fmt: skip
            )
        log.info("%s %s: %s", kind, job.id, job.status.value)
        return job.status
    finally:
        session.close()
