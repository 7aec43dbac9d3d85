"""Profile jobs: run a stored QPC on the functional runtime with stats, then opstats.

The farm's version of the vendor loop `qaic-runner --profiling-out-dir` + `qaic-opstats`:
a worker fetches the QPC, builds the inputs (an uploaded `.npz`, or values of the QPC's
dtypes and shapes), runs `iterations` inferences writing the raw stats buffers, and stores
opstats' summary (JSON, text, CSV) on the row and its Chrome trace as a blob. A QPC compiled
below `-stats-level=70` ends the job failed with opstats' `stats_level_too_low`.

Jobs are queued and claimed like compile jobs (see services.jobs): the row is the truth, a
claim is one conditional UPDATE, every later write is conditional on the claim still holding.
All figures are estimated (the runtime fills the buffers from the cost model).
"""

from __future__ import annotations

import datetime as dt
import io
import json
import logging
import tempfile
import uuid
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from sqlalchemy import and_, or_, select, update
from sqlalchemy.orm import Session

from app.blobs import BlobCorrupt, BlobNotFound, BlobRef, BlobStore, BlobTooLarge
from app.blobs.base import Source
from app.blobs.integrity import verified_bytes, verified_path
from app.db.base import utcnow
from app.db.models import ACTIVE_STATUSES, JobStatus, ProfileJob, Qpc, Team
from app.db.ops import rowcount
from app.services.errors import ServiceError, internal_error_message, not_found
from app.services.heartbeat import HeartbeatThread
from app.services.jobs import (
    DEFAULT_HEARTBEAT_S,
    DEFAULT_REQUEUE_AFTER_S,
    DEFAULT_STALE_AFTER_S,
    stale_rows,
)
from app.services.models import too_large
from app.services.qpcs import get_qpc
from compiler_core import CompileError

log = logging.getLogger(__name__)

MAX_ITERATIONS = 100
"""Inferences one profile job may run (the functional runtime is slow on big networks)."""
TRACE_NAME = "trace.json"


# ---------------------------------------------------------------------------- API side


def check_iterations(iterations: int) -> int:
    if not 1 <= iterations <= MAX_ITERATIONS:
        raise ServiceError(
            "invalid_iterations", f"iterations must be 1..{MAX_ITERATIONS}, not {iterations}", 422
        )
    return iterations


def store_inputs(store: BlobStore, stream: Source, *, max_bytes: int | None = None) -> BlobRef:
    """Store an uploaded `.npz` of inputs; refuse (422 `bad_inputs`) what numpy cannot read
    as arrays without pickles. Names, shapes and dtypes are checked by the runtime."""
    try:
        ref = store.put(stream, max_bytes=max_bytes)
    except BlobTooLarge as exc:
        raise too_large(exc) from None
    with store.open(ref.sha256) as src:
        try:
            archive = np.load(src, allow_pickle=False)
            if not isinstance(archive, np.lib.npyio.NpzFile) or not archive.files:
                raise ValueError("not an .npz of named arrays")
            with archive:
                for name in archive.files:
                    archive[name]  # noqa: B018 - reading each array validates it
        except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
            raise ServiceError(
                "bad_inputs", f"the inputs must be a numpy .npz of named arrays: {exc}", 422
            ) from None
    return ref


def submit(
    session: Session,
    team: Team,
    qpc: Qpc,
    *,
    iterations: int = 1,
    inputs_sha256: str | None = None,
) -> ProfileJob:
    """Queue a profile of a QPC the team can see. The caller commits, then enqueues."""
    get_qpc(session, team, qpc.id)  # 404 unless the team may see it
    job = ProfileJob(
        team_id=team.id,
        qpc_id=qpc.id,
        status=JobStatus.queued,
        iterations=check_iterations(iterations),
        inputs_sha256=inputs_sha256,
    )
    session.add(job)
    session.flush()
    return job


def get_profile(session: Session, team: Team, profile_id: uuid.UUID) -> ProfileJob:
    job = session.get(ProfileJob, profile_id)
    if job is None or job.team_id != team.id:
        raise not_found("profile", profile_id)
    return job


def profiles_of_qpc(
    session: Session, team: Team, qpc_id: uuid.UUID, limit: int = 20
) -> list[ProfileJob]:
    """The team's profiles of a QPC, newest first."""
    return list(
        session.execute(
            select(ProfileJob)
            .where(ProfileJob.team_id == team.id, ProfileJob.qpc_id == qpc_id)
            .order_by(ProfileJob.created_at.desc(), ProfileJob.id)
            .limit(limit)
        ).scalars()
    )


def trace_bytes(store: BlobStore, job: ProfileJob) -> bytes:
    """The stored Chrome trace of a finished profile (409 `not_ready` before that)."""
    if job.trace_sha256 is None:
        raise not_ready(job)
    return verified_bytes(store, job.trace_sha256, found_by="profile")


