"""Which of a team's compile jobs a configurator sweep made, so a list of jobs can tell a
person's own compiles from a sweep's (and show only one kind).

A sweep makes a job for each compile group (`sweep_compiles`): a new compile
(`created_job`), or a new row that is a cache hit. A group that attached to an identical job
already in flight did not make that job: it stays its owner's.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Literal

from sqlalchemy import Select, func, or_, select
from sqlalchemy.orm import Session

from app.domain.db.models import CompileJob, Sweep, SweepCompile, Team

Origin = Literal["own", "sweep", "all"]
ORIGINS: tuple[Origin, ...] = ("own", "sweep", "all")


@dataclass(frozen=True)
class JobList:
    """One page of jobs of an origin, the sweep that made each sweep job, and the count of
    each origin (for the filter's labels)."""

    jobs: list[CompileJob]
    sweep_of: dict[uuid.UUID, uuid.UUID]
    origin: Origin
    counts: dict[Origin, int]


def _made_by_sweeps(team: Team) -> Select[uuid.UUID, uuid.UUID]:
    """(job id, sweep id) of every job a sweep of the team made."""
    return (
        select(SweepCompile.compile_job_id, SweepCompile.sweep_id)
        .join(Sweep, Sweep.id == SweepCompile.sweep_id)
        .join(CompileJob, CompileJob.id == SweepCompile.compile_job_id)
        .where(
            Sweep.team_id == team.id,
            or_(SweepCompile.created_job.is_(True), CompileJob.cache_hit.is_(True)),
        )
    )


def origin_of(value: str | None) -> Origin:
    """A filter's query value as an origin; anything else is the default, `own`."""
    for origin in ORIGINS:
        if value == origin:
            return origin
    return "own"


def list_jobs(session: Session, team: Team, origin: Origin, *, limit: int = 50) -> JobList:
    """The team's newest jobs of `origin` (own: not made by a sweep)."""
    made = _made_by_sweeps(team).subquery()
    query = select(CompileJob).where(CompileJob.team_id == team.id)
    if origin == "own":
        query = query.where(CompileJob.id.not_in(select(made.c.compile_job_id)))
    elif origin == "sweep":
        query = query.where(CompileJob.id.in_(select(made.c.compile_job_id)))
    query = query.order_by(CompileJob.created_at.desc(), CompileJob.id).limit(limit)
    jobs = list(session.execute(query).scalars())
    ids = [job.id for job in jobs]
    sweep_of: dict[uuid.UUID, uuid.UUID] = {}
    if ids:
        rows = session.execute(
            select(made.c.compile_job_id, made.c.sweep_id).where(made.c.compile_job_id.in_(ids))
        ).all()
        sweep_of = {job_id: sweep_id for job_id, sweep_id in rows}
    total = session.execute(
        select(func.count()).select_from(CompileJob).where(CompileJob.team_id == team.id)
    ).scalar_one()
    by_sweeps = session.execute(
        select(func.count(func.distinct(made.c.compile_job_id)))
    ).scalar_one()
    counts: dict[Origin, int] = {
        "own": int(total) - int(by_sweeps),
        "sweep": int(by_sweeps),
        "all": int(total),
    }
    return JobList(jobs, sweep_of, origin, counts)
