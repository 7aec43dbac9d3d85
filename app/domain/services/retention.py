"""Retention: collect what no one needs any more (`qpcfarm admin gc [--dry-run]`, and every
`gc_interval_s` in a reaper).

A team's retention period is its `retention_days`, else the farm's `retention_days` setting;
a team with neither keeps everything. For each team with a period, what is older than it
(by `finished_at`, else `created_at`) goes in this order:

1. finished sweeps (their `sweep_compiles` rows with them);
2. finished compile jobs that no remaining sweep names and whose QPC is not pinned, and
   finished profile jobs;
3. models that no remaining compile job or sweep names;
4. QPCs that are not pinned and that no remaining compile or profile job names;
5. the blobs of those models and QPCs that no row of any team names any more.

What references a model or QPC is therefore: a job or sweep still queued or running, one
finished within the period, a pin (`PUT /v1/qpcs/{id}/pin`, which also keeps the jobs that
made the QPC and their model). Validations keep their record (their `qpc_id` becomes NULL).

Nothing referenced is deleted, also while submits race the collector: each model and QPC row
is locked (`FOR UPDATE` on PostgreSQL) and its references counted again after the lock is
held; a submit locks the model it compiles and the QPC a cache hit hands out (`FOR KEY SHARE`,
in `jobs.submit`), so one of the two waits for the other: the submit then either sees the row
gone (a 404 model, a cache miss that compiles again) or the collector sees the new job and
keeps the row. A blob is deleted under `blob_guard`'s exclusive lock of its sha256, the lock
every writer of a row that names a blob takes (shared) before checking the blob is there.
On SQLite (the embedded mode) the database's single writer gives the same order.
"""

from __future__ import annotations

import datetime as dt
import logging
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

from sqlalchemy import ColumnElement, Select, delete, exists, func, not_, or_, select
from sqlalchemy.orm import Session

from app.domain.blobs import BlobStore
from app.domain.blobs import guard as blob_guard
from app.domain.db.base import utcnow
from app.domain.db.models import (
    ACTIVE_STATUSES,
    CompileJob,
    Model,
    ProfileJob,
    Qpc,
    Sweep,
    SweepCompile,
    Team,
)
from app.domain.db.ops import rowcount

log = logging.getLogger(__name__)

DAY_S = 86400.0


@dataclass
class TeamCollected:
    team: str
    cutoff: str
    sweeps: int = 0
    jobs: int = 0
    profile_jobs: int = 0
    qpcs: list[str] = field(default_factory=list)
    models: list[str] = field(default_factory=list)
    bytes: int = 0
    """Bytes of the collected models' and QPCs' rows (the team's stored bytes freed)."""


@dataclass
class Collected:
    teams: list[TeamCollected] = field(default_factory=list)
    blobs: list[str] = field(default_factory=list)
    blob_bytes: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self, dry_run: bool) -> str:
        verb = "would collect" if dry_run else "collected"
        lines = [
            f"{t.team} (older than {t.cutoff}): {verb} {len(t.models)} model(s), "
            f"{len(t.qpcs)} QPC(s) ({t.bytes:,} bytes), {t.jobs} job(s), "
            f"{t.profile_jobs} profile job(s), {t.sweeps} sweep(s)"
            for t in self.teams
        ]
        lines.append(f"{verb} {len(self.blobs)} blob(s), {self.blob_bytes:,} bytes")
        if not self.teams:
            lines.insert(0, "no team has a retention period: nothing to collect")
        return "\n".join(lines)


def retention_of(team: Team, default_days: float | None) -> float | None:
    return team.retention_days if team.retention_days is not None else default_days


def collect(
    session: Session,
    store: BlobStore,
    *,
    dry_run: bool = False,
    default_days: float | None = None,
    now: dt.datetime | None = None,
) -> Collected:
    """Collect every team's expired, unreferenced data (see the module). `dry_run`: the
    same work in transactions rolled back, no blob deleted: the report says what would go.
    `default_days` None: the settings' `retention_days`. Commits per team."""
    if default_days is None:
        from app.domain.settings import get_settings

        default_days = get_settings().retention_days
    now = now or utcnow()
    out = Collected()
    teams = list(session.execute(select(Team).order_by(Team.name)).scalars())
    periods = [(t.id, t.name, retention_of(t, default_days)) for t in teams]
    session.commit()
    for team_id, name, days in periods:
        if days is None:
            continue
        cutoff = now - dt.timedelta(seconds=days * DAY_S)
        found = TeamCollected(name, cutoff.isoformat(timespec="seconds"))
        shas = _collect_team(session, team_id, cutoff, found)
        for sha256 in sorted(shas):
            size = _delete_blob(session, store, sha256, dry_run)
            if size is not None:
                out.blobs.append(sha256)
                out.blob_bytes += size
        if dry_run:
            session.rollback()
        else:
            session.commit()
        out.teams.append(found)
        log.info("gc %s: %s", name, found)
    return out


