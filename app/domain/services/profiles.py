"""Profile jobs on the API side: submit (random or uploaded `.npz` inputs), read, and the
stored results. What a worker does with a profile is in `worker.profile_jobs`."""

from __future__ import annotations

import logging
import uuid
import zipfile
import zlib
from typing import BinaryIO

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session

from app.domain.blobs import BlobRef, BlobStore, BlobTooLarge
from app.domain.blobs.base import Source
from app.domain.blobs.integrity import verified_bytes
from app.domain.db.models import CompileJob, JobStatus, ProfileJob, Qpc, Team
from app.domain.services.errors import ServiceError, not_found
from app.domain.services.models import too_large
from app.domain.services.qpcs import get_qpc
from compiler_core import CompileOptions
from compiler_core.file_kinds import HEAD_BYTES, inputs_problem, sniff
from compiler_core.profiling.opstats import OPSTATS_LEVEL

log = logging.getLogger(__name__)

MAX_ITERATIONS = 100
"""Inferences one profile job may run (the functional runtime is slow on big networks)."""
TRACE_NAME = "trace.json"
STATS_LEVEL_DEFAULT = CompileOptions().stats_level


def check_iterations(iterations: int) -> int:
    if not 1 <= iterations <= MAX_ITERATIONS:
        raise ServiceError(
            "invalid_iterations", f"iterations must be 1..{MAX_ITERATIONS}, not {iterations}", 422
        )
    return iterations


MAX_INPUT_ARRAYS = 256
"""Arrays one profile's `.npz` may hold (a network has a few inputs)."""


def store_inputs(
    store: BlobStore,
    stream: Source,
    *,
    max_bytes: int | None = None,
    max_array_bytes: int = 256 << 20,
) -> BlobRef:
    """Store an uploaded `.npz` of inputs; refuse (422 `bad_inputs`, 413
    `inputs_too_large`) what is not a zip of plain `.npy` arrays declaring at most
    `max_array_bytes` in total. Only each member's `.npy` header is read (its dtype and
    shape): nothing is decompressed in the API, so a small file declaring gigabytes of zeros
    costs a few KB here. Names and shapes are matched to the QPC by the runtime."""
    try:
        ref = store.put(stream, max_bytes=max_bytes)
    except BlobTooLarge as exc:
        raise too_large(exc) from None
    with store.open(ref.sha256) as src:
        check_npz_headers(src, max_array_bytes)
    return ref


def check_npz_headers(src: BinaryIO, max_array_bytes: int) -> None:
    """Check an `.npz` from its zip directory and its members' `.npy` headers."""
    problem = inputs_problem(sniff(src.read(HEAD_BYTES)))
    if problem is not None:
        raise ServiceError("bad_inputs", f"the uploaded inputs {problem}", 422)
    src.seek(0)
    try:
        with zipfile.ZipFile(src) as archive:
            infos = archive.infolist()
            if not infos:
                raise ValueError("it holds no arrays")
            if len(infos) > MAX_INPUT_ARRAYS:
                raise ValueError(f"it holds {len(infos)} members (at most {MAX_INPUT_ARRAYS})")
            total = 0
            for info in infos:
                total += _declared_bytes(archive, info)
                if total > max_array_bytes:
                    raise ServiceError(
                        "inputs_too_large",
                        f"the input arrays declare more than {max_array_bytes:,} bytes, the "
                        "limit (QPCFARM_MAX_PROFILE_INPUTS_BYTES)",
                        413,
                        {"max_bytes": max_array_bytes},
                    )
    except ServiceError:
        raise
    except (ValueError, OSError, EOFError, RuntimeError, zipfile.BadZipFile, zlib.error) as exc:
        detail = str(exc).split("\n")[0][:200] if "/" not in str(exc) else type(exc).__name__
        raise ServiceError(
            "bad_inputs", f"the inputs must be a numpy .npz of named arrays: {detail}", 422
        ) from None


def _declared_bytes(archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> int:
    """The bytes one member's `.npy` header declares (ValueError when it is not a plain
    array whose stored size matches its header)."""
    name = info.filename[:100]
    if not info.filename.endswith(".npy") or info.is_dir():
        raise ValueError(f"member {name!r} is not an .npy array")
    if info.flag_bits & 0x1:
        raise ValueError(f"member {name!r} is encrypted")
    with archive.open(info) as member:  # reads (and inflates) only the header's bytes
        version = np.lib.format.read_magic(member)
        if version == (1, 0):
            shape, _fortran, dtype = np.lib.format.read_array_header_1_0(member)
        elif version in ((2, 0), (3, 0)):
            shape, _fortran, dtype = np.lib.format.read_array_header_2_0(member)
        else:
            raise ValueError(f"member {name!r} has .npy version {version}")
        header = member.tell()
    if dtype.hasobject:
        raise ValueError(f"member {name!r} holds Python objects (not allowed)")
    count = 1
    for dim in shape:
        count *= int(dim)
    declared = count * dtype.itemsize
    if header + declared != info.file_size:
        raise ValueError(
            f"member {name!r} declares {declared:,} bytes of data but holds "
            f"{max(0, info.file_size - header):,}"
        )
    return declared


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
    check_profilable(session, qpc)
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


def stats_level_of(session: Session, qpc: Qpc) -> int | None:
    """The -stats-level a QPC was compiled with (the same for every job that made it: the
    level is part of the cache key), or None for a QPC no job row names."""
    options = session.execute(
        select(CompileJob.options).where(CompileJob.qpc_id == qpc.id).limit(1)
    ).scalar_one_or_none()
    if options is None:
        return None
    return int(options.get("stats-level", STATS_LEVEL_DEFAULT))


def check_profilable(session: Session, qpc: Qpc) -> None:
    """Profiling reads per-operator cycles, which only a QPC compiled at OPSTATS_LEVEL records:
    refused here, for the API and the web alike, rather than failed later by the worker."""
    level = stats_level_of(session, qpc)
    if level is not None and level < OPSTATS_LEVEL:
        raise ServiceError(
            "stats_level_too_low",
            f"this QPC was compiled with -stats-level={level}: its stats hold no per-operator "
            f"cycles. Profiling needs -stats-level={OPSTATS_LEVEL}: compile the model again "
            f'with it (the job page\'s "Recompile with -stats-level={OPSTATS_LEVEL}")',
            409,
            {"flag": "-stats-level", "stats_level": level},
        )


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
