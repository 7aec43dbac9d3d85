"""Compile jobs on the API side: submit (with the QPC cache), read, list, cancel.

The job row is the truth; what a worker does with it (claim, progress, succeed, fail) is in
`worker.compile_jobs`. A submit commits the row and the API enqueues its id after.
"""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from typing import Any, Literal, cast

from sqlalchemy import Row, Select, Table, Uuid, bindparam, func, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from app.domain import stages
from app.domain.blobs import BlobCorrupt, BlobNotFound, BlobStore
from app.domain.blobs import guard as blob_guard
from app.domain.blobs.integrity import verify_blob
from app.domain.compilers import DEFAULT as DEFAULT_COMPILER
from app.domain.compilers import QAIC, QPCFARM, Compiler
from app.domain.db.base import utcnow
from app.domain.db.models import (
    ACTIVE_JOB_PREDICATE,
    ACTIVE_STATUSES,
    CompileJob,
    CompileReport,
    JobStatus,
    Model,
    Qpc,
    Team,
)
from app.domain.db.ops import insert_or_ignore, rowcount
from app.domain.services import quotas
from app.domain.services.errors import ServiceError, not_found
from app.domain.services.model_files import check_files_travel
from app.domain.services.pages import Page, paginate
from compiler_core import CompileError, CompileOptions
from compiler_core.convert import (
    FORMAT_KEYS,
    converter_of,
    format_input_shapes,
    parse_input_shapes,
)
from compiler_core.fit import CODE as FIT_CODE
from compiler_core.fit import check_upload_fit, upload_worth_checking
from compiler_core.options import vendor_flags

log = logging.getLogger(__name__)

CacheScope = Literal["team", "farm"]


def options_key(
    model_sha256: str,
    options: CompileOptions,
    canonical: dict[str, Any] | None = None,
    converter: str = "",
    compiler: Compiler | None = None,
) -> str:
    """The QPC cache key: model bytes + canonical options + compiler backend and version,
    and for a TensorFlow or PyTorch model the converter's versions (`converter_of`).
    `canonical`: `options.to_json()` if the caller has it already. `compiler` None is the
    default, this package's compiler at its version; so is `qpcfarm@<that version>` named,
    and both keep the key they had before backends could be named (the version alone)."""
    if canonical is None:
        canonical = options.to_json()
    canonical_text = json.dumps(canonical, sort_keys=True, separators=(",", ":"))  # to_json_str
    compiler = compiler or DEFAULT_COMPILER
    if compiler.backend == QPCFARM:
        parts: tuple[str, ...] = (model_sha256, canonical_text, compiler.version)
    else:
        parts = (model_sha256, canonical_text, compiler.backend, compiler.version)
    text = "\n".join((*parts, converter) if converter else parts)
    return hashlib.sha256(text.encode()).hexdigest()


def with_model_shapes(options: CompileOptions, model_shapes: str | None) -> CompileOptions:
    """`options` with the model's recorded input shapes (a framework model's upload
    `input_shapes`) where they give no `-input-shapes` of their own: the compile's flag wins.
    The shapes a compile uses are in its options, so in its cache key and its job's record."""
    if options.input_shapes:
        try:  # one spelling, so that the same shapes are one cache key
            spelled = format_input_shapes(parse_input_shapes(options.input_shapes))
        except CompileError:
            return options  # refused by the compile, with its flag
        return options.with_(input_shapes=spelled)
    if not model_shapes:
        return options
    return options.with_(input_shapes=model_shapes)


JobRow = Row[Any]
"""A compile job as the submit path reads it: a row with CompileJob's columns as attributes
(`JobOut.of` reads either)."""

_JOBS = cast(Table, CompileJob.__table__)
_JOB_COLUMNS = tuple(_JOBS.c)
_MODEL_OF = (
    select(Model.team_id, Model.sha256, Model.kind, Model.input_shapes)
    .where(Model.id == bindparam("model_id"))
    .with_for_update(key_share=True)  # the collector cannot delete it under this submit
)
_HOLD_QPC = select(Qpc.id).where(Qpc.id == bindparam("qpc_id")).with_for_update(key_share=True)
_HOLD_MODEL = (
    select(Model.id).where(Model.id == bindparam("model_id")).with_for_update(key_share=True)
)
_ACTIVE_JOB = (
    select(*_JOB_COLUMNS)
    .where(
        _JOBS.c.team_id == bindparam("team_id"),
        _JOBS.c.options_key == bindparam("key"),
        _JOBS.c.status.in_(ACTIVE_STATUSES),
        _JOBS.c.cancel_requested.is_(False),
    )
    .limit(1)
)
_MAKE_HIT = update(_JOBS).where(_JOBS.c.id == bindparam("job_id")).returning(*_JOB_COLUMNS)


