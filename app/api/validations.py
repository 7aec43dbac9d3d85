"""`/v1/validations`: validate an uploaded QPC file, and read stored validation results."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response

from app.api.deps import CurrentTeam, SessionDep, SettingsDep, StoreDep
from app.api.errors import invalid_request
from app.api.models import Limit, Offset
from app.api.schemas import ValidationList, ValidationOut
from app.api.uploads import UPLOAD_BODY_DOC, Upload, receive_upload
from app.domain.blobs.orphans import discarded_on_refusal
from app.domain.db.models import Validation
from app.domain.db.session import unit_of_work
from app.domain.services import validations

router = APIRouter(prefix="/v1/validations", tags=["validations"])

_BODY_DOC = {
    **UPLOAD_BODY_DOC,
    "content": {
        **UPLOAD_BODY_DOC["content"],
        "multipart/form-data": {
            "schema": {
                "type": "object",
                "properties": {
                    "device": {"type": "string", "description": "Must come before `file`."},
                    "file": {"type": "string", "format": "binary"},
                },
                "required": ["file"],
            }
        },
    },
}


@router.post(
    "",
    status_code=201,
    response_model=ValidationOut,
    openapi_extra={"requestBody": _BODY_DOC},
    responses={
        413: {"description": "`upload_too_large`"},
        422: {"description": "`unknown_device`"},
    },
)
async def validate_upload(
    request: Request,
    response: Response,
    session: SessionDep,
    team: CurrentTeam,
    store: StoreDep,
    settings: SettingsDep,
    device: Annotated[
        str | None,
        Query(
            description="Device profile; or the form field `device` (before the file).",
            min_length=1,
        ),
    ] = None,
) -> ValidationOut:
    """Validate an uploaded QPC (multipart field `file`, or the raw body) against a device.
    A damaged file answers `ok: false` with the failing checks."""

    def consume(upload: Upload, chunks: Iterator[bytes]) -> Validation:
        form_device = upload.fields.get("device") or None
        if device is not None and form_device is not None and form_device != device:
            raise invalid_request("`device` given twice with different values")
        sessions = request.app.state.session_factory
        with discarded_on_refusal(store, sessions) as kept, unit_of_work(session):
            return validations.validate_uploaded(
                session,
                kept,
                team,
                chunks,
                device or form_device,
                max_bytes=settings.max_upload_bytes,
            )

    row = await receive_upload(request, consume, max_bytes=settings.max_upload_bytes)
    response.headers["Location"] = f"/v1/validations/{row.id}"
    return ValidationOut.of(row)


@router.get("", response_model=ValidationList)
def list_validations(
    session: SessionDep, team: CurrentTeam, limit: Limit = 50, offset: Offset = 0
) -> ValidationList:
    page = validations.list_validations(session, team, limit=limit, offset=offset)
    return ValidationList(
        items=[ValidationOut.of(v) for v in page.items],
        count=page.total,
        limit=page.limit,
        offset=page.offset,
    )


@router.get("/{validation_id}", response_model=ValidationOut)
def read_validation(
    validation_id: uuid.UUID, session: SessionDep, team: CurrentTeam
) -> ValidationOut:
    return ValidationOut.of(validations.get_validation(session, team, validation_id))
