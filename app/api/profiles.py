"""Profile jobs: `POST /v1/qpcs/{id}/profile` runs a QPC on the runtime with stats, and
`/v1/profiles/{id}` reads the opstats summary and downloads the text, CSV and trace.

The submit commits the row, then enqueues its id as a `profile` job (a task of its own).
Inputs come as an uploaded `.npz` (multipart field `inputs`, form
fields first, streamed into the blob store) or are made up from the QPC's I/O description.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, StreamingResponse
from pydantic import ValidationError
from sqlalchemy.orm import Session

from app.api.deps import CurrentTeam, QueueDep, SessionDep, SettingsDep, StoreDep, TeamQpc
from app.api.downloads import blob_response
from app.api.errors import ApiError
from app.api.schemas import ProfileCreate, ProfileOut
from app.api.uploads import Upload, receive_upload
from app.domain.blobs.orphans import discarded_on_refusal
from app.domain.db.models import JobStatus, ProfileJob, Qpc, Team
from app.domain.db.session import unit_of_work
from app.domain.queue import commit_then_enqueue
from app.domain.services import profiles

router = APIRouter(tags=["profiles"])

_BODY_DOC: dict[str, Any] = {
    "required": False,
    "content": {
        "application/json": {"schema": ProfileCreate.model_json_schema()},
        "multipart/form-data": {
            "schema": {
                "type": "object",
                "properties": {
                    "iterations": {"type": "integer", "description": "Must come before `inputs`."},
                    "inputs": {
                        "type": "string",
                        "format": "binary",
                        "description": "A numpy .npz of the inputs by name.",
                    },
                },
                "required": ["inputs"],
            }
        },
    },
}


def _settings(data: dict[str, Any]) -> ProfileCreate:
    """The body's or form's settings; a bad value is 422 `invalid_request` like any body."""
    try:
        return ProfileCreate.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError(
            [{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]
        ) from None


@router.post(
    "/v1/qpcs/{qpc_id}/profile",
    status_code=202,
    response_model=ProfileOut,
    openapi_extra={"requestBody": _BODY_DOC},
    responses={
        404: {"description": "`not_found`: no such QPC for this team"},
        409: {
            "description": "`stats_level_too_low`: the QPC was compiled below -stats-level=70 "
            "and records no per-operator cycles"
        },
        413: {"description": "`upload_too_large`, `inputs_too_large` (arrays declared)"},
        422: {"description": "`invalid_request`, `bad_inputs` (not an .npz)"},
    },
)
async def submit_profile(
    request: Request,
    response: Response,
    qpc: TeamQpc,
    session: SessionDep,
    team: CurrentTeam,
    store: StoreDep,
    settings: SettingsDep,
    queue: QueueDep,
) -> ProfileOut:
    """Queue a profile: `iterations` inferences on the functional runtime with stats, then
    opstats. JSON `{"iterations": n}` (random inputs), or multipart with the `.npz` in the
    field `inputs`. The QPC needs `-stats-level=70`, else 409 `stats_level_too_low`."""
    # refused before the body (an .npz of inputs) is read
    await run_in_threadpool(profiles.check_profilable, session, qpc)
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type == "multipart/form-data":

        def consume(upload: Upload, chunks: Iterator[bytes]) -> ProfileJob:
            body = _settings(dict(upload.fields))
            sessions = request.app.state.session_factory
            with discarded_on_refusal(store, sessions) as kept:
                ref = profiles.store_inputs(
                    kept,
                    chunks,
                    max_bytes=settings.max_upload_bytes,
                    max_array_bytes=settings.max_profile_inputs_bytes,
                )
                with unit_of_work(session):
                    return profiles.submit(
                        session, team, qpc, iterations=body.iterations, inputs_sha256=ref.sha256
                    )

        job = await receive_upload(
            request, consume, max_bytes=settings.max_upload_bytes, file_field="inputs"
        )
    elif media_type in ("", "application/json"):
        raw = await request.body()
        try:
            parsed = json.loads(raw or b"{}")
        except ValueError as exc:
            raise ApiError("invalid_request", f"the body is not JSON: {exc}", 422) from None
        if not isinstance(parsed, dict):
            raise ApiError("invalid_request", "the body must be a JSON object", 422)
        data = _settings(parsed)
        job = await run_in_threadpool(_submit_random, session, team, qpc, data.iterations)
    else:
        raise ApiError(
            "unsupported_media_type",
            f"send application/json or multipart/form-data, not {media_type}",
            415,
        )
    # committed above (in the thread that wrote it); the helper keeps the order in one place
    await run_in_threadpool(commit_then_enqueue, session, queue, [job.id], "profile")
    response.headers["Location"] = f"/v1/profiles/{job.id}"
    return ProfileOut.of(job)


def _submit_random(session: Session, team: Team, qpc: Qpc, iterations: int) -> ProfileJob:
    with unit_of_work(session):
        return profiles.submit(session, team, qpc, iterations=iterations)


def _team_profile(profile_id: uuid.UUID, session: Session, team: Team) -> ProfileJob:
    return profiles.get_profile(session, team, profile_id)


def _finished(job: ProfileJob) -> ProfileJob:
    if job.status != JobStatus.succeeded:
        raise profiles.not_ready(job)
    return job


@router.get("/v1/profiles/{profile_id}", response_model=ProfileOut)
def read_profile(profile_id: uuid.UUID, session: SessionDep, team: CurrentTeam) -> ProfileOut:
    return ProfileOut.of(_team_profile(profile_id, session, team))


@router.get(
    "/v1/profiles/{profile_id}/summary.txt",
    response_class=PlainTextResponse,
    responses={409: {"description": "`not_ready`: the profile has not succeeded"}},
)
def summary_text(
    profile_id: uuid.UUID, session: SessionDep, team: CurrentTeam
) -> PlainTextResponse:
    """opstats' per-operator summary as text (`opstats-summary.txt`)."""
    job = _finished(_team_profile(profile_id, session, team))
    return PlainTextResponse(job.summary_text or "")


@router.get(
    "/v1/profiles/{profile_id}/summary.csv",
    response_class=Response,
    responses={
        200: {"content": {"text/csv": {}}},
        409: {"description": "`not_ready`"},
    },
)
def summary_csv(profile_id: uuid.UUID, session: SessionDep, team: CurrentTeam) -> Response:
    """One row per operator and core (`opstats-summary.csv`)."""
    job = _finished(_team_profile(profile_id, session, team))
    return Response(
        job.summary_csv or "",
        media_type="text/csv; charset=utf-8",
        headers={"Content-Disposition": "attachment; filename=opstats-summary.csv"},
    )


@router.get(
    "/v1/profiles/{profile_id}/trace.json",
    response_class=StreamingResponse,
    responses={
        200: {"content": {"application/json": {}}, "description": "Chrome/Perfetto trace."},
        409: {"description": "`not_ready`"},
    },
)
def trace_json(
    profile_id: uuid.UUID, session: SessionDep, team: CurrentTeam, store: StoreDep
) -> Response:
    """The Chrome/Perfetto trace (open it in ui.perfetto.dev or chrome://tracing)."""
    job = _finished(_team_profile(profile_id, session, team))
    if job.trace_sha256 is None:
        raise profiles.not_ready(job)
    return blob_response(
        store,
        job.trace_sha256,
        filename=profiles.TRACE_NAME,
        media_type="application/json",
        found_by="download",
    )
