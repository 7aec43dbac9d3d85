"""The queries every kind of job shares, parameterised by its table (`compile_jobs`,
`profile_jobs`): claim, heartbeat, fail, and the reaper's list of jobs to hand out again.

The job row is the truth. A worker owns a job only through `claim`, a conditional UPDATE that
exactly one caller wins; every later write is conditional on the job still being in the state
the writer expects, so a duplicate message, a dead worker's late result or a cancel never
corrupt it.
"""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any, TypeVar

from sqlalchemy import and_, func, or_, select, update
from sqlalchemy.orm import Session

from app.domain import stages
from app.domain.db.base import utcnow
from app.domain.db.models import ACTIVE_STATUSES, CompileJob, JobStatus, ProfileJob
from app.domain.db.ops import rowcount
from app.domain.job_kinds import JOB_KINDS, JobTable
from app.domain.queue import JobKind
from app.domain.timing import REQUEUE_AFTER_S, STALE_AFTER_S

Job = TypeVar("Job", CompileJob, ProfileJob)


def _cancellable(table: JobTable) -> bool:
    return hasattr(table, "cancel_requested")


def claim(
    session: Session,
    table: type[Job],
    job_id: uuid.UUID,
    worker: str,
    *,
    now: dt.datetime | None = None,
    stale_after_s: float = STALE_AFTER_S,
    values: dict[str, Any] | None = None,
) -> Job | None:
    """Take a job to run it: queued -> running, or re-take a running job whose worker stopped
    heart-beating (attempts + 1), setting `values` too. Exactly one of concurrent callers
    wins; the others, and callers for finished, cancelled or unknown jobs, get None. Commits.

    A dead worker's job whose cancel was requested is closed as cancelled instead."""
    now = now or utcnow()
    stale = and_(
        table.status == JobStatus.running,
        table.heartbeat_at < now - dt.timedelta(seconds=stale_after_s),
    )
    claimable = or_(table.status == JobStatus.queued, stale)
    where = [table.id == job_id, claimable]
    if _cancellable(table):
        where.append(table.cancel_requested.is_(False))  # type: ignore[union-attr,attr-defined]
    won = rowcount(
        session.execute(
            update(table)
            .where(*where)
            .values(
                status=JobStatus.running,
                worker=worker[:255],
                attempts=table.attempts + 1,
                started_at=now,
                heartbeat_at=now,
                **(values or {}),
            ),
            execution_options={"synchronize_session": False},
        )
    )
    if not won and _cancellable(table):
        session.execute(
            update(table)
            .where(table.id == job_id, table.cancel_requested.is_(True), claimable)  # type: ignore[union-attr,attr-defined]
            .values(status=JobStatus.cancelled, stage=stages.CANCELLED, finished_at=now),
            execution_options={"synchronize_session": False},
        )
    session.commit()
    if not won:
        return None
    return session.get(table, job_id, populate_existing=True)


def claim_job(
    session: Session,
    kind: JobKind,
    job_id: uuid.UUID,
    worker: str,
    *,
    now: dt.datetime | None = None,
    stale_after_s: float = STALE_AFTER_S,
) -> CompileJob | ProfileJob | None:
    """`claim` on the kind's table, setting what its claim sets (`JOB_KINDS`)."""
    table: Any = JOB_KINDS[kind].table
    return claim(
        session,
        table,
        job_id,
        worker,
        now=now,
        stale_after_s=stale_after_s,
        values=dict(JOB_KINDS[kind].claim_values),
    )


def touch(
    session: Session, table: JobTable, job_id: uuid.UUID, worker: str, values: dict[str, Any]
) -> tuple[bool, bool]:
    """Update a running job of `worker`; (still ours, cancel requested). Commits."""
    mine = rowcount(
        session.execute(
            update(table)
            .where(table.id == job_id, table.status == JobStatus.running, table.worker == worker)
            .values(**values),
            execution_options={"synchronize_session": False},
        )
    )
    cancel_requested = False
    if _cancellable(table):
        cancel_requested = bool(
            session.execute(
                select(table.cancel_requested).where(table.id == job_id)  # type: ignore[union-attr,attr-defined]
            ).scalar_one_or_none()
        )
    session.commit()
    return bool(mine), cancel_requested


def fail(
    session: Session,
    table: type[Job],
    job: Job,
    code: str,
    message: str,
    detail: dict[str, Any] | None = None,
    *,
    now: dt.datetime | None = None,
    values: dict[str, Any] | None = None,
) -> None:
    """Mark a queued or running job failed with a structured error (and `values`). Commits."""
    session.execute(
        update(table)
        .where(table.id == job.id, table.status.in_(ACTIVE_STATUSES))
        .values(
            status=JobStatus.failed,
            error_code=code[:64],
            error_message=message,
            error_detail=detail,
            finished_at=now or utcnow(),
            **(values or {}),
        ),
        execution_options={"synchronize_session": False},
    )
    session.commit()
    session.refresh(job)


def stale_ids(
    session: Session,
    table: JobTable,
    now: dt.datetime | None = None,
    *,
    stale_after_s: float = STALE_AFTER_S,
    requeue_after_s: float = REQUEUE_AFTER_S,
) -> list[uuid.UUID]:
    """Ids of jobs to enqueue again: queued for `requeue_after_s` since their last enqueue
    (a lost message), or running with a heartbeat older than `stale_after_s` (a dead worker).

    Marks them enqueued now, so the next reap leaves them alone for a while. The caller
    commits, then enqueues; a duplicate message is harmless (claim is conditional)."""
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
    mark_enqueued(session, table, ids, now)
    return ids


def mark_enqueued(
    session: Session, table: JobTable, ids: list[uuid.UUID], now: dt.datetime
) -> None:
    """Stamp the jobs enqueued at `now`, so the reaper leaves them alone for a while (the
    caller commits, then enqueues them)."""
    if ids:
        session.execute(
            update(table).where(table.id.in_(ids)).values(enqueued_at=now),
            execution_options={"synchronize_session": False},
        )


def queued_ids(session: Session, table: JobTable) -> list[uuid.UUID]:
    """Every queued job of the table, oldest first (an in-process queue's restart)."""
    return list(
        session.execute(
            select(table.id).where(table.status == JobStatus.queued).order_by(table.created_at)
        ).scalars()
    )
