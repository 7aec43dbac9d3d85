"""`/v1/models`: upload (streamed into the blob store while hashing) and read models."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response

from app.api.deps import CurrentTeam, SessionDep, SettingsDep, StoreDep, TeamModel
from app.api.schemas import ModelList, ModelOut
from app.api.uploads import UPLOAD_BODY_DOC, Upload, receive_upload
from app.domain.blobs.orphans import discarded_on_refusal
from app.domain.db.models import Model
from app.domain.db.session import unit_of_work
from app.domain.services import models
from app.domain.services.pages import MAX_LIMIT, MAX_OFFSET

router = APIRouter(prefix="/v1/models", tags=["models"])

Limit = Annotated[int, Query(ge=1, le=MAX_LIMIT)]
Offset = Annotated[int, Query(ge=0, le=MAX_OFFSET)]


@router.post(
    "",
    status_code=201,
    response_model=ModelOut,
    openapi_extra={"requestBody": UPLOAD_BODY_DOC},
    responses={
        413: {
            "description": "`upload_too_large`: over `QPCFARM_MAX_UPLOAD_BYTES`; "
            "`storage_quota`: over the team's stored-bytes limit (with the numbers)"
        },
        422: {"description": "`invalid_model`, `unsupported_operator`, `bad_archive`, ..."},
    },
)
async def upload_model(
    request: Request,
    response: Response,
    session: SessionDep,
    team: CurrentTeam,
    store: StoreDep,
    settings: SettingsDep,
    filename: Annotated[
        str | None, Query(description="The model's file name, for a raw (octet-stream) body")
    ] = None,
    input_shapes: Annotated[
        str | None,
        Query(
            description="`<name>:<d0>x<d1>...[,...]`, as the compile's `-input-shapes`: the "
            "shapes a TorchScript (.pt) upload is converted with at upload, so that one "
            "that does not convert is refused here (422) rather than failing its compile. "
            "Without them a TorchScript upload is only loaded. Also a multipart field "
            "`input_shapes` (before `file`). A TensorFlow / PyTorch model records them "
            "(`input_shapes` of the answer): its compiles that give no `-input-shapes` use "
            "them; a compile's own `-input-shapes` wins. An ONNX model records none."
        ),
    ] = None,
) -> ModelOut:
    """Upload an `.onnx` file, or a `.zip`/`.tar`/`.tar.gz` holding one `.onnx` with its
    external data, or a TensorFlow / PyTorch model (converted to ONNX to check it), as the
    multipart field `file` or as the raw body. It is checked with the compiler's importer;
    the answer's `id` is what compile jobs name."""

    def consume(upload: Upload, chunks: Iterator[bytes]) -> Model:
        sessions = request.app.state.session_factory
        with discarded_on_refusal(store, sessions) as kept, unit_of_work(session):
            return models.store_model(
                session,
                kept,
                team,
                chunks,
                upload.filename or filename,
                max_bytes=settings.max_upload_bytes,
                input_shapes=upload.fields.get("input_shapes") or input_shapes,
            )

    model = await receive_upload(
        request, consume, max_bytes=settings.max_upload_bytes, filename=filename
    )
    response.headers["Location"] = f"/v1/models/{model.id}"
    return ModelOut.model_validate(model)


@router.get("", response_model=ModelList)
def list_models(
    session: SessionDep, team: CurrentTeam, limit: Limit = 50, offset: Offset = 0
) -> ModelList:
    page = models.list_models(session, team, limit=limit, offset=offset)
    return ModelList(
        items=[ModelOut.model_validate(m) for m in page.items],
        count=page.total,
        limit=page.limit,
        offset=page.offset,
    )


@router.get("/{model_id}", response_model=ModelOut)
def read_model(model: TeamModel) -> ModelOut:
    return ModelOut.model_validate(model)