def _job_inserts(dialect: Any) -> tuple[Any, Any]:
    """(plain, only-if-no-active-job-of-the-key) INSERT ... RETURNING of a job row."""
    plain = dialect.insert(_JOBS)
    guarded = plain.on_conflict_do_nothing(
        index_elements=["team_id", "options_key"], index_where=ACTIVE_JOB_PREDICATE
    )
    return plain.returning(*_JOB_COLUMNS), guarded.returning(*_JOB_COLUMNS)


_INSERTS = {"sqlite": _job_inserts(sqlite), "postgresql": _job_inserts(postgresql)}
"""Statements built once: a submit binds values, SQLAlchemy's compiled cache does the rest."""


def to_enqueue(job: CompileJob | Row[Any], created: bool) -> list[uuid.UUID]:
    """What a submit hands to the workers: the job when this submit created it queued (a
    cache hit is already done; a job it attached to had its message already)."""
    return [job.id] if created and job.status == JobStatus.queued else []


def submit_job(
    session: Session,
    team: Team,
    model: Model,
    options: CompileOptions,
    *,
    store: BlobStore | None = None,
    cache_scope: CacheScope = "team",
    batch: bool = False,
    retry_after_s: int = 30,
    compiler: Compiler | None = None,
) -> tuple[CompileJob, bool]:
    """`submit` for callers that work with ORM objects (the web form, sweeps): the job as a
    `CompileJob` of the session."""
    if model.team_id != team.id:
        raise not_found("model", model.id)
    session.flush()  # the caller's pending rows first: `submit` runs on the connection
    row, created = submit(
        session, team, model.id, options, store=store, cache_scope=cache_scope, model=model,
        batch=batch, retry_after_s=retry_after_s,
        compiler=compiler,
    )  # fmt: skip
    job = session.get(CompileJob, row.id, populate_existing=True)
    assert job is not None
    return job, created


