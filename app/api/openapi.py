"""The OpenAPI document: FastAPI's, completed with what every route may answer.

FastAPI documents a route's success and its request validation failure; the farm's routes
also answer, through dependencies, the request guard and exception handlers every route
shares, 401 (no or a bad key), 404 (an id of the path that is unknown or another team's),
400 (a body that cannot be parsed), 408 and 413 (a body that stalls or is too large), 429
(uploads in flight per key), 503 (database or blob store away, with `Retry-After`) and 500
`blob_corrupt`. Each is added here with the one error shape, so a client generated from
the document knows every status it can get.
"""

from __future__ import annotations

from typing import Any

ERROR_SCHEMA_NAME = "Error"
ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "Every error: a stable snake_case `code`, a message for people, and "
    "fields of the code (`flag`, `node`, `errors`, `max_bytes`, ...).",
    "properties": {"code": {"type": "string"}, "message": {"type": "string"}},
    "required": ["code", "message"],
    "additionalProperties": True,
}
_ERROR_REF = {"$ref": f"#/components/schemas/{ERROR_SCHEMA_NAME}"}

SHARED: dict[str, str] = {
    "401": "`unauthorized`: no API key, or one unknown or revoked (`WWW-Authenticate: Bearer`)",
    "422": "`invalid_request` (with `errors`), or a refusal with its own code",
    "500": "`blob_corrupt`: stored content failed its integrity check (quarantined)",
    "503": "`database_unavailable` or `storage_unavailable`; retry after `Retry-After` s",
}
WITH_PATH_ID = {"404": "`not_found`: no such id for this team"}
WITH_BODY = {"400": "`bad_request`: the body cannot be parsed"}
BODY_METHODS = {
    "408": "`body_timeout`: the body sent nothing for `QPCFARM_BODY_READ_TIMEOUT_S`",
    "413": "`body_too_large`: over `QPCFARM_MAX_JSON_BODY_BYTES`",
}
"""Every POST/PUT/PATCH/DELETE: its body is bounded and timed before the route sees it
(`request_guard`), whether or not the route reads one."""
UPLOADS = {
    "413": "`upload_too_large` (over `QPCFARM_MAX_UPLOAD_BYTES`), `archive_too_large`, "
    "`archive_ratio`",
    "429": "`too_many_uploads`: `QPCFARM_MAX_UPLOADS_PER_KEY` in flight; retry after "
    "`Retry-After` s",
}
OPEN_ROUTES = ("/healthz", "/readyz")


def complete(schema: dict[str, Any]) -> dict[str, Any]:
    """Add the shared error responses to every operation of `schema` (in place)."""
    schema.setdefault("components", {}).setdefault("schemas", {})[ERROR_SCHEMA_NAME] = ERROR_SCHEMA
    for path, operations in schema.get("paths", {}).items():
        for method, operation in operations.items():
            if not isinstance(operation, dict) or "responses" not in operation:
                continue
            extra = {} if path in OPEN_ROUTES else dict(SHARED)
            if method.lower() in ("post", "put", "patch", "delete"):
                extra.update(BODY_METHODS)
            if "{" in path:
                extra.update(WITH_PATH_ID)
            body = operation.get("requestBody", {})
            if body:
                extra.update(WITH_BODY)
            if "application/octet-stream" in body.get(
                "content", {}
            ) or "multipart/form-data" in body.get("content", {}):
                extra.update(UPLOADS)
                extra["413"] = f"{UPLOADS['413']}, or {BODY_METHODS['413']} (a JSON body)"
            responses = operation["responses"]
            for status, description in extra.items():
                entry = responses.setdefault(status, {"description": description})
                entry.setdefault("content", {"application/json": {"schema": _ERROR_REF}})
    return schema
