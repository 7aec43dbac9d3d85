"""Blob downloads: streamed, checked against their sha256, conditional and ranged.

The sha256 names the content, so it is the strong ETag (`If-None-Match` -> 304) and the
`Repr-Digest` (RFC 9530; `Digest`, RFC 3230, for older clients) lets a client check what it
got. One `Range: bytes=a-b` answers 206; a range that is malformed, multiple or beyond the end
answers 416 with `Content-Range: bytes */size`.

Nothing corrupt is served (app.domain.blobs.integrity): a blob up to `CHECK_FIRST_BYTES` is read and
checked before the answer starts, so damage answers 500 `blob_corrupt`; a larger one streams
while it is hashed and its last piece waits for the hash, so a damaged one ends the
connection short of its Content-Length. Either way the blob is quarantined and later requests
answer `blob_corrupt` at once.
"""

from __future__ import annotations

import base64
import re

from fastapi import Response
from fastapi.responses import StreamingResponse

from app.api.errors import ApiError
from app.domain.blobs import BlobStore
from app.domain.blobs.integrity import verified_bytes, verified_range

CHECK_FIRST_BYTES = 16 << 20
"""Blobs up to this size are checked whole before the first byte is sent."""
_RANGE = re.compile(r"^\s*bytes\s*=\s*(\d{0,19})\s*-\s*(\d{0,19})\s*$", re.IGNORECASE)
"""One `bytes=a-b` range; a position of more than 19 digits (past any file) is malformed:
416 like any range that cannot be served, never a number too long to convert."""


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
        raise range_error(size, f"range starts at {start}, the file has {size} bytes")
    return start, end


def range_error(size: int, message: str) -> ApiError:
    return ApiError(
        "range_not_satisfiable", message, 416, headers={"Content-Range": f"bytes */{size}"}
    )


def digest_headers(sha256: str) -> dict[str, str]:
    """`Repr-Digest` and `Digest` of a blob: base64 of its sha-256."""
    b64 = base64.b64encode(bytes.fromhex(sha256)).decode()
    return {"Repr-Digest": f"sha-256=:{b64}:", "Digest": f"sha-256={b64}"}


def blob_response(
    store: BlobStore,
    sha256: str,
    *,
    filename: str,
    media_type: str,
    found_by: str,
    range_header: str | None = None,
    if_none_match: str | None = None,
    if_range: str | None = None,
    cache_control: str = "private, max-age=31536000, immutable",
) -> Response:
    """The blob as a download of `filename`, checked on the way out."""
    etag = f'"{sha256}"'
    headers = {
        "ETag": etag,
        "Accept-Ranges": "bytes",
        "Cache-Control": cache_control,
        **digest_headers(sha256),
    }
    if etag_matches(if_none_match, etag):
        return Response(status_code=304, headers=headers)
    size = store.size(sha256)
    headers["Content-Disposition"] = f"attachment; filename={filename}"
    start, end, status = 0, size, 200
    if range_header is not None and (if_range is None or if_range.strip() == etag):
        start, end = parse_range(range_header, size)
        headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
        status = 206
    headers["Content-Length"] = str(end - start)
    if size <= CHECK_FIRST_BYTES:
        data = verified_bytes(store, sha256, found_by=found_by)
        return Response(data[start:end], status, headers=headers, media_type=media_type)
    return StreamingResponse(
        verified_range(store, sha256, start, end - start, found_by=found_by),
        status_code=status,
        media_type=media_type,
        headers=headers,
    )
