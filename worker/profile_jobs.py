"""A profile job on a worker: run a stored QPC on the functional runtime with stats, then
opstats; store the summary (JSON, text, CSV) on the row and the Chrome trace as a blob.

The farm's version of the vendor loop `qaic-runner --profiling-out-dir` + `qaic-opstats`.
A QPC compiled below `-stats-level=70` ends the job failed with opstats'
`stats_level_too_low`. All figures are estimated (the runtime fills the buffers from the
cost model). Claimed and heart-beaten like a compile (`worker.runner`).
"""

from __future__ import annotations

import io
import json
import logging
import warnings
from pathlib import Path
from typing import Any

import numpy as np
from sqlalchemy import update
from sqlalchemy.orm import Session

from app.domain.blobs import BlobCorrupt, BlobNotFound, BlobStore
from app.domain.blobs.integrity import spill_verified, verified_bytes, verified_path
from app.domain.compilers import QAIC
from app.domain.db.base import utcnow
from app.domain.db.faults import DATABASE_FAULTS
from app.domain.db.models import JobStatus, ProfileJob, Qpc
from app.domain.services.errors import internal_error_message
from compiler_core import CompileError
from worker import claims
from worker.workdirs import job_folder

log = logging.getLogger(__name__)


def run_profile(
    session: Session, store: BlobStore, job: ProfileJob, work_root: Path | None = None
) -> ProfileJob:
    """Run a profile this worker has claimed and store its results; ends the job succeeded
    or failed (a CompileError keeps its code, e.g. `stats_level_too_low` or `bad_inputs`;
    anything else is `internal_error`). Its files live in a folder under `work_root`
    (`worker.workdirs`). A job not running is returned untouched. Commits."""
    if job.status != JobStatus.running:
        return job
    job_id = job.id  # for the log after a rollback, which expires the row's attributes
    try:
        results = _profile(session, store, job, work_root)
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
        claims.fail(session, ProfileJob, job, exc.code, exc.message, exc.to_dict())
    except DATABASE_FAULTS:  # not the job's fault: left running, to be run again
        session.rollback()
        log.warning("profile %s: the database did not answer; left to be run again", job_id)
        raise
    except Exception as exc:
        log.exception("profile %s failed unexpectedly", job.id)
        session.rollback()
        claims.fail(session, ProfileJob, job, "internal_error", internal_error_message(exc))
    return job


def _profile(
    session: Session, store: BlobStore, job: ProfileJob, work_root: Path | None
) -> dict[str, Any]:
    from compiler_core.profiling import opstats
    from compiler_core.qpc.container import load_qpc
    from compiler_core.runtime import QpcSession
    from compiler_core.runtime.numerics import NonFiniteWarning

    qpc = session.get(Qpc, job.qpc_id)
    if qpc is None:
        raise CompileError("qpc_missing", f"QPC {job.qpc_id} no longer exists")
    if qpc.compiler_version.startswith(f"{QAIC}@"):
        return _vendor_profile(store, job, qpc, work_root)
    with job_folder("profile", job.id, work_root) as work:
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
                with QpcSession(qpc_path) as runtime, warnings.catch_warnings():
                    warnings.simplefilter("ignore", NonFiniteWarning)  # kept in the summary
                    runtime.run(inputs, profiling_out_dir=raw_dir, iterations=job.iterations)
                    numerics = runtime.numerics
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
    summary = summary_json(stats)
    if numerics is not None:  # outputs with NaN or infinities: where they began, the fix
        summary["numerics"] = numerics.to_dict()
    return {
        "summary": summary,
        "summary_text": opstats.render_summary(stats),
        "summary_csv": opstats.render_csv(stats),
        "trace_sha256": ref.sha256,
    }


def _vendor_profile(
    store: BlobStore, job: ProfileJob, qpc: Qpc, work_root: Path | None
) -> dict[str, Any]:
    """A QPC the vendor's compiler made runs on a card with the vendor's qaic-runner and
    qaic-opstats (`worker.qaic_backend.profile`); it needs a card and random inputs."""
    from app.domain.settings import get_settings
    from worker import qaic_backend

    if job.inputs_sha256 is not None:
        raise CompileError(
            "bad_inputs",
            "inputs for a QPC of the vendor's compiler are not supported yet; profile it "
            "with the runner's random inputs",
        )
    settings = get_settings()
    with job_folder("profile", job.id, work_root) as work:
        (work / "qpc").mkdir()
        try:  # the runner takes a folder holding programqpc.bin: always a copy
            qpc_path = spill_verified(
                store, qpc.sha256, work / "qpc" / "programqpc.bin", found_by="profile"
            )
            values = qaic_backend.profile(
                settings.qaic_sdk, qpc_path, work, iterations=job.iterations,
                device_pattern=settings.qaic_devices,
            )  # fmt: skip
        except BlobNotFound:
            raise CompileError("blob_missing", "the QPC is missing") from None
        except BlobCorrupt:
            raise CompileError(
                "blob_corrupt", "the stored QPC failed its integrity check and was quarantined"
            ) from None
    trace = values.pop("trace")
    values["trace_sha256"] = store.put(io.BytesIO(trace)).sha256 if trace is not None else None
    return values


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