def not_ready(job: ProfileJob) -> ServiceError:
    return ServiceError(
        "not_ready", f"profile {job.id} is {job.status.value}: it has no results", 409
    )


def is_profile(session: Session, job_id: uuid.UUID) -> bool:
    """Whether an enqueued id names a profile job (ids of both kinds share the queue)."""
    found = session.execute(
        select(ProfileJob.id).where(ProfileJob.id == job_id)
    ).scalar_one_or_none()
    session.commit()
    return found is not None


def pending_ids(
    session: Session,
    now: dt.datetime | None = None,
    *,
    stale_after_s: float = DEFAULT_STALE_AFTER_S,
    requeue_after_s: float = DEFAULT_REQUEUE_AFTER_S,
) -> list[uuid.UUID]:
    """As `jobs.stale_jobs` for profiles: queued since `requeue_after_s` after their last
    enqueue, or running with a heartbeat older than `stale_after_s`. Stamps them enqueued
    now; the caller commits, then enqueues."""
    return stale_rows(
        session, ProfileJob, now, stale_after_s=stale_after_s, requeue_after_s=requeue_after_s
    )


def queued_ids(session: Session) -> list[uuid.UUID]:
    """Every queued profile, oldest first (an in-process queue's restart)."""
    return list(
        session.execute(
            select(ProfileJob.id)
            .where(ProfileJob.status == JobStatus.queued)
            .order_by(ProfileJob.created_at)
        ).scalars()
    )


# ------------------------------------------------------------------------- worker side


def claim(
    session: Session,
    job_id: uuid.UUID,
    worker: str,
    *,
    now: dt.datetime | None = None,
    stale_after_s: float = DEFAULT_STALE_AFTER_S,
) -> ProfileJob | None:
    """queued -> running, or re-take a running profile whose worker stopped heart-beating
    (attempts + 1). Exactly one of concurrent callers wins; the others get None. Commits."""
    now = now or utcnow()
    stale = and_(
        ProfileJob.status == JobStatus.running,
        ProfileJob.heartbeat_at < now - dt.timedelta(seconds=stale_after_s),
    )
    won = rowcount(
        session.execute(
            update(ProfileJob)
            .where(ProfileJob.id == job_id, or_(ProfileJob.status == JobStatus.queued, stale))
            .values(
                status=JobStatus.running,
                worker=worker[:255],
                attempts=ProfileJob.attempts + 1,
                started_at=now,
                heartbeat_at=now,
            ),
            execution_options={"synchronize_session": False},
        )
    )
    session.commit()
    if not won:
        return None
    return session.get(ProfileJob, job_id, populate_existing=True)


class Heartbeat(HeartbeatThread):
    """Keeps a claimed profile's heartbeat fresh while the runtime runs (it has no progress
    callback), so the sweep does not hand a live profile to a second worker."""

    def __init__(
        self,
        session_factory: Callable[[], Session],
        job: ProfileJob,
        interval_s: float = DEFAULT_HEARTBEAT_S,
    ) -> None:
        assert job.worker is not None, "a heartbeat needs a claimed job"
        job_id, worker = job.id, job.worker

        def beat(session: Session) -> bool:
            session.execute(
                update(ProfileJob)
                .where(
                    ProfileJob.id == job_id,
                    ProfileJob.status == JobStatus.running,
                    ProfileJob.worker == worker,
                )
                .values(heartbeat_at=utcnow()),
                execution_options={"synchronize_session": False},
            )
            session.commit()
            return True  # profiles are not cancelled: beat until the run ends

        super().__init__(session_factory, beat, interval_s, f"profile {job_id}")


def fail(
    session: Session,
    job: ProfileJob,
    code: str,
    message: str,
    detail: dict[str, Any] | None = None,
) -> None:
    """Mark a queued or running profile failed with a structured error. Commits."""
    session.execute(
        update(ProfileJob)
        .where(ProfileJob.id == job.id, ProfileJob.status.in_(ACTIVE_STATUSES))
        .values(
            status=JobStatus.failed,
            error_code=code[:64],
            error_message=message,
            error_detail=detail,
            finished_at=utcnow(),
        ),
        execution_options={"synchronize_session": False},
    )
    session.commit()
    session.refresh(job)


def run_profile(session: Session, store: BlobStore, job: ProfileJob) -> ProfileJob:
    """Run a profile this worker has claimed and store its results; ends the job succeeded
    or failed (a CompileError keeps its code, e.g. `stats_level_too_low` or `bad_inputs`;
    anything else is `internal_error`). A job not running is returned untouched. Commits."""
    if job.status != JobStatus.running:
        return job
    try:
        results = _profile(session, store, job)
        now = utcnow()
        session.execute(
            update(ProfileJob)
            .where(
                ProfileJob.id == job.id,
                ProfileJob.status == JobStatus.running,
                ProfileJob.worker == job.worker,
            )
            .values(status=JobStatus.succeeded, finished_at=now, heartbeat_at=now, **results),
            execution_options={"synchronize_session": False},
        )
        session.commit()
        session.refresh(job)
    except CompileError as exc:
        session.rollback()
        fail(session, job, exc.code, exc.message, exc.to_dict())
    except Exception as exc:
        log.exception("profile %s failed unexpectedly", job.id)
        session.rollback()
        fail(session, job, "internal_error", internal_error_message(exc))
    return job


