"""`/v1/qpcs`: a compiled QPC with its report, its download, and its validation.

Downloads stream from the blob store. The sha256 is the strong ETag (a QPC never changes),
so `If-None-Match` answers 304 and `Range: bytes=a-b` (one range) answers 206; a range that
is malformed, multiple or beyond the end answers 416 with `Content-Range: bytes */size`.
"""

from __future__ import annotations

import re
from typing import Annotated

from fastapi import APIRouter, Header, Response
from fastapi.responses import StreamingResponse

from app.api.deps import CurrentTeam, SessionDep, StoreDep, TeamQpc
from app.api.errors import ApiError
from app.api.schemas import QpcOut, ValidateRequest, ValidationOut
from app.services import qpcs, validations

router = APIRouter(prefix="/v1/qpcs", tags=["qpcs"])

QPC_FILE_NAME = "programqpc.bin"
_RANGE = re.compile(r"^\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*$", re.IGNORECASE)


@router.get("/{qpc_id}", response_model=QpcOut)
def read_qpc(qpc: TeamQpc, session: SessionDep) -> QpcOut:
    return QpcOut.of(qpc, qpcs.get_report(session, qpc))


def etag_matches(header: str | None, etag: str) -> bool:
    if header is None:
        return False
    candidates = [c.strip() for c in header.split(",")]
    return "*" in candidates or any(c.removeprefix("W/") == etag for c in candidates)


def parse_range(header: str, size: int) -> tuple[int, int]:
    """(start, end exclusive) of a single `bytes=` range; ApiError 416 if unsatisfiable."""
    match = _RANGE.match(header)
    if match is None or (not match[1] and not match[2]):
        raise range_error(size, f"unsupported Range {header[:100]!r}: send one bytes=a-b range")
    first, last = match[1], match[2]
    if not first:  # suffix: the last N bytes
        length = int(last)
        if length == 0 or size == 0:
            raise range_error(size, "empty suffix range")
        return max(0, size - length), size
    start = int(first)
    end = size if not last else min(int(last) + 1, size)
    if last and int(last) < start:
        raise range_error(size, "range end before its start")
    if start >= size:
        raise range_error(size, f"range starts at {start}, the QPC has {size} bytes")
    return start, end


def range_error(size: int, message: str) -> ApiError:
    return ApiError(
        "range_not_satisfiable", message, 416, headers={"Content-Range": f"bytes */{size}"}
    )


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
    """The QPC as `programqpc.bin`, streamed; conditional and range requests supported."""
    etag = f'"{qpc.sha256}"'
    headers = {
        "ETag": etag,
        "Accept-Ranges": "bytes",
        "Cache-Control": "private, max-age=31536000, immutable",
    }
    if etag_matches(if_none_match, etag):
        return Response(status_code=304, headers=headers)
    size = store.size(qpc.sha256)
    headers["Content-Disposition"] = f"attachment; filename={QPC_FILE_NAME}"
    if range_header is not None and (if_range is None or if_range.strip() == etag):
        start, end = parse_range(range_header, size)
        headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
        headers["Content-Length"] = str(end - start)
        return StreamingResponse(
            store.read_range(qpc.sha256, start, end - start),
            status_code=206,
            media_type="application/octet-stream",
            headers=headers,
        )
    headers["Content-Length"] = str(size)
    return StreamingResponse(
        store.read_range(qpc.sha256, 0, size),
        media_type="application/octet-stream",
        headers=headers,
    )


@router.post(
    "/{qpc_id}/validate",
    status_code=201,
    response_model=ValidationOut,
    responses={422: {"description": "`unknown_device`"}},
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