def _old(finished: Any, created: Any, cutoff: dt.datetime) -> Any:
    return func.coalesce(finished, created) < cutoff


def _collect_team(
    session: Session, team_id: uuid.UUID, cutoff: dt.datetime, found: TeamCollected
) -> set[str]:
    """Delete the team's expired rows; the sha256s of the models and QPCs deleted."""
    found.sweeps = _delete_finished(session, Sweep, team_id, cutoff)
    pinned = exists().where(Qpc.id == CompileJob.qpc_id, Qpc.pinned_at.is_not(None))
    in_sweep = exists().where(SweepCompile.compile_job_id == CompileJob.id)
    found.jobs = _delete_finished(
        session, CompileJob, team_id, cutoff, not_(in_sweep), not_(pinned)
    )
    found.profile_jobs = _delete_finished(session, ProfileJob, team_id, cutoff)
    shas: set[str] = set()
    # Models before QPCs: the order a submit locks them in (no deadlock between the two).
    stored: list[tuple[type[Model] | type[Qpc], Select[Any], list[str]]] = [
        (Model, _model_candidates(team_id, cutoff), found.models),
        (Qpc, _qpc_candidates(team_id, cutoff), found.qpcs),
    ]
    for table, candidates, deleted in stored:
        for row_id in _ids(session, candidates):
            row = _lock_if_still(session, table, row_id, candidates)
            if row is not None:
                session.execute(delete(table).where(table.id == row_id))
                deleted.append(str(row_id))
                found.bytes += row.size
                shas.add(row.sha256)
    session.flush()
    return shas


def _delete_finished(
    session: Session,
    table: type[Sweep] | type[CompileJob] | type[ProfileJob],
    team_id: uuid.UUID,
    cutoff: dt.datetime,
    *also: ColumnElement[bool],
) -> int:
    """Delete the team's rows of `table` that are finished and older than `cutoff` (and meet
    `also`); how many went."""
    expired = delete(table).where(
        table.team_id == team_id,
        table.status.not_in(ACTIVE_STATUSES),
        _old(table.finished_at, table.created_at, cutoff),
        *also,
    )
    return rowcount(session.execute(expired, execution_options={"synchronize_session": False}))


def _qpc_candidates(team_id: uuid.UUID, cutoff: dt.datetime) -> Select[Any]:
    return select(Qpc.id).where(
        Qpc.team_id == team_id,
        Qpc.created_at < cutoff,
        Qpc.pinned_at.is_(None),
        not_(exists().where(CompileJob.qpc_id == Qpc.id)),
        not_(exists().where(ProfileJob.qpc_id == Qpc.id)),
    )


def _model_candidates(team_id: uuid.UUID, cutoff: dt.datetime) -> Select[Any]:
    return select(Model.id).where(
        Model.team_id == team_id,
        Model.created_at < cutoff,
        not_(exists().where(CompileJob.model_id == Model.id)),
        not_(exists().where(Sweep.model_id == Model.id)),
    )


def _ids(session: Session, query: Select[Any]) -> list[uuid.UUID]:
    return list(session.execute(query).scalars())


def _lock_if_still(
    session: Session, table: type[Qpc] | type[Model], row_id: uuid.UUID, candidates: Select[Any]
) -> Any:
    """The row, locked, if it is still a candidate once the lock is held (a statement after
    the lock sees every job committed while it waited); else None."""
    lock = select(table.sha256, table.size).where(table.id == row_id)
    if session.get_bind().dialect.name == "postgresql":
        lock = lock.with_for_update()
    row = session.execute(lock).first()
    if row is None:
        return None
    still = session.execute(candidates.where(table.id == row_id)).first()
    return row if still is not None else None


def _named(session: Session, sha256: str) -> bool:
    """Whether a row of any team names the blob's bytes (a validation's `qpc_sha256` is a
    record of what was checked, not a reference)."""
    names = or_(
        exists().where(Model.sha256 == sha256),
        exists().where(Qpc.sha256 == sha256),
        exists().where(or_(ProfileJob.inputs_sha256 == sha256, ProfileJob.trace_sha256 == sha256)),
    )
    return bool(session.execute(select(names)).scalar())


def _delete_blob(session: Session, store: BlobStore, sha256: str, dry_run: bool) -> int | None:
    """Delete a blob no row names (its size), under the exclusive blob lock; None: kept."""
    blob_guard.lock_for_delete(session, sha256)
    if _named(session, sha256) or not store.exists(sha256):
        return None
    size = store.size(sha256)
    if not dry_run:
        store.delete(sha256)
    return size
