"""`/v1/qpcs`: a compiled QPC with its report, its download, and its validation.

Downloads stream from the blob store. The sha256 is the strong ETag (a QPC never changes),
so `If-None-Match` answers 304 and `Range: bytes=a-b` (one range) answers 206; a range that
is malformed, multiple or beyond the end answers 416 with `Content-Range: bytes */size`.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Response
from fastapi.responses import StreamingResponse

from app.api.deps import CurrentTeam, SessionDep, StoreDep, TeamQpc
from app.api.downloads import blob_response
from app.api.schemas import QpcOut, ValidateRequest, ValidationOut
from app.domain.services import qpcs, validations
from app.domain.services.errors import ServiceError
from app.domain.services.qpcs import CONVERSION_METRIC, PROFILE_METRIC

router = APIRouter(prefix="/v1/qpcs", tags=["qpcs"])

QPC_FILE_NAME = "programqpc.bin"


@router.get("/{qpc_id}", response_model=QpcOut)
def read_qpc(qpc: TeamQpc, session: SessionDep) -> QpcOut:
    return QpcOut.of(qpc, qpcs.get_report(session, qpc))


@router.put("/{qpc_id}/pin", response_model=QpcOut)
def pin_qpc(qpc: TeamQpc, session: SessionDep) -> QpcOut:
    """Keep the QPC: retention never collects a pinned QPC (again is a no-op)."""
    qpcs.set_pinned(session, qpc, True)
    session.commit()
    return QpcOut.of(qpc, qpcs.get_report(session, qpc))


@router.delete("/{qpc_id}/pin", response_model=QpcOut)
def unpin_qpc(qpc: TeamQpc, session: SessionDep) -> QpcOut:
    """Let retention collect the QPC again once nothing references it and it is old."""
    qpcs.set_pinned(session, qpc, False)
    session.commit()
    return QpcOut.of(qpc, qpcs.get_report(session, qpc))


@router.get(
    "/{qpc_id}/download",
    response_class=StreamingResponse,
    responses={
        200: {"content": {"application/octet-stream": {}}, "description": "The QPC file."},
        206: {"description": "The requested byte range."},
        304: {"description": "Not modified (If-None-Match matched the sha256 ETag)."},
        416: {"description": "`range_not_satisfiable`"},
    },
)
def download_qpc(
    qpc: TeamQpc,
    store: StoreDep,
    range_header: Annotated[str | None, Header(alias="range")] = None,
    if_none_match: Annotated[str | None, Header()] = None,
    if_range: Annotated[str | None, Header()] = None,
) -> Response:
    """The QPC as `programqpc.bin`, streamed and checked against its sha256 (`ETag`,
    `Repr-Digest`); conditional and range requests supported."""
    return blob_response(
        store,
        qpc.sha256,
        filename=QPC_FILE_NAME,
        media_type="application/octet-stream",
        found_by="download",
        range_header=range_header,
        if_none_match=if_none_match,
        if_range=if_range,
    )


@router.get(
    "/{qpc_id}/profile",
    response_class=StreamingResponse,
    responses={
        200: {"content": {"application/json": {}}, "description": "The profile file."},
        404: {"description": "`profile_not_found`: the compile wrote no profile"},
    },
)
def download_profile(
    qpc: TeamQpc,
    session: SessionDep,
    store: StoreDep,
    if_none_match: Annotated[str | None, Header()] = None,
) -> Response:
    """The quantization profile the compile of this QPC wrote (`-dump-profile`), as
    `profile.json`: give it back with `-load-profile` in a model archive to reuse it."""
    report = qpcs.get_report(session, qpc)
    metrics = getattr(report, "metrics", None) or {}
    entry = metrics.get(PROFILE_METRIC) if isinstance(metrics, dict) else None
    if not isinstance(entry, dict) or "sha256" not in entry:
        raise ServiceError(
            "profile_not_found",
            "this QPC's compile wrote no quantization profile (compile with -dump-profile)",
            status=404,
        )
    return blob_response(
        store,
        entry["sha256"],
        filename="profile.json",
        media_type="application/json",
        found_by="profile download",
        range_header=None,
        if_none_match=if_none_match,
        if_range=None,
    )


@router.get(
    "/{qpc_id}/converted.onnx",
    response_class=StreamingResponse,
    responses={
        200: {"content": {"application/octet-stream": {}}, "description": "The ONNX model."},
        404: {"description": "`converted_model_not_found`: the model was ONNX already"},
    },
)
def download_converted(
    qpc: TeamQpc,
    session: SessionDep,
    store: StoreDep,
    if_none_match: Annotated[str | None, Header()] = None,
) -> Response:
    """The ONNX model a TensorFlow or PyTorch upload was converted to before this QPC was
    compiled from it (the report's `conversion` names the converter and its version)."""
    report = qpcs.get_report(session, qpc)
    metrics = getattr(report, "metrics", None) or {}
    entry = metrics.get(CONVERSION_METRIC) if isinstance(metrics, dict) else None
    onnx_entry = entry.get("onnx") if isinstance(entry, dict) else None
    if not isinstance(onnx_entry, dict) or "sha256" not in onnx_entry:
        raise ServiceError(
            "converted_model_not_found",
            "this QPC was compiled from an ONNX model as uploaded: nothing was converted",
            status=404,
        )
    return blob_response(
        store,
        onnx_entry["sha256"],
        filename="converted.onnx",
        media_type="application/octet-stream",
        found_by="converted model download",
        range_header=None,
        if_none_match=if_none_match,
        if_range=None,
    )


@router.post(
    "/{qpc_id}/validate",
    status_code=201,
    response_model=ValidationOut,
    responses={
        409: {
            "description": "`validator_unavailable`: a QPC of the vendor's compiler and no "
            "qaic-qpc on this server"
        },
        422: {"description": "`unknown_device`"},
    },
)
def validate_qpc(
    qpc: TeamQpc,
    body: ValidateRequest,
    response: Response,
    session: SessionDep,
    store: StoreDep,
    team: CurrentTeam,
) -> ValidationOut:
    """Run the validator on a stored QPC against a device profile and keep the result
    (`GET /v1/validations/{id}`). A failed check is `ok: false`, not an HTTP error."""
    row = validations.validate_stored_qpc(session, store, team, qpc, body.device)
    session.commit()
    response.headers["Location"] = f"/v1/validations/{row.id}"
    return ValidationOut.of(row)
