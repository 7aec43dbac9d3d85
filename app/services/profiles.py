"""Profile jobs on the API side: submit (random or uploaded `.npz` inputs), read, and the
stored results. What a worker does with a profile is in `worker.profile_jobs`."""

from __future__ import annotations

import logging
import uuid
import zipfile

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session

from compiler_core.file_kinds import HEAD_BYTES, inputs_problem, sniff
from qpcfarm.app.blobs import BlobRef, BlobStore, BlobTooLarge
from qpcfarm.app.blobs.base import Source
from qpcfarm.app.blobs.integrity import verified_bytes
from qpcfarm.app.db.models import JobStatus, ProfileJob, Qpc, Team
from qpcfarm.app.services.errors import ServiceError, not_found
from qpcfarm.app.services.models import too_large
from qpcfarm.app.services.qpcs import get_qpc

log = logging.getLogger(__name__)

MAX_ITERATIONS = 100
"""Inferences one profile job may run (the functional runtime is slow on big networks)."""
TRACE_NAME = "trace.json"



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
        problem = inputs_problem(sniff(src.read(HEAD_BYTES)))
        if problem is not None:
            raise ServiceError("bad_inputs", f"the uploaded inputs {problem}", 422)
        src.seek(0)
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