def _profile(session: Session, store: BlobStore, job: ProfileJob) -> dict[str, Any]:
    from compiler_core.profiling import opstats
    from compiler_core.qpc.container import load_qpc
    from compiler_core.runtime import run_qpc

    qpc = session.get(Qpc, job.qpc_id)
    if qpc is None:
        raise CompileError("qpc_missing", f"QPC {job.qpc_id} no longer exists")
    with tempfile.TemporaryDirectory(prefix="qpcfarm-profile-") as tmp:
        work = Path(tmp)
        try:
            with verified_path(
                store, qpc.sha256, work, "programqpc.bin", found_by="profile"
            ) as qpc_path:
                layout, _ = opstats.load_layout(qpc_path)
                if layout.level < opstats.OPSTATS_LEVEL:
                    opstats.analyse(qpc_path, [])  # raises stats_level_too_low, saying why
                with load_qpc(qpc_path) as container:
                    network = container.network
                    assert network is not None  # load_layout refuses foreign QPCs
                    shapes = {io.name: (io.dtype, io.dims) for io in network.inputs}
                if job.inputs_sha256 is not None:
                    inputs = _load_inputs(store, job.inputs_sha256)
                else:
                    inputs = synthetic_inputs(shapes, seed=job.id.int % (1 << 32))
                raw_dir = work / "raw"
                run_qpc(qpc_path, inputs, profiling_out_dir=raw_dir, iterations=job.iterations)
                stats = opstats.analyse(qpc_path, opstats.read_stats_dir(raw_dir))
        except BlobNotFound:
            raise CompileError("blob_missing", "the QPC or its inputs are missing") from None
        except BlobCorrupt:
            raise CompileError(
                "blob_corrupt",
                "the stored QPC or inputs failed their integrity check and were quarantined",
            ) from None
        trace = json.dumps(opstats.chrome_trace(stats), separators=(",", ":")).encode()
    ref = store.put(io.BytesIO(trace))
    return {
        "summary": summary_json(stats),
        "summary_text": opstats.render_summary(stats),
        "summary_csv": opstats.render_csv(stats),
        "trace_sha256": ref.sha256,
    }


def _load_inputs(store: BlobStore, sha256: str) -> dict[str, np.ndarray]:
    data = io.BytesIO(verified_bytes(store, sha256, found_by="profile"))
    with np.load(data, allow_pickle=False) as archive:
        return {name: archive[name] for name in archive.files}


def synthetic_inputs(
    shapes: dict[str, tuple[str, tuple[int, ...]]], seed: int = 0
) -> dict[str, np.ndarray]:
    """Inputs of the QPC's dtypes and shapes: floats drawn from N(0, 1), integers and
    booleans zero (always a valid index). The modelled cycles do not depend on the values."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for name, (dtype_name, dims) in shapes.items():
        dtype = np.dtype(dtype_name.removesuffix("q"))  # int8q etc. carry plain integers
        if np.issubdtype(dtype, np.floating):
            out[name] = rng.standard_normal(dims).astype(dtype)
        else:
            out[name] = np.zeros(dims, dtype=dtype)
    return out


def summary_json(stats: Any) -> dict[str, Any]:
    """What the API and the pages show of an `OpStats`: per inference, estimated."""
    from compiler_core.profiling.opstats import operator_totals

    total = stats.inference_pcycles
    operators = operator_totals(stats)
    by_type: dict[str, dict[str, Any]] = {}
    for row in operators:
        entry = by_type.setdefault(row["type"], {"type": row["type"], "cycles": 0.0, "ops": 0})
        entry["cycles"] += row["cycles"]
        entry["ops"] += 1
    types = sorted(by_type.values(), key=lambda r: -float(r["cycles"]))
    for entry in types:
        entry["share_percent"] = 100.0 * entry["cycles"] / total if total else 0.0
    return {
        "estimated": True,
        "network": stats.network,
        "stats_level": stats.level,
        "inferences": stats.inferences,
        "batchsize": stats.batchsize,
        "clock_hz": stats.clock_hz,
        "inference_cycles": total,
        "inference_us": stats.us(total),
        "operators": operators,
        "op_types": types,
        "cores": [
            {
                "core": c.core,
                "inference_pcycles": c.inference_pcycles,
                "activation_pcycles": c.activation_pcycles,
                "thread_ucycles": c.thread_ucycles,
            }
            for c in stats.cores
        ],
        "ports": stats.ports,
    }
