"""Fair share: which queued compile a worker runs next.

A message (Celery's or the embedded queue's) is a doorbell: it asks a worker to run *a*
compile, and the worker claims the one this module picks, not necessarily the job the
message names. Every queued job was sent one message, and each message runs at most one job,
so every queued job still gets a worker; what changes is the order. The rule:

1. interactive compiles before a sweep's (`batch`): a sweep's compiles yield to a person's;
2. then the team that has had the least worker time in the last `window_s` seconds (the
   sum, over its compile jobs, of the part of [started_at, finished_at or now] inside the
   window), so a team that has just used the workers waits for one that has not;
3. then the oldest job of that team (first come, first served within a team);
4. a team at its `max_running_jobs` quota is skipped (its row is locked while its running
   jobs are counted, so concurrent workers never exceed the quota).

A message picks among the queued compiles of the same compiler as the job it names (the
same `compile_jobs.compiler`, None for the default): it was sent to that compiler's queue,
so the worker holding it has that compiler, and each compiler's jobs still get one message
each (`app.domain.compilers`).

A running job whose worker stopped heart-beating is re-taken by the message that names it
(the reaper sends one), as before. Claims stay the conditional UPDATE of `claims.claim`:
two workers that pick the same job race on it, one wins, the other picks again.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from sqlalchemy import and_, func, or_, select
from sqlalchemy.orm import Session

from app.domain.db.base import utcnow
from app.domain.db.models import CompileJob, JobStatus, Team
from app.domain.timing import FAIR_SHARE_WINDOW_S, STALE_AFTER_S
from worker import claims

WINDOW_S = FAIR_SHARE_WINDOW_S
"""The default look-back of recent worker time (the settings' `fair_share_window_s`)."""
PICK_ATTEMPTS = 8
"""Picks tried when other workers keep winning the picked job."""


@dataclass(frozen=True)
class Candidate:
    team_id: uuid.UUID
    batch: bool
    oldest: dt.datetime


def recent_worker_seconds(
    session: Session, team_ids: list[uuid.UUID], now: dt.datetime, window_s: float
) -> dict[uuid.UUID, float]:
    """Each team's compile worker time within the last `window_s` seconds."""
    start = now - dt.timedelta(seconds=window_s)
    rows = session.execute(
        select(CompileJob.team_id, CompileJob.started_at, CompileJob.finished_at).where(
            CompileJob.team_id.in_(team_ids),
            CompileJob.started_at.is_not(None),
            CompileJob.cache_hit.is_(False),
            or_(CompileJob.finished_at.is_(None), CompileJob.finished_at > start),
        )
    ).all()
    used: dict[uuid.UUID, float] = defaultdict(float)
    for team_id, started, finished in rows:
        if started is None:
            continue
        begin = max(started, start)
        end = finished if finished is not None else now
        used[team_id] += max(0.0, (end - begin).total_seconds())
    return used


def _same_compiler(compiler: str | None) -> Any:
    if compiler is None:
        return CompileJob.compiler.is_(None)
    return CompileJob.compiler == compiler


def candidates(session: Session, compiler: str | None = None) -> list[Candidate]:
    """(team, batch) groups with queued compiles for `compiler` (None: the default), with
    the oldest job's time."""
    rows = session.execute(
        select(CompileJob.team_id, CompileJob.batch, func.min(CompileJob.created_at))
        .where(
            CompileJob.status == JobStatus.queued,
            CompileJob.cancel_requested.is_(False),
            _same_compiler(compiler),
        )
        .group_by(CompileJob.team_id, CompileJob.batch)
    ).all()
    return [Candidate(r[0], bool(r[1]), r[2]) for r in rows]


def order(found: list[Candidate], used: dict[uuid.UUID, float]) -> list[Candidate]:
    """The fair-share order of the candidates (the module's rules 1-3)."""
    return sorted(found, key=lambda c: (c.batch, used.get(c.team_id, 0.0), c.oldest))


def _room(session: Session, team_id: uuid.UUID, postgres: bool) -> bool:
    """Whether the team may start one more compile (locks its row while counting)."""
    query = select(Team.max_running_jobs).where(Team.id == team_id)
    if postgres:
        query = query.with_for_update()
    limit = session.execute(query).scalar_one_or_none()
    if limit is None:
        return True
    running = session.execute(
        select(func.count())
        .select_from(CompileJob)
        .where(CompileJob.team_id == team_id, CompileJob.status == JobStatus.running)
    ).scalar_one()
    return int(running) < limit


def _oldest(
    session: Session, c: Candidate, postgres: bool, compiler: str | None = None
) -> uuid.UUID | None:
    query = (
        select(CompileJob.id)
        .where(
            CompileJob.team_id == c.team_id,
            CompileJob.batch.is_(c.batch),
            CompileJob.status == JobStatus.queued,
            CompileJob.cancel_requested.is_(False),
            _same_compiler(compiler),
        )
        .order_by(CompileJob.created_at, CompileJob.id)
        .limit(1)
    )
    if postgres:
        query = query.with_for_update(skip_locked=True)
    return session.execute(query).scalar_one_or_none()


def _stale(session: Session, job_id: uuid.UUID, now: dt.datetime, stale_after_s: float) -> bool:
    cutoff = now - dt.timedelta(seconds=stale_after_s)
    found = session.execute(
        select(CompileJob.id).where(
            CompileJob.id == job_id,
            and_(CompileJob.status == JobStatus.running, CompileJob.heartbeat_at < cutoff),
        )
    ).scalar_one_or_none()
    return found is not None


def claim_next(
    session: Session,
    job_id: uuid.UUID,
    worker: str,
    *,
    stale_after_s: float = STALE_AFTER_S,
    window_s: float = WINDOW_S,
    now: dt.datetime | None = None,
) -> CompileJob | None:
    """Claim the compile a message for `job_id` should run: `job_id` itself when its worker
    died (re-take), else the fairest queued compile (the module's rules); None: nothing to
    run now. Commits."""
    now = now or utcnow()
    if _stale(session, job_id, now, stale_after_s):
        return _claim(session, job_id, worker, now, stale_after_s)
    postgres = session.get_bind().dialect.name == "postgresql"
    compiler = session.execute(
        select(CompileJob.compiler).where(CompileJob.id == job_id)
    ).scalar_one_or_none()
    for _ in range(PICK_ATTEMPTS):
        found = candidates(session, compiler)
        if not found:
            session.commit()
            return None
        used = recent_worker_seconds(session, sorted({c.team_id for c in found}), now, window_s)
        picked: uuid.UUID | None = None
        for c in order(found, used):
            if not _room(session, c.team_id, postgres):
                continue
            picked = _oldest(session, c, postgres, compiler)
            if picked is not None:
                break
        if picked is None:
            session.commit()
            return None  # every team with queued work is at its running quota
        job = _claim(session, picked, worker, now, stale_after_s)
        if job is not None:
            return job
    session.commit()
    return None


def _claim(
    session: Session, job_id: uuid.UUID, worker: str, now: dt.datetime, stale_after_s: float
) -> Any:
    job = claims.claim_job(session, "compile", job_id, worker, now=now, stale_after_s=stale_after_s)
    assert job is None or isinstance(job, CompileJob)
    return job


def held_back_ids(
    session: Session, now: dt.datetime | None = None, *, quiet_s: float = 0.0
) -> list[uuid.UUID]:
    """Compiles that a running quota held back and that may start now: for each team with
    `max_running_jobs` below its limit and queued compiles, as many of its oldest queued
    jobs as it has room for, not enqueued in the last `quiet_s` seconds. A message that
    found its team at its quota ran nothing; the reaper sends these again (stamped
    enqueued now; the caller commits, then enqueues)."""
    now = now or utcnow()
    quiet = now - dt.timedelta(seconds=quiet_s)
    limited = session.execute(
        select(Team.id, Team.max_running_jobs).where(Team.max_running_jobs.is_not(None))
    ).all()
    found: list[uuid.UUID] = []
    for team_id, limit in limited:
        if limit is None:
            continue
        running = session.execute(
            select(func.count())
            .select_from(CompileJob)
            .where(CompileJob.team_id == team_id, CompileJob.status == JobStatus.running)
        ).scalar_one()
        room = int(limit) - int(running)
        if room <= 0:
            continue
        last_enqueue = func.coalesce(CompileJob.enqueued_at, CompileJob.created_at)
        found += session.execute(
            select(CompileJob.id)
            .where(
                CompileJob.team_id == team_id,
                CompileJob.status == JobStatus.queued,
                CompileJob.cancel_requested.is_(False),
                last_enqueue < quiet,
            )
            .order_by(CompileJob.created_at)
            .limit(room)
        ).scalars()
    claims.mark_enqueued(session, CompileJob, found, now)
    return found
