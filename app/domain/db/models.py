"""The farm's tables, as typed SQLAlchemy 2 ORM classes (portable: SQLite and PostgreSQL).

A job row is the source of truth for a compile; QPCs and their reports are stored once per
distinct content (sha256), whatever number of jobs produced or reused them. Blob bytes live in
the blob store (a directory or the `blobs`/`blob_chunks` tables), rows only name them by sha256.
"""

from __future__ import annotations

import datetime as dt
import enum
import uuid
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Enum,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
    Uuid,
    false,
    text,
)
from sqlalchemy.orm import Mapped, mapped_column, relationship

from app.domain.db.base import Base, utcnow

SHA256_LEN = 64


class JobStatus(enum.StrEnum):
    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"

    @property
    def is_active(self) -> bool:
        return self in (JobStatus.queued, JobStatus.running)


ACTIVE_STATUSES = (JobStatus.queued, JobStatus.running)


def _uuid_pk() -> Mapped[uuid.UUID]:
    return mapped_column(Uuid, primary_key=True, default=uuid.uuid4)


def _created() -> Mapped[dt.datetime]:
    return mapped_column(default=utcnow)


class Team(Base):
    __tablename__ = "teams"

    id: Mapped[uuid.UUID] = _uuid_pk()
    name: Mapped[str] = mapped_column(String(100), unique=True)
    created_at: Mapped[dt.datetime] = _created()
    max_queued_jobs: Mapped[int | None] = mapped_column(Integer)
    """Quota: compile jobs queued at once (None: no limit; a submit beyond it answers 429)."""
    max_running_jobs: Mapped[int | None] = mapped_column(Integer)
    """Quota: compile jobs running at once (None: no limit; workers leave the rest queued)."""
    max_stored_bytes: Mapped[int | None] = mapped_column(BigInteger)
    """Quota: bytes of models and QPCs in the team's records (None: no limit; 413 beyond)."""
    retention_days: Mapped[float | None] = mapped_column(Float)
    """Unreferenced models and QPCs older than this are collected (None: the farm's
    `retention_days` setting)."""


class ApiKey(Base):
    """A bearer key of a team. Only its sha256 is stored; `prefix` identifies it in listings."""

    __tablename__ = "api_keys"

    id: Mapped[uuid.UUID] = _uuid_pk()
    team_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("teams.id", ondelete="CASCADE"), index=True
    )
    key_hash: Mapped[str] = mapped_column(String(SHA256_LEN), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))
    name: Mapped[str | None] = mapped_column(String(100))
    admin: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    """A team admin's key: it may list, create and revoke the team's keys (`/v1/keys`)."""
    created_at: Mapped[dt.datetime] = _created()
    revoked_at: Mapped[dt.datetime | None] = mapped_column()

    team: Mapped[Team] = relationship()


class WebSession(Base):
    """A signed-in browser: its cookie holds a random token, this row only the token's
    sha256. It ends at `expires_at`, at sign-out, or when the key it was opened with is
    revoked (the lookup joins the key)."""

    __tablename__ = "web_sessions"

    token_hash: Mapped[str] = mapped_column(String(SHA256_LEN), primary_key=True)
    team_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("teams.id", ondelete="CASCADE"), index=True
    )
    api_key_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("api_keys.id", ondelete="CASCADE"), index=True
    )
    created_at: Mapped[dt.datetime] = _created()
    expires_at: Mapped[dt.datetime] = mapped_column(index=True)


class Model(Base):
    """An uploaded model: a plain `.onnx` (kind "onnx") or an archive with external data."""

    __tablename__ = "models"

    id: Mapped[uuid.UUID] = _uuid_pk()
    team_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("teams.id", ondelete="CASCADE"), index=True
    )
    sha256: Mapped[str] = mapped_column(String(SHA256_LEN), index=True)
    size: Mapped[int] = mapped_column(BigInteger)
    name: Mapped[str] = mapped_column(String(255))
    kind: Mapped[str] = mapped_column(String(16), default="onnx")
    opset: Mapped[int] = mapped_column(Integer)
    inputs: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    """[{"name", "dtype", "shape"}]; a symbolic dim is its name (a string), else an int."""
    outputs: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    input_shapes: Mapped[str | None] = mapped_column(Text, nullable=True)
    """A TensorFlow / PyTorch model's `-input-shapes` given at upload (`x:1x3x224x224,...`),
    the default of its compiles (`services.jobs.with_model_shapes`); None for ONNX."""
    created_at: Mapped[dt.datetime] = _created()


