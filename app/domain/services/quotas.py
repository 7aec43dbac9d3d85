"""Per-team quotas: compile jobs queued, compile jobs running, bytes stored.

Limits are columns of the team (None: no limit), set with `qpcfarm admin set-limits`.
- queued: a submit that would queue one more compile answers 429 `queue_quota` with
  `Retry-After` (attaching to an identical job in flight, or a cache hit, queues nothing);
  a sweep submits at most what is left (`sweeps.sweep_compile_allowance`);
- running: workers leave a team's queued compiles queued while it has that many running
  (`worker.fair_share`);
- stored bytes: the sizes of the team's models and QPCs; an upload that would go beyond
  answers 413 `storage_quota` with the numbers, and so does a compile submit once the team is
  at or beyond it (its QPC would add more).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.domain.db.models import CompileJob, JobStatus, Model, Qpc, Team
from app.domain.services.errors import ServiceError


@dataclass(frozen=True)
class Usage:
    queued_jobs: int
    running_jobs: int
    stored_bytes: int


@dataclass(frozen=True)
class TeamLimits:
    max_queued_jobs: int | None
    max_running_jobs: int | None
    max_stored_bytes: int | None
    retention_days: float | None

    @classmethod
    def of(cls, team: Team) -> TeamLimits:
        return cls(
            team.max_queued_jobs, team.max_running_jobs, team.max_stored_bytes, team.retention_days
        )


def count_jobs(session: Session, team_id: Any, status: JobStatus) -> int:
    return int(
        session.execute(
            select(func.count())
            .select_from(CompileJob)
            .where(CompileJob.team_id == team_id, CompileJob.status == status)
        ).scalar_one()
    )


def stored_bytes(session: Session, team_id: Any) -> int:
    models = select(func.coalesce(func.sum(Model.size), 0)).where(Model.team_id == team_id)
    qpcs = select(func.coalesce(func.sum(Qpc.size), 0)).where(Qpc.team_id == team_id)
    return int(session.execute(models).scalar_one()) + int(session.execute(qpcs).scalar_one())


def usage(session: Session, team: Team) -> Usage:
    return Usage(
        count_jobs(session, team.id, JobStatus.queued),
        count_jobs(session, team.id, JobStatus.running),
        stored_bytes(session, team.id),
    )


def describe(session: Session, team: Team) -> dict[str, Any]:
    """Usage beside limits, as the API and the team page show them."""
    return {
        "team": team.name,
        "usage": asdict(usage(session, team)),
        "limits": asdict(TeamLimits.of(team)),
    }


def queue_full(team: Team, queued: int, retry_after_s: int) -> ServiceError:
    limit = team.max_queued_jobs
    error = ServiceError(
        "queue_quota",
        f"team {team.name!r} has {queued} compile jobs queued, its limit is {limit}; "
        f"retry after {retry_after_s} s, when some have started",
        429,
        {"queued_jobs": queued, "max_queued_jobs": limit, "retry_after_s": retry_after_s},
    )
    error.headers = {"Retry-After": str(retry_after_s)}
    return error


def check_queue(session: Session, team: Team, retry_after_s: int) -> None:
    """429 `queue_quota` when one more queued compile would exceed the team's limit."""
    if team.max_queued_jobs is None:
        return
    queued = count_jobs(session, team.id, JobStatus.queued)
    if queued >= team.max_queued_jobs:
        raise queue_full(team, queued, retry_after_s)


def queue_room(session: Session, team_id: Any) -> int | None:
    """How many more compiles the team may queue now (None: no limit)."""
    team = session.get(Team, team_id)
    if team is None or team.max_queued_jobs is None:
        return None
    return max(0, team.max_queued_jobs - count_jobs(session, team_id, JobStatus.queued))


def check_storage(session: Session, team: Team, adding: int = 0) -> None:
    """413 `storage_quota` when the team's stored bytes plus `adding` exceed its limit, or
    (adding nothing: a compile's QPC to come) already reach it."""
    limit = team.max_stored_bytes
    if limit is None:
        return
    stored = stored_bytes(session, team.id)
    over = stored + adding > limit if adding else stored >= limit
    if over:
        what = f"adding {adding:,} bytes" if adding else "a compile's QPC"
        raise ServiceError(
            "storage_quota",
            f"team {team.name!r} stores {stored:,} bytes of models and QPCs, its limit is "
            f"{limit:,}; {what} would exceed it (unpinned QPCs and models older than the "
            "retention period are collected; delete or ask an admin to raise the limit)",
            413,
            {"stored_bytes": stored, "max_stored_bytes": limit, "adding_bytes": adding},
        )