def submit(
    session: Session,
    team: Team,
    model_id: uuid.UUID,
    options: CompileOptions,
    *,
    store: BlobStore | None = None,
    cache_scope: CacheScope = "team",
    model: Model | None = None,
    batch: bool = False,
    retry_after_s: int = 30,
    compiler: Compiler | None = None,
) -> tuple[JobRow, bool]:
    """Ask for a compile of the team's model `model_id` with `options` (404 `not_found` for
    a model of another team), by `compiler` (None: the default; the caller checked that a
    worker has it, `services.compilers.resolve`). Returns (job, created).

    - a QPC for the same cache key exists (and, given the `store`, its blob hashes right;
      a corrupt one is quarantined and compiled again): a new job, already succeeded,
      `cache_hit` set;
      (`cache_scope` "team": a QPC of the team's; "farm": of any team, copied into the
      team's records);
    - the team already has a queued/running job for the key: that job, created=False;
    - otherwise a new queued job (`batch`: a sweep's, which yields to interactive compiles;
      an interactive submit that attaches to a batch job makes it interactive). The caller
      commits, then enqueues a created queued job.

    The team's quotas (`quotas`): a new queued job beyond its queue limit is 429
    `queue_quota` (`Retry-After: retry_after_s`); a compile when its stored bytes are at
    their limit is 413 `storage_quota`. Attaching and cache hits queue and store nothing.

    "Already has" is the database's word, not a check-then-insert: a partial unique index
    allows one active job per (team, key), so of identical submits racing in any number of
    API processes one inserts and the others attach to it. A job that finished between the
    cache lookup and the insert left its QPC behind; the lookup after the insert finds it,
    and the new row becomes a cache hit instead of a second compile.

    Core statements built once on the session's connection, no ORM objects: the API's
    submit is its busiest write, and the ORM's unit of work cost several times the SQL.
    """
    intact = _intact_cached_blob(
        session, store, team, model_id, model, options, compiler, cache_scope
    )
    blob_guard.hold_writes(session)  # SQLite: the reads below see no collector's delete
    connection = session.connection()
    if model is None:
        found = connection.execute(_MODEL_OF, {"model_id": model_id}).first()
        if found is None or found.team_id != team.id:
            raise not_found("model", model_id)
        sha256, kind, shapes = found.sha256, found.kind, found.input_shapes
    else:
        sha256, kind, shapes = model.sha256, model.kind, model.input_shapes
        if connection.execute(_HOLD_MODEL, {"model_id": model_id}).first() is None:
            raise not_found("model", model_id)  # collected by retention meanwhile
    options = with_model_shapes(options, shapes)
    check_files_travel(options, kind)
    if compiler is not None and compiler.backend == QAIC:
        if converter_of(kind):
            raise ServiceError(
                "model_not_for_backend",
                f"the qaic backend compiles ONNX models; this one is {kind} (compile it with "
                "qpcfarm, which converts it, or upload its ONNX)",
                422,
            )
        vendor_flags(options)  # refuses qpcfarm-only options (422 option_not_for_backend)
    canonical = options.to_json()
    key = options_key(sha256, options, canonical, converter_of(kind), compiler=compiler)
    common: dict[str, Any] = {
        "team_id": team.id,
        "model_id": model_id,
        "options": canonical,
        "options_key": key,
        "device": options.device.name,
        "compiler": str(compiler) if compiler else None,
    }
    plain, guarded = _INSERTS[connection.dialect.name]
    qpc_id = _usable_cached_qpc(session, store, team, key, cache_scope, intact)
    if qpc_id is not None:
        values = {**common, "id": uuid.uuid4(), **_cache_hit_values(qpc_id)}
        return connection.execute(plain, values).one(), True

    converted = kind in FORMAT_KEYS  # the fit of its ONNX is checked in the worker
    if store is not None and not converted and upload_worth_checking(options, store.size(sha256)):
        with store.open(sha256) as stream:  # the model's header only: refused in seconds
            fit = check_upload_fit(stream, options)
        if fit is not None and not fit.fits:
            raise ServiceError(FIT_CODE, fit.message(), 422, {"fit": fit.as_dict()})
    for _ in range(ATTACH_ATTEMPTS):
        if team.max_queued_jobs is not None or team.max_stored_bytes is not None:
            active = connection.execute(_ACTIVE_JOB, {"team_id": team.id, "key": key}).first()
            if active is not None:
                return _attached(connection, active, batch), False
            quotas.check_queue(session, team, retry_after_s)
            quotas.check_storage(session, team)
        values = {**common, "id": uuid.uuid4(), "status": JobStatus.queued, "batch": batch}
        job = connection.execute(guarded, values).first()
        if job is not None:
            qpc_id = _usable_cached_qpc(session, store, team, key, cache_scope, intact)
            if qpc_id is not None:
                hit = {"job_id": job.id, **_cache_hit_values(qpc_id)}
                job = connection.execute(_MAKE_HIT, hit).one()
            return job, True
        active = connection.execute(_ACTIVE_JOB, {"team_id": team.id, "key": key}).first()
        if active is not None:
            return _attached(connection, active, batch), False
        # The job we collided with finished in between: try again (it left a QPC or failed).
    raise ServiceError("busy", "identical submits keep colliding; retry", 503)


ATTACH_ATTEMPTS = 5

_MAKE_INTERACTIVE = (
    update(_JOBS)
    .where(_JOBS.c.id == bindparam("job_id"), _JOBS.c.batch.is_(True))
    .values(batch=False)
    .returning(*_JOB_COLUMNS)
)


def _attached(connection: Any, job: JobRow, batch: bool) -> JobRow:
    """The active job an identical submit attaches to; an interactive submit's makes a
    batch (sweep) job interactive: a person now waits for it."""
    if batch or not job.batch:
        return job
    return connection.execute(_MAKE_INTERACTIVE, {"job_id": job.id}).first() or job


def _cache_hit_values(qpc_id: uuid.UUID) -> dict[str, Any]:
    now = utcnow()
    return {
        "status": JobStatus.succeeded,
        "stage": stages.DONE,
        "progress": 1.0,
        "cache_hit": True,
        "qpc_id": qpc_id,
        "created_at": now,
        "started_at": now,
        "finished_at": now,
    }