class Qpc(Base):
    """A compiled program in a team's records: one row per team and content, whatever number
    of the team's jobs produced it (the bytes are one blob, however many teams hold it)."""

    __tablename__ = "qpcs"
    __table_args__ = (UniqueConstraint("team_id", "sha256"),)

    id: Mapped[uuid.UUID] = _uuid_pk()
    team_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("teams.id", ondelete="CASCADE"), index=True
    )
    sha256: Mapped[str] = mapped_column(String(SHA256_LEN), index=True)
    size: Mapped[int] = mapped_column(BigInteger)
    compiler_version: Mapped[str] = mapped_column(String(32))
    options_key: Mapped[str] = mapped_column(String(SHA256_LEN), index=True)
    """The cache key of the first compile that produced it (see services.jobs.options_key)."""
    device: Mapped[str] = mapped_column(String(64))
    requirements: Mapped[dict[str, Any]] = mapped_column(JSON)
    """What the QPC needs from a device (cores, VTCM, DDR, dtypes), from its network desc."""
    created_at: Mapped[dt.datetime] = _created()
    pinned_at: Mapped[dt.datetime | None] = mapped_column()
    """Set while a user keeps the QPC: retention never collects a pinned QPC."""

    report: Mapped[CompileReport | None] = relationship(back_populates="qpc", uselist=False)


ACTIVE_JOB_PREDICATE = text("status IN ('queued', 'running') AND NOT cancel_requested")
"""A compile job in flight that an identical submit attaches to (see `compile_jobs`' index)."""


class CompileJob(Base):
    __tablename__ = "compile_jobs"
    __table_args__ = (
        # One compile in flight per team and cache key, whatever number of API processes
        # take identical submits at once: the database refuses the second row.
        Index(
            "uq_compile_jobs_active_team_key",
            "team_id",
            "options_key",
            unique=True,
            sqlite_where=ACTIVE_JOB_PREDICATE,
            postgresql_where=ACTIVE_JOB_PREDICATE,
        ),
    )

    id: Mapped[uuid.UUID] = _uuid_pk()
    team_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("teams.id", ondelete="CASCADE"), index=True
    )
    model_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("models.id", ondelete="CASCADE"), index=True
    )
    options: Mapped[dict[str, Any]] = mapped_column(JSON)
    """Canonical options (`CompileOptions.to_json()`): what the compile runs with."""
    options_key: Mapped[str] = mapped_column(String(SHA256_LEN), index=True)
    device: Mapped[str] = mapped_column(String(64))
    status: Mapped[JobStatus] = mapped_column(
        Enum(JobStatus, native_enum=False, length=16, validate_strings=True),
        default=JobStatus.queued,
        index=True,
    )
    stage: Mapped[str | None] = mapped_column(String(64))
    progress: Mapped[float] = mapped_column(Float, default=0.0)
    error_code: Mapped[str | None] = mapped_column(String(64))
    error_message: Mapped[str | None] = mapped_column(Text)
    error_detail: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    """Number of times a worker claimed the job (a re-claim after a dead worker adds one)."""
    worker: Mapped[str | None] = mapped_column(String(255))
    cache_hit: Mapped[bool] = mapped_column(Boolean, default=False)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    compiler: Mapped[str | None] = mapped_column(String(64))
    """The compiler the job asked for, `backend@version` (`app.domain.compilers`); None: the
    farm's default, any worker's `qpcfarm`."""
    batch: Mapped[bool] = mapped_column(Boolean, server_default=false())
    """A sweep's compile: workers run the interactive compiles queued before any batch one."""
    qpc_id: Mapped[uuid.UUID | None] = mapped_column(ForeignKey("qpcs.id"), index=True)
    created_at: Mapped[dt.datetime] = _created()
    enqueued_at: Mapped[dt.datetime | None] = mapped_column()
    """When the job id was last handed to the broker by the reaper."""
    started_at: Mapped[dt.datetime | None] = mapped_column()
    finished_at: Mapped[dt.datetime | None] = mapped_column()
    heartbeat_at: Mapped[dt.datetime | None] = mapped_column()

    model: Mapped[Model] = relationship()
    qpc: Mapped[Qpc | None] = relationship()


