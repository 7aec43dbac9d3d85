"""Compile jobs: submit (with the QPC cache), claim, progress, finish, cancel, sweep, run.

The job row is the truth. A worker owns a job only through `claim`, a conditional UPDATE that
exactly one caller wins; every later write is conditional on the job still being in the state
the writer expects, so a duplicate message, a dead worker's late result or a cancel never
corrupt it. Results are stored by content: a job run twice stores one QPC.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import logging
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from sqlalchemy import and_, func, or_, select, update
from sqlalchemy.orm import Session

from app.blobs import BlobCorrupt, BlobNotFound, BlobRef, BlobStore
from app.blobs.integrity import verify_blob
from app.db.base import utcnow
from app.db.models import (
    ACTIVE_JOB_PREDICATE,
    ACTIVE_STATUSES,
    CompileJob,
    CompileReport,
    JobStatus,
    Model,
    Qpc,
    Team,
)
from app.db.ops import insert_or_ignore, rowcount
from app.services.errors import ServiceError, internal_error_message, not_found
from app.services.heartbeat import HeartbeatThread
from app.services.model_files import resolve_model_files
from app.services.models import KIND_ARCHIVE, materialize_model
from app.services.pages import Page, paginate
from compiler_core import CompileError, CompileOptions
from compiler_core.version import COMPILER_VERSION

log = logging.getLogger(__name__)

DEFAULT_STALE_AFTER_S = 60.0
DEFAULT_REQUEUE_AFTER_S = 300.0
DEFAULT_HEARTBEAT_S = 5.0

ProgressCallback = Callable[[str, float], None]
CacheScope = Literal["team", "farm"]


def options_key(model_sha256: str, options: CompileOptions) -> str:
    """The QPC cache key: model bytes + canonical options + compiler version."""
    text = "\n".join((model_sha256, options.to_json_str(), COMPILER_VERSION))
    return hashlib.sha256(text.encode()).hexdigest()


# ---------------------------------------------------------------------------- API side


def submit_job(
    session: Session,
    team: Team,
    model: Model,
    options: CompileOptions,
    *,
    store: BlobStore | None = None,
    cache_scope: CacheScope = "team",
) -> tuple[CompileJob, bool]:
    """Ask for a compile of `model` with `options`. Returns (job, created).

    - a QPC for the same cache key exists (and, given the `store`, its blob hashes right;
      a corrupt one is quarantined and compiled again): a new job, already succeeded,
      `cache_hit` set;
      (`cache_scope` "team": a QPC of the team's; "farm": of any team, copied into the
      team's records);
    - the team already has a queued/running job for the key: that job, created=False;
    - otherwise a new queued job. The caller commits, then enqueues a created queued job.

    "Already has" is the database's word, not a check-then-insert: a partial unique index
    allows one active job per (team, key), so of identical submits racing in any number of
    API processes one inserts and the others attach to it. A job that finished between the
    cache lookup and the insert left its QPC behind; the lookup after the insert finds it,
    and the new row becomes a cache hit instead of a second compile.
    """
    if model.team_id != team.id:
        raise not_found("model", model.id)
    key = options_key(model.sha256, options)
    common: dict[str, Any] = {
        "team_id": team.id,
        "model_id": model.id,
        "options": options.to_json(),
        "options_key": key,
        "device": options.device.name,
    }
    qpc_id = _usable_cached_qpc(session, store, team, key, cache_scope)
    if qpc_id is not None:
        job = CompileJob(**common, **_cache_hit_values(qpc_id))
        session.add(job)
        session.flush()
        return job, True

    for _ in range(ATTACH_ATTEMPTS):
        job_id = uuid.uuid4()
        inserted = insert_or_ignore(
            session,
            CompileJob,
            {**common, "id": job_id, "status": JobStatus.queued},
            ["team_id", "options_key"],
            where=ACTIVE_JOB_PREDICATE,
        )
        if inserted:
            qpc_id = _usable_cached_qpc(session, store, team, key, cache_scope)
            if qpc_id is not None:
                session.execute(
                    update(CompileJob)
                    .where(CompileJob.id == job_id)
                    .values(**_cache_hit_values(qpc_id)),
                    execution_options={"synchronize_session": False},
                )
            made = session.get(CompileJob, job_id, populate_existing=True)
            assert made is not None
            return made, True
        active = session.execute(
            select(CompileJob)
            .where(
                CompileJob.team_id == team.id,
                CompileJob.options_key == key,
                CompileJob.status.in_(ACTIVE_STATUSES),
                CompileJob.cancel_requested.is_(False),
            )
            .limit(1)
        ).scalar_one_or_none()
        if active is not None:
            return active, False
        # The job we collided with finished in between: try again (it left a QPC or failed).
    raise ServiceError("busy", "identical submits keep colliding; retry", 503)


ATTACH_ATTEMPTS = 5


def _cache_hit_values(qpc_id: uuid.UUID) -> dict[str, Any]:
    now = utcnow()
    return {
        "status": JobStatus.succeeded,
        "stage": "done",
        "progress": 1.0,
        "cache_hit": True,
        "qpc_id": qpc_id,
        "created_at": now,
        "started_at": now,
        "finished_at": now,
    }


def _usable_cached_qpc(
    session: Session, store: BlobStore | None, team: Team, key: str, scope: CacheScope
) -> uuid.UUID | None:
    """The team's QPC for the cache key, if it has one whose blob is intact. With the farm
    scope, another team's QPC of the key is copied into the team's records first (a row of
    its own, same bytes): the answer is the one a team's own cache hit gets, and names no
    other team's QPC."""
    qpc_id = _cached_qpc_id(session, key, team.id)
    if qpc_id is None and scope == "farm":
        theirs = _cached_qpc_id(session, key, None)
        if theirs is not None:
            qpc_id = copy_qpc(session, theirs, team)
    if qpc_id is not None and store is not None and not _blob_intact(session, store, qpc_id):
        return None
    return qpc_id


def _cached_qpc_id(session: Session, key: str, team_id: uuid.UUID | None) -> uuid.UUID | None:
    """A QPC of the cache key: the team's (`team_id`), or any team's (None)."""
    query = select(Qpc.id).where(Qpc.options_key == key)
    if team_id is not None:
        query = query.where(Qpc.team_id == team_id)
    qpc_id = session.execute(query.limit(1)).scalar_one_or_none()
    if qpc_id is None:  # the same bytes may have been stored first under another key
        by_job = select(CompileJob.qpc_id).where(
            CompileJob.options_key == key, CompileJob.qpc_id.is_not(None)
        )
        if team_id is not None:
            by_job = by_job.where(CompileJob.team_id == team_id)
        qpc_id = session.execute(by_job.limit(1)).scalar_one_or_none()
    return qpc_id


def copy_qpc(session: Session, qpc_id: uuid.UUID, team: Team) -> uuid.UUID:
    """The team's own row for the content of QPC `qpc_id` (made, with a copy of its report,
    unless the team has one)."""
    source = session.get(Qpc, qpc_id)
    assert source is not None
    now = utcnow()
    new_id = uuid.uuid4()
    made = insert_or_ignore(
        session,
        Qpc,
        {
            "id": new_id,
            "team_id": team.id,
            "sha256": source.sha256,
            "size": source.size,
            "compiler_version": source.compiler_version,
            "options_key": source.options_key,
            "device": source.device,
            "requirements": source.requirements,
            "created_at": now,
        },
        ["team_id", "sha256"],
    )
    if made:
        report = session.execute(
            select(CompileReport).where(CompileReport.qpc_id == source.id)
        ).scalar_one_or_none()
        if report is not None:
            session.add(
                CompileReport(
                    qpc_id=new_id,
                    metrics=report.metrics,
                    warnings=report.warnings,
                    pass_times=report.pass_times,
                    log=report.log,
                    created_at=now,
                )
            )
            session.flush()
        return new_id
    return session.execute(
        select(Qpc.id).where(Qpc.team_id == team.id, Qpc.sha256 == source.sha256)
    ).scalar_one()


def _blob_intact(session: Session, store: BlobStore, qpc_id: uuid.UUID) -> bool:
    """Whether a cached QPC's blob is there and hashes to its name (read whole: a cache hit
    must never hand out damaged bytes)."""
    sha256 = session.execute(select(Qpc.sha256).where(Qpc.id == qpc_id)).scalar_one()
    try:
        verify_blob(store, sha256, found_by="cache")
    except (BlobCorrupt, BlobNotFound):
        return False
    return True


def get_job(session: Session, team: Team, job_id: uuid.UUID) -> CompileJob:
    job = session.get(CompileJob, job_id)
    if job is None or job.team_id != team.id:
        raise not_found("job", job_id)
    return job


def list_jobs(
    session: Session,
    team: Team,
    *,
    limit: int = 50,
    offset: int = 0,
    status: JobStatus | None = None,
) -> Page[CompileJob]:
    query = select(CompileJob).where(CompileJob.team_id == team.id)
    if status is not None:
        query = query.where(CompileJob.status == status)
    query = query.order_by(CompileJob.created_at.desc(), CompileJob.id)
    return paginate(session, query, limit, offset)


def cancel(session: Session, team: Team, job: CompileJob) -> CompileJob:
    """Cancel a job: a queued one at once; a running one is flagged and its worker stops it
    at its next progress report. A finished job cannot be cancelled (409). Caller commits."""
    if job.team_id != team.id:
        raise not_found("job", job.id)
    now = utcnow()
    queued = session.execute(
        update(CompileJob)
        .where(CompileJob.id == job.id, CompileJob.status == JobStatus.queued)
        .values(status=JobStatus.cancelled, stage="cancelled", finished_at=now)
    )
    if rowcount(queued) == 0:
        running = session.execute(
            update(CompileJob)
            .where(CompileJob.id == job.id, CompileJob.status == JobStatus.running)
            .values(cancel_requested=True)
        )
        if rowcount(running) == 0:
            session.refresh(job)
            raise ServiceError(
                "not_cancellable", f"job {job.id} has already {job.status.value}", 409
            )
    session.flush()
    session.refresh(job)
    return job


def stale_jobs(
    session: Session,
    now: dt.datetime | None = None,
    *,
    stale_after_s: float = DEFAULT_STALE_AFTER_S,
    requeue_after_s: float = DEFAULT_REQUEUE_AFTER_S,
) -> list[uuid.UUID]:
    """Ids of jobs to enqueue again: queued for `requeue_after_s` since their last enqueue
    (a lost message), or running with a heartbeat older than `stale_after_s` (a dead worker).

    Marks them enqueued now, so the next sweep leaves them alone for a while. The caller
    commits, then enqueues; a duplicate message is harmless (claim is conditional).
    """
    return stale_rows(
        session, CompileJob, now, stale_after_s=stale_after_s, requeue_after_s=requeue_after_s
    )


def stale_rows(
    session: Session,
    table: Any,
    now: dt.datetime | None = None,
    *,
    stale_after_s: float,
    requeue_after_s: float,
) -> list[uuid.UUID]:
    """`stale_jobs` for any job table with status, created_at, enqueued_at and heartbeat_at
    columns (compile jobs, profile jobs)."""
    now = now or utcnow()
    requeue_cutoff = now - dt.timedelta(seconds=requeue_after_s)
    stale_cutoff = now - dt.timedelta(seconds=stale_after_s)
    last_enqueue = func.coalesce(table.enqueued_at, table.created_at)
    ids = list(
        session.execute(
            select(table.id)
            .where(
                or_(
                    and_(table.status == JobStatus.queued, last_enqueue < requeue_cutoff),
                    and_(
                        table.status == JobStatus.running,
                        table.heartbeat_at < stale_cutoff,
                        or_(table.enqueued_at.is_(None), table.enqueued_at < stale_cutoff),
                    ),
                )
            )
            .order_by(table.created_at)
        ).scalars()
    )
    if ids:
        session.execute(
            update(table).where(table.id.in_(ids)).values(enqueued_at=now),
            execution_options={"synchronize_session": False},
        )
    return ids


# ------------------------------------------------------------------------- worker side


def claim(
    session: Session,
    job_id: uuid.UUID,
    worker: str,
    *,
    now: dt.datetime | None = None,
    stale_after_s: float = DEFAULT_STALE_AFTER_S,
) -> CompileJob | None:
    """Take a job to run it: queued -> running, or re-take a running job whose worker stopped
    heart-beating (attempts + 1). Exactly one of concurrent callers wins; the others, and
    callers for finished, cancelled or unknown jobs, get None. Commits.

    A dead worker's job whose cancel was requested is closed as cancelled instead.
    """
    now = now or utcnow()
    stale = and_(
        CompileJob.status == JobStatus.running,
        CompileJob.heartbeat_at < now - dt.timedelta(seconds=stale_after_s),
    )
    claimable = or_(CompileJob.status == JobStatus.queued, stale)
    won = rowcount(
        session.execute(
            update(CompileJob)
            .where(CompileJob.id == job_id, CompileJob.cancel_requested.is_(False), claimable)
            .values(
                status=JobStatus.running,
                worker=worker[:255],
                attempts=CompileJob.attempts + 1,
                stage="claimed",
                progress=0.0,
                started_at=now,
                heartbeat_at=now,
            ),
            execution_options={"synchronize_session": False},
        )
    )
    if not won:
        session.execute(
            update(CompileJob)
            .where(CompileJob.id == job_id, CompileJob.cancel_requested.is_(True), claimable)
            .values(status=JobStatus.cancelled, stage="cancelled", finished_at=now),
            execution_options={"synchronize_session": False},
        )
    session.commit()
    if not won:
        return None
    return session.get(CompileJob, job_id, populate_existing=True)


def report_progress(
    session: Session,
    job: CompileJob,
    stage: str | None = None,
    progress: float | None = None,
    *,
    now: dt.datetime | None = None,
) -> bool:
    """Record stage/progress (or just a heartbeat) of a job this worker runs. Commits.

    Returns True when the worker should stop: a cancel was requested, or the job is no longer
    this worker's (re-claimed after a missed heartbeat, or finished elsewhere).
    """
    values: dict[str, Any] = {"heartbeat_at": now or utcnow()}
    if stage is not None:
        values["stage"] = stage[:64]
    if progress is not None:
        values["progress"] = max(0.0, min(1.0, progress))
    assert job.worker is not None, "report_progress needs a claimed job"
    mine, cancel_requested = _touch(session, job.id, job.worker, values)
    if mine:
        for name, value in values.items():
            setattr(job, name, value)
        job.cancel_requested = cancel_requested
    return not mine or cancel_requested


def _touch(
    session: Session, job_id: uuid.UUID, worker: str, values: dict[str, Any]
) -> tuple[bool, bool]:
    """Update a running job of `worker`; (still ours, cancel requested). Commits."""
    mine = rowcount(
        session.execute(
            update(CompileJob)
            .where(
                CompileJob.id == job_id,
                CompileJob.status == JobStatus.running,
                CompileJob.worker == worker,
            )
            .values(**values),
            execution_options={"synchronize_session": False},
        )
    )
    cancel_requested = session.execute(
        select(CompileJob.cancel_requested).where(CompileJob.id == job_id)
    ).scalar_one_or_none()
    session.commit()
    return bool(mine), bool(cancel_requested)


class Heartbeat(HeartbeatThread):
    """A thread that keeps a claimed job's heartbeat fresh while its compile is inside one
    long stage (no progress callbacks), on its own session. `stop_requested()` turns True
    once the job is cancelled or taken over; pass it to run_compile as `should_cancel`.

        with jobs.Heartbeat(session_factory, job.id, job.worker, settings.heartbeat_s) as hb:
            jobs.run_compile(session, store, job, should_cancel=hb.stop_requested)
    """

    def __init__(
        self,
        session_factory: Callable[[], Session],
        job_id: uuid.UUID,
        worker: str,
        interval_s: float = DEFAULT_HEARTBEAT_S,
    ) -> None:
        def beat(session: Session) -> bool:
            mine, cancel = _touch(session, job_id, worker, {"heartbeat_at": utcnow()})
            return mine and not cancel

        super().__init__(session_factory, beat, interval_s, f"job {job_id}")


@dataclass
class CompileOutcome:
    """What a successful compile adds to the database besides the QPC blob."""

    metrics: dict[str, Any]
    warnings: list[dict[str, Any]]
    pass_times: dict[str, float]
    requirements: dict[str, Any]
    log: str = ""


def succeed(
    session: Session,
    job: CompileJob,
    qpc_ref: BlobRef,
    outcome: CompileOutcome,
    *,
    now: dt.datetime | None = None,
) -> Qpc:
    """Store the team's QPC row (get-or-create by team and sha256) and its report, and mark the job
    succeeded if it is still running. Safe to call twice or from two workers. Commits."""
    now = now or utcnow()
    insert_or_ignore(
        session,
        Qpc,
        {
            "id": uuid.uuid4(),
            "team_id": job.team_id,
            "sha256": qpc_ref.sha256,
            "size": qpc_ref.size,
            "compiler_version": COMPILER_VERSION,
            "options_key": job.options_key,
            "device": job.device,
            "requirements": outcome.requirements,
            "created_at": now,
        },
        ["team_id", "sha256"],
    )
    qpc = session.execute(
        select(Qpc).where(Qpc.team_id == job.team_id, Qpc.sha256 == qpc_ref.sha256)
    ).scalar_one()
    insert_or_ignore(
        session,
        CompileReport,
        {
            "id": uuid.uuid4(),
            "qpc_id": qpc.id,
            "metrics": outcome.metrics,
            "warnings": outcome.warnings,
            "pass_times": outcome.pass_times,
            "log": outcome.log,
            "created_at": now,
        },
        ["qpc_id"],
    )
    session.execute(
        update(CompileJob)
        .where(CompileJob.id == job.id, CompileJob.status == JobStatus.running)
        .values(
            status=JobStatus.succeeded,
            stage="done",
            progress=1.0,
            qpc_id=qpc.id,
            finished_at=now,
            heartbeat_at=now,
        ),
        execution_options={"synchronize_session": False},
    )
    session.commit()
    session.refresh(job)
    return qpc


def fail(
    session: Session,
    job: CompileJob,
    code: str,
    message: str,
    detail: dict[str, Any] | None = None,
    *,
    now: dt.datetime | None = None,
) -> None:
    """Mark a queued or running job failed with a structured error. Commits."""
    session.execute(
        update(CompileJob)
        .where(CompileJob.id == job.id, CompileJob.status.in_(ACTIVE_STATUSES))
        .values(
            status=JobStatus.failed,
            error_code=code[:64],
            error_message=message,
            error_detail=detail,
            finished_at=now or utcnow(),
        ),
        execution_options={"synchronize_session": False},
    )
    session.commit()
    session.refresh(job)


def _finish_cancelled(session: Session, job: CompileJob) -> None:
    session.execute(
        update(CompileJob)
        .where(CompileJob.id == job.id, CompileJob.status == JobStatus.running)
        .values(status=JobStatus.cancelled, stage="cancelled", finished_at=utcnow()),
        execution_options={"synchronize_session": False},
    )
    session.commit()
    session.refresh(job)


class _Stop(BaseException):
    """Raised from the progress callback to abandon a compile. A BaseException so that no
    `except Exception` inside the compiler swallows it."""

    def __init__(self, cancelled: bool) -> None:
        super().__init__("cancelled" if cancelled else "job lost")
        self.cancelled = cancelled


@dataclass
class _Progress:
    """The compiler's progress callback: writes stage and progress to the job row (every
    stage change, otherwise at most every `interval` s), keeps a log, and stops the compile
    when the job is cancelled or taken over."""

    session: Session
    job: CompileJob
    interval: float
    observer: ProgressCallback | None
    should_cancel: Callable[[], bool] | None
    started: float = field(default_factory=time.monotonic)
    lines: list[str] = field(default_factory=list)
    _stage: str | None = None
    _written: float = 0.0

    def __call__(self, stage: str, fraction: float) -> None:
        now = time.monotonic()
        if self.observer is not None:
            self.observer(stage, fraction)
        changed = stage != self._stage
        if changed:
            self.note(f"stage {stage}")
            self._stage = stage
        if changed or now - self._written >= self.interval:
            self._written = now
            if report_progress(self.session, self.job, stage, fraction):
                raise _Stop(cancelled=self.job.cancel_requested or self._cancel_requested())
        self.check()

    def check(self) -> None:
        if self.should_cancel is not None and self.should_cancel():
            raise _Stop(cancelled=True)

    def _cancel_requested(self) -> bool:
        flag = self.session.execute(
            select(CompileJob.cancel_requested).where(CompileJob.id == self.job.id)
        ).scalar_one_or_none()
        self.session.commit()
        return bool(flag)

    def note(self, text: str) -> None:
        self.lines.append(f"[{time.monotonic() - self.started:8.3f}s] {text}")


def run_compile(
    session: Session,
    store: BlobStore,
    job: CompileJob,
    progress_cb: ProgressCallback | None = None,
    should_cancel: Callable[[], bool] | None = None,
    *,
    progress_interval_s: float = 1.0,
) -> CompileJob:
    """Compile a job this worker has claimed, from model blob to stored QPC and report.

    Progress goes to the job row (and to `progress_cb`); a cancel (the row's flag or
    `should_cancel()`) stops the compile at its next progress report. Ends the job
    succeeded, failed (a CompileError keeps its code, flag and node; anything else is
    `internal_error`) or cancelled. A job that is not running is returned untouched. Commits.
    """
    if job.status != JobStatus.running:
        return job
    progress = _Progress(session, job, progress_interval_s, progress_cb, should_cancel)
    try:
        model = session.get(Model, job.model_id)
        if model is None:
            raise CompileError("model_missing", f"model {job.model_id} no longer exists")
        options = CompileOptions.from_json(job.options)
        with tempfile.TemporaryDirectory(prefix="qpcfarm-job-") as tmp:
            work = Path(tmp)
            try:
                model_path = materialize_model(store, model, work)
            except BlobNotFound:
                raise CompileError(
                    "model_missing", f"the blob of model {model.id} is missing"
                ) from None
            except BlobCorrupt:
                raise CompileError(
                    "blob_corrupt",
                    f"the stored bytes of model {model.id} failed their integrity check and "
                    "were quarantined; upload the model again",
                ) from None
            except ServiceError as exc:
                raise CompileError(exc.code, exc.message) from None
            progress.note(f"compiling {model.name} ({model.size:,} bytes) on {job.worker}")
            # The farm's report always carries perf metrics and warnings: they are outputs of
            # the compile, not choices that change the QPC (and not part of the cache key).
            model_dir = model_path.parent if model.kind == KIND_ARCHIVE else None
            farm_options = resolve_model_files(options, model_dir).with_(
                aic_binary_dir=str(work / "out"), aic_perf_warnings=True, aic_perf_metrics=True
            )
            result = _compile(model_path, farm_options, progress)
            progress.check()
            with open(result.qpc_path, "rb") as qpc_file:
                ref = store.put(qpc_file)
            progress.note(f"stored QPC {ref.sha256} ({ref.size:,} bytes)")
            outcome = CompileOutcome(
                metrics=result.metrics,
                warnings=result.warnings,
                pass_times=result.pass_times,
                requirements=_requirements(result.qpc_path),
                log="\n".join(progress.lines) + "\n",
            )
        succeed(session, job, ref, outcome)
    except _Stop as stop:
        session.rollback()
        if stop.cancelled:
            _finish_cancelled(session, job)
        else:
            log.warning("job %s was taken over by another worker; abandoning it", job.id)
            session.refresh(job)
    except CompileError as exc:
        session.rollback()
        fail(session, job, exc.code, exc.message, exc.to_dict())
    except Exception as exc:
        log.exception("job %s failed unexpectedly", job.id)
        session.rollback()
        fail(session, job, "internal_error", internal_error_message(exc))
    return job


def _compile(model_path: Path, options: CompileOptions, progress: _Progress) -> Any:
    from compiler_core.compile import compile_model  # heavy: loaded on the first compile

    return compile_model(model_path, options, progress=progress)


def _requirements(qpc_path: Path) -> dict[str, Any]:
    from compiler_core.qpc.container import load_qpc

    with load_qpc(qpc_path) as qpc:
        network = qpc.network
        return {} if network is None else network.requirements.to_dict()
