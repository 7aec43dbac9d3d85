"""Compile jobs on the API side: submit (with the QPC cache), read, list, cancel.

The job row is the truth; what a worker does with it (claim, progress, succeed, fail) is in
`worker.compile_jobs`. A submit commits the row and the API enqueues its id after.
"""

from __future__ import annotations

import hashlib
import logging
import uuid
from typing import Any, Literal

from sqlalchemy import Select, Uuid, bindparam, func, select, update
from sqlalchemy.orm import Session
from sqlalchemy.orm.attributes import set_committed_value

from compiler_core import CompileOptions
from compiler_core.version import COMPILER_VERSION
from qpcfarm.app.blobs import BlobCorrupt, BlobNotFound, BlobStore
from qpcfarm.app.blobs.integrity import verify_blob
from qpcfarm.app.db.base import utcnow
from qpcfarm.app.db.models import (
    ACTIVE_JOB_PREDICATE,
    ACTIVE_STATUSES,
    CompileJob,
    CompileReport,
    JobStatus,
    Model,
    Qpc,
    Team,
)
from qpcfarm.app.db.ops import insert_or_ignore, insert_statement, rowcount
from qpcfarm.app.services.errors import ServiceError, not_found
from qpcfarm.app.services.pages import Page, paginate

log = logging.getLogger(__name__)

CacheScope = Literal["team", "farm"]


def options_key(model_sha256: str, options: CompileOptions) -> str:
    """The QPC cache key: model bytes + canonical options + compiler version."""
    text = "\n".join((model_sha256, options.to_json_str(), COMPILER_VERSION))
    return hashlib.sha256(text.encode()).hexdigest()



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
        job = _insert_job(session, {**common, "id": uuid.uuid4(), **_cache_hit_values(qpc_id)})
        assert job is not None  # no active row carries a succeeded job's values
        return job, True

    for _ in range(ATTACH_ATTEMPTS):
        job = _insert_job(
            session,
            {**common, "id": uuid.uuid4(), "status": JobStatus.queued},
            only_if_no_active=True,
        )
        if job is not None:
            qpc_id = _usable_cached_qpc(session, store, team, key, cache_scope)
            if qpc_id is not None:
                hit = _cache_hit_values(qpc_id)
                session.execute(
                    update(CompileJob).where(CompileJob.id == job.id).values(**hit),
                    execution_options={"synchronize_session": False},
                )
                for name, value in hit.items():
                    set_committed_value(job, name, value)
            return job, True
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


def _insert_job(
    session: Session, values: dict[str, Any], *, only_if_no_active: bool = False
) -> CompileJob | None:
    """INSERT the job row and read it back in the same statement (RETURNING); with
    `only_if_no_active`, nothing (None) when the team already has an active job of the key
    (the partial unique index)."""
    stmt = insert_statement(session, CompileJob, values)
    if only_if_no_active:
        stmt = stmt.on_conflict_do_nothing(
            index_elements=["team_id", "options_key"], index_where=ACTIVE_JOB_PREDICATE
        )
    return session.execute(
        stmt.returning(CompileJob), execution_options={"populate_existing": True}
    ).scalar_one_or_none()


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


def _cache_lookup(team_scoped: bool) -> Select[Any]:
    """The cache lookup, built once per scope (bound at execution: `key`, `team_id`): a QPC
    row stored under the key, or else the QPC a job of the key points at (the same bytes may
    have been stored first under another key). One round trip, no statement built per call."""
    by_qpc = select(Qpc.id).where(Qpc.options_key == bindparam("key"))
    by_job = select(CompileJob.qpc_id).where(
        CompileJob.options_key == bindparam("key"), CompileJob.qpc_id.is_not(None)
    )
    if team_scoped:
        by_qpc = by_qpc.where(Qpc.team_id == bindparam("team_id", type_=Qpc.team_id.type))
        by_job = by_job.where(
            CompileJob.team_id == bindparam("team_id", type_=CompileJob.team_id.type)
        )
    first = func.coalesce(
        by_qpc.limit(1).scalar_subquery(), by_job.limit(1).scalar_subquery(), type_=Uuid()
    )
    return select(first)


_TEAM_LOOKUP = _cache_lookup(team_scoped=True)
_FARM_LOOKUP = _cache_lookup(team_scoped=False)


def _cached_qpc_id(session: Session, key: str, team_id: uuid.UUID | None) -> uuid.UUID | None:
    """A QPC of the cache key: the team's (`team_id`), or any team's (None)."""
    if team_id is None:
        return session.execute(_FARM_LOOKUP, {"key": key}).scalar_one_or_none()
    return session.execute(_TEAM_LOOKUP, {"key": key, "team_id": team_id}).scalar_one_or_none()


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