class WorkerCompiler(Base):
    """A compiler a live worker has: one row per worker and compiler, its `seen_at` refreshed
    while the worker runs (a row not seen for a while is a worker gone)."""

    __tablename__ = "worker_compilers"

    worker: Mapped[str] = mapped_column(String(255), primary_key=True)
    backend: Mapped[str] = mapped_column(String(16), primary_key=True)
    version: Mapped[str] = mapped_column(String(48), primary_key=True)
    seen_at: Mapped[dt.datetime] = mapped_column(default=utcnow, index=True)


class CompileReport(Base):
    """Perf metrics, perf warnings, pass times and the log of the compile that made a QPC."""

    __tablename__ = "compile_reports"

    id: Mapped[uuid.UUID] = _uuid_pk()
    qpc_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("qpcs.id", ondelete="CASCADE"), unique=True
    )
    metrics: Mapped[dict[str, Any]] = mapped_column(JSON)
    warnings: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    pass_times: Mapped[dict[str, float]] = mapped_column(JSON)
    log: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[dt.datetime] = _created()

    qpc: Mapped[Qpc] = relationship(back_populates="report")


class Validation(Base):
    """One run of the QPC validator: of a stored QPC (`qpc_id`) or of an uploaded file."""

    __tablename__ = "validations"

    id: Mapped[uuid.UUID] = _uuid_pk()
    team_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("teams.id", ondelete="CASCADE"), index=True
    )
    qpc_id: Mapped[uuid.UUID | None] = mapped_column(
        ForeignKey("qpcs.id", ondelete="SET NULL"), index=True
    )
    qpc_sha256: Mapped[str] = mapped_column(String(SHA256_LEN))
    device: Mapped[str | None] = mapped_column(String(64))
    ok: Mapped[bool] = mapped_column(Boolean)
    checks: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    created_at: Mapped[dt.datetime] = _created()


class ProfileJob(Base):
    """A run of a stored QPC on the functional runtime with stats, post-processed by opstats.

    Queued and claimed like a compile job (the worker tells the kinds apart by the id's
    table). The results are the opstats summary as JSON (`operator_totals`, per-core and port
    figures), text and CSV, and the Chrome trace as a blob (it can be large)."""

    __tablename__ = "profile_jobs"

    id: Mapped[uuid.UUID] = _uuid_pk()
    team_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("teams.id", ondelete="CASCADE"), index=True
    )
    qpc_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("qpcs.id", ondelete="CASCADE"), index=True)
    status: Mapped[JobStatus] = mapped_column(
        Enum(JobStatus, native_enum=False, length=16, validate_strings=True),
        default=JobStatus.queued,
        index=True,
    )
    iterations: Mapped[int] = mapped_column(Integer, default=1)
    inputs_sha256: Mapped[str | None] = mapped_column(String(SHA256_LEN))
    """The uploaded `.npz` of inputs; None: random inputs of the QPC's dtypes and shapes."""
    error_code: Mapped[str | None] = mapped_column(String(64))
    error_message: Mapped[str | None] = mapped_column(Text)
    error_detail: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    summary: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    summary_text: Mapped[str | None] = mapped_column(Text)
    summary_csv: Mapped[str | None] = mapped_column(Text)
    trace_sha256: Mapped[str | None] = mapped_column(String(SHA256_LEN))
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    worker: Mapped[str | None] = mapped_column(String(255))
    created_at: Mapped[dt.datetime] = _created()
    enqueued_at: Mapped[dt.datetime | None] = mapped_column()
    started_at: Mapped[dt.datetime | None] = mapped_column()
    finished_at: Mapped[dt.datetime | None] = mapped_column()
    heartbeat_at: Mapped[dt.datetime | None] = mapped_column()

    qpc: Mapped[Qpc] = relationship()


