"""`/v1/compile-jobs`: submit (options checked before anything is queued), read, cancel.

Submitting commits the job row first and enqueues its id after, so a worker never receives
an id it cannot read. Identical model bytes + canonical options + compiler version reuse the
stored QPC (200, `cache_hit: true`, `status: succeeded`) or attach to the team's job already
queued or running for it (202, `attached: true`); otherwise a new job is queued (202).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Annotated

from fastapi import APIRouter, Query, Response
from sqlalchemy import select
from sqlalchemy.orm import Session

from app.api.deps import CurrentTeam, QueueDep, SessionDep, SettingsDep, StoreDep, TeamJob
from app.api.models import Limit, Offset
from app.api.schemas import JobCreate, JobList, JobOut
from app.domain.db.models import CompileJob, CompileReport, JobStatus
from app.domain.queue import commit_then_enqueue
from app.domain.services import compilers, jobs
from app.domain.services.farm_options import farm_options
from app.domain.services.jobs import JobRow
from compiler_core import CompileOptions

router = APIRouter(prefix="/v1/compile-jobs", tags=["compile jobs"])


def parse_options(body: JobCreate) -> CompileOptions:
    """The request's options, through the farm's one door (CompileError -> 422)."""
    return farm_options(flags=body.flags, values=body.options)


def reports_by_qpc(
    session: Session, job_list: Sequence[CompileJob | JobRow]
) -> dict[uuid.UUID, CompileReport]:
    qpc_ids = {job.qpc_id for job in job_list if job.qpc_id is not None}
    if not qpc_ids:
        return {}
    rows = session.execute(select(CompileReport).where(CompileReport.qpc_id.in_(qpc_ids)))
    return {report.qpc_id: report for report in rows.scalars()}


def job_out(session: Session, job: CompileJob, *, attached: bool = False) -> JobOut:
    report = reports_by_qpc(session, [job]).get(job.qpc_id) if job.qpc_id else None
    return JobOut.of(job, report, attached=attached)


@router.post(
    "",
    status_code=202,
    response_model=JobOut,
    responses={
        200: {"model": JobOut, "description": "Cache hit: the QPC exists (`cache_hit: true`)."},
        202: {"description": "Queued, or attached to the identical job already queued/running."},
        404: {"description": "`not_found`: no such model for this team"},
        409: {
            "description": "`compiler_unavailable`: no live worker has the `compiler` "
            "named (`available` lists those that do)"
        },
        413: {"description": "`storage_quota`: the team's stored bytes are at its limit"},
        422: {
            "description": "`invalid_option`, `unknown_option` (with `flag`), "
            "`invalid_compiler`, `option_not_for_backend`, ..."
        },
        429: {
            "description": "`queue_quota`: the team's queued jobs are at its limit (`Retry-After`)"
        },
    },
)
def submit_job(
    body: JobCreate,
    session: SessionDep,
    team: CurrentTeam,
    queue: QueueDep,
    store: StoreDep,
    settings: SettingsDep,
) -> Response:
    options = parse_options(body)
    compiler = compilers.resolve(
        session, body.compiler, fresh_s=compilers.fresh_s(settings.stale_after_s)
    )
    job, created = jobs.submit(
        session, team, body.model_id, options, store=store, cache_scope=settings.cache_scope,
        retry_after_s=settings.quota_retry_after_s, compiler=compiler,
    )  # fmt: skip
    commit_then_enqueue(session, queue, jobs.to_enqueue(job, created))
    report = reports_by_qpc(session, [job]).get(job.qpc_id) if job.qpc_id else None
    # The answer serialised by its model at once (what `response_model` declares): FastAPI
    # would validate the returned model again and encode it through plain Python objects.
    return Response(
        JobOut.of(job, report, attached=not created).model_dump_json(),
        status_code=200 if job.cache_hit else 202,
        headers={"Location": f"/v1/compile-jobs/{job.id}"},
        media_type="application/json",
    )


@router.get("", response_model=JobList)
def list_jobs(
    session: SessionDep,
    team: CurrentTeam,
    limit: Limit = 50,
    offset: Offset = 0,
    status: Annotated[JobStatus | None, Query()] = None,
) -> JobList:
    page = jobs.list_jobs(session, team, limit=limit, offset=offset, status=status)
    reports = reports_by_qpc(session, page.items)
    items = [JobOut.of(j, reports.get(j.qpc_id) if j.qpc_id else None) for j in page.items]
    return JobList(items=items, count=page.total, limit=page.limit, offset=page.offset)


@router.get("/{job_id}", response_model=JobOut)
def read_job(job: TeamJob, session: SessionDep) -> JobOut:
    return job_out(session, job)


@router.post(
    "/{job_id}/cancel",
    response_model=JobOut,
    responses={409: {"description": "`not_cancellable`: the job has already finished"}},
)
def cancel_job(job: TeamJob, session: SessionDep, team: CurrentTeam) -> JobOut:
    """Cancel a queued job at once; a running one stops at its next progress report
    (`cancel_requested: true` until then)."""
    job = jobs.cancel(session, team, job)
    session.commit()
    return job_out(session, job)