def _usable_cached_qpc(
    session: Session,
    store: BlobStore | None,
    team: Team,
    key: str,
    scope: CacheScope,
    intact: str | None = None,
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
    if qpc_id is not None:
        # Held to the commit: the collector cannot delete the row this job will name.
        held = session.connection().execute(_HOLD_QPC, {"qpc_id": qpc_id}).first()
        if held is None:  # collected by retention meanwhile: compile again
            return None
    if (
        qpc_id is not None
        and store is not None
        and not _blob_intact(session, store, qpc_id, intact)
    ):
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
    connection = session.connection()
    if team_id is None:
        return connection.execute(_FARM_LOOKUP, {"key": key}).scalar_one_or_none()
    return connection.execute(_TEAM_LOOKUP, {"key": key, "team_id": team_id}).scalar_one_or_none()


def copy_qpc(session: Session, qpc_id: uuid.UUID, team: Team) -> uuid.UUID | None:
    """The team's own row for the content of QPC `qpc_id` (made, with a copy of its report,
    unless the team has one); None when the source was collected meanwhile."""
    source = session.execute(
        select(Qpc).where(Qpc.id == qpc_id).with_for_update(key_share=True)
    ).scalar_one_or_none()
    if source is None:
        return None
    blob_guard.lock_for_write(session, source.sha256)
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


def _blob_intact(
    session: Session, store: BlobStore, qpc_id: uuid.UUID, intact: str | None = None
) -> bool:
    """Whether a cached QPC's blob is there and hashes to its name (read whole: a cache hit
    must never hand out damaged bytes; `intact`: a sha256 this submit has just hashed)."""
    sha256 = session.execute(select(Qpc.sha256).where(Qpc.id == qpc_id)).scalar_one()
    if sha256 == intact:
        return True
    try:
        verify_blob(store, sha256, found_by="cache")
    except (BlobCorrupt, BlobNotFound):
        return False
    return True


def _intact_cached_blob(
    session: Session,
    store: BlobStore | None,
    team: Team,
    model_id: uuid.UUID,
    model: Model | None,
    options: CompileOptions,
    compiler: Compiler | None,
    scope: CacheScope,
) -> str | None:
    """SQLite: the sha256 of the cached QPC the submit will find, hashed before the submit
    holds the database's write lock, in a session of its own (None: no QPC, or a damaged
    one, now quarantined). A damaged blob's quarantine is recorded in a transaction of its
    own, which would wait behind the submit's hold for the busy timeout. PostgreSQL holds
    rows, not the database: the check stays where it is."""
    if store is None or session.get_bind().dialect.name != "sqlite":
        return None
    with Session(bind=session.get_bind()) as side:
        if model is None:
            found = side.execute(_MODEL_OF, {"model_id": model_id}).first()
            if found is None or found.team_id != team.id:
                return None  # the submit answers not_found
            sha256, kind, shapes = found.sha256, found.kind, found.input_shapes
        else:
            sha256, kind, shapes = model.sha256, model.kind, model.input_shapes
        options = with_model_shapes(options, shapes)
        key = options_key(sha256, options, options.to_json(), converter_of(kind), compiler=compiler)
        qpc_id = _cached_qpc_id(side, key, team.id)
        if qpc_id is None and scope == "farm":
            qpc_id = _cached_qpc_id(side, key, None)
        if qpc_id is None:
            return None
        qpc_sha256: str = side.execute(select(Qpc.sha256).where(Qpc.id == qpc_id)).scalar_one()
    try:
        verify_blob(store, qpc_sha256, found_by="cache")
    except (BlobCorrupt, BlobNotFound):
        return None
    return qpc_sha256


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
    """Cancel a job: a queued one at once; a running one is flagged and its worker, which
    reads the flag every second, stops it within seconds (killing its compile process if it
    does not stop). A finished job cannot be cancelled (409). Caller commits."""
    if job.team_id != team.id:
        raise not_found("job", job.id)
    now = utcnow()
    queued = session.execute(
        update(CompileJob)
        .where(CompileJob.id == job.id, CompileJob.status == JobStatus.queued)
        .values(status=JobStatus.cancelled, stage=stages.CANCELLED, finished_at=now)
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