class Blob(Base):
    """A complete blob of the database blob store; its row is written last, so it exists only
    once every chunk is in."""

    __tablename__ = "blobs"

    sha256: Mapped[str] = mapped_column(String(SHA256_LEN), primary_key=True)
    size: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[dt.datetime] = _created()


class BlobChunk(Base):
    """Chunk `seq` (0-based, 1 MiB each but the last) of a blob. While an upload is under way
    its chunks carry a temporary key, renamed to the sha256 when the hash is known."""

    __tablename__ = "blob_chunks"

    sha256: Mapped[str] = mapped_column(String(SHA256_LEN), primary_key=True)
    seq: Mapped[int] = mapped_column(Integer, primary_key=True)
    data: Mapped[bytes] = mapped_column(LargeBinary)


class QuarantinedBlob(Base):
    """A blob whose bytes did not hash to its name when read: moved out of the store to
    `location` (kept for inspection) by whoever found it (`download`, `cache`, `compile`,
    `profile`, `validation`, `scrub`). The same sha256 may be quarantined again after a
    compile or upload stored it afresh and it was damaged once more."""

    __tablename__ = "quarantined_blobs"

    id: Mapped[uuid.UUID] = _uuid_pk()
    sha256: Mapped[str] = mapped_column(String(SHA256_LEN), index=True)
    actual_sha256: Mapped[str] = mapped_column(String(SHA256_LEN))
    size: Mapped[int] = mapped_column(BigInteger)
    found_by: Mapped[str] = mapped_column(String(32))
    location: Mapped[str] = mapped_column(String(255))
    found_at: Mapped[dt.datetime] = _created()


class Sweep(Base):
    """A model-configurator sweep: a search space of compile and runtime parameters, run as
    ordinary compile jobs (one per compile group, see `sweep_compiles`) and ranked by the cost
    model's estimate. The space is stored whole (`compiler_core.configurator` rebuilds it);
    the results are read from the compile jobs and their reports, never copied here."""

    __tablename__ = "sweeps"

    id: Mapped[uuid.UUID] = _uuid_pk()
    team_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("teams.id", ondelete="CASCADE"), index=True
    )
    model_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("models.id", ondelete="CASCADE"), index=True
    )
    mode: Mapped[str] = mapped_column(String(16))
    objective: Mapped[str] = mapped_column(String(40))
    latency_bound_us: Mapped[float | None] = mapped_column(Float)
    space: Mapped[dict[str, Any]] = mapped_column(JSON)
    """`SearchSpace.to_json()`: base flags, constraints and every row as given."""
    status: Mapped[JobStatus] = mapped_column(
        Enum(JobStatus, native_enum=False, length=16, validate_strings=True),
        default=JobStatus.running,
        index=True,
    )
    error_message: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[dt.datetime] = _created()
    finished_at: Mapped[dt.datetime | None] = mapped_column()


class SweepCompile(Base):
    """One compile group of a sweep and the compile job that runs it (created for the sweep,
    a cache hit, or an identical job in flight it attached to: `created_job` False)."""

    __tablename__ = "sweep_compiles"
    __table_args__ = (UniqueConstraint("sweep_id", "group_index"),)

    id: Mapped[uuid.UUID] = _uuid_pk()
    sweep_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("sweeps.id", ondelete="CASCADE"), index=True
    )
    group_index: Mapped[int] = mapped_column(Integer)
    compile_job_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("compile_jobs.id", ondelete="CASCADE"), index=True
    )
    created_job: Mapped[bool] = mapped_column(Boolean, default=True)
    round: Mapped[int] = mapped_column(Integer, default=0)
    """The optimize round that asked for it (0 for every compile of a brute sweep)."""
    metrics: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    """The few perf-metric figures scoring needs, copied from the compile's report when the job
    succeeded (a sweep's page then never reads whole reports)."""
    created_at: Mapped[dt.datetime] = _created()
