"""Every error the API answers is JSON `{"code", "message", ...}` with a stable `code`.

Routes and services raise `ServiceError` (or `ApiError`, which adds response headers); the
handlers here turn those, request validation failures, compiler errors and unknown routes
into that one shape, so clients switch on `code` and never parse prose.
"""

from __future__ import annotations

import logging
import math
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.domain.blobs import BlobCorrupt, BlobNotFound
from app.domain.blobs.quarantine import was_quarantined
from app.domain.db.faults import DATABASE_FAULTS
from app.domain.services.errors import ServiceError, from_compile_error
from compiler_core import CompileError

log = logging.getLogger(__name__)


_HTTP_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    406: "not_acceptable",
    413: "upload_too_large",
    415: "unsupported_media_type",
}


class ApiError(ServiceError):
    """A ServiceError raised by the HTTP layer itself, optionally with response headers."""

    def __init__(
        self,
        code: str,
        message: str,
        status: int = 400,
        detail: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(code, message, status, detail)
        self.headers = headers or {}


def unauthorized(message: str) -> ApiError:
    return ApiError("unauthorized", message, 401, headers={"WWW-Authenticate": "Bearer"})


def invalid_request(message: str, **detail: Any) -> ApiError:
    return ApiError("invalid_request", message, 422, detail)


def upload_too_large(max_bytes: int) -> ApiError:
    return ApiError(
        "upload_too_large",
        f"the upload exceeds the limit of {max_bytes:,} bytes",
        413,
        {"max_bytes": max_bytes},
    )


def error_response(exc: ServiceError) -> JSONResponse:
    headers = dict(getattr(exc, "headers", {}) or {})
    if exc.status == 401:
        headers.setdefault("WWW-Authenticate", "Bearer")
    body = _finite(jsonable_encoder(exc.to_dict()))
    return JSONResponse(body, exc.status, headers=headers or None)


def _finite(value: Any) -> Any:
    """The body with NaN and infinities as strings: JSON has no such numbers, and an error
    that quotes a client's `NaN` must still be answered."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


async def _service_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ServiceError)
    return error_response(exc)


async def _compile_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, CompileError)
    return error_response(from_compile_error(exc))


async def _validation_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = [
        {"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")}
        for e in exc.errors()
    ]
    first = errors[0] if errors else {"loc": [], "msg": "invalid request"}
    where = ".".join(str(p) for p in first["loc"] if p != "body")
    message = f"{where}: {first['msg']}" if where else str(first["msg"])
    return error_response(invalid_request(message, errors=errors))


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    code = _HTTP_CODES.get(exc.status_code, "http_error")
    message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    headers = dict(exc.headers) if exc.headers else {}
    if exc.status_code == 405:
        headers["Allow"] = ", ".join(_allowed_methods(request)) or headers.get("Allow", "")
    return error_response(ApiError(code, message, exc.status_code, headers=headers or None))


def _allowed_methods(request: Request) -> list[str]:
    """Every method the OpenAPI document lists for this path (Starlette names only the
    first route's, and a path's GET and POST are often two routes); Starlette's own answer
    for paths outside the document (the web pages)."""
    methods: set[str] = set()
    for template, operations in request.app.openapi().get("paths", {}).items():
        pattern = "^" + re.sub(r"\\{[^/]+?\\}", "[^/]+", re.escape(template)) + "$"
        if re.match(pattern, request.url.path):
            methods |= {m.upper() for m in operations}
    if "GET" in methods:
        methods.add("HEAD")
    return sorted(methods)


def blob_corrupt() -> ServiceError:
    return ServiceError(
        "blob_corrupt",
        "stored content failed its integrity check and was quarantined; it is not served "
        "(a QPC is rebuilt by submitting its compile again)",
        500,
    )


async def _blob_corrupt(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, BlobCorrupt)
    return error_response(blob_corrupt())


async def _blob_missing(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, BlobNotFound)
    if await run_in_threadpool(_quarantined, request, exc.sha256):
        return error_response(blob_corrupt())
    log.error("blob missing from the store: %s", exc)
    return error_response(
        ServiceError("blob_missing", "stored content is missing from the blob store", 500)
    )


def _quarantined(request: Request, sha256: str) -> bool:
    try:
        with request.app.state.session_factory() as session:
            return was_quarantined(session, sha256)
    except Exception:  # noqa: BLE001 - the answer stays a coded 500 either way
        return False


RETRY_AFTER_S = 5
"""What a 503 asks a client to wait: a restarting database or a full disk being cleared."""


def unavailable(code: str, what: str) -> ApiError:
    """503 with a stable code and `Retry-After`; the message names no server detail."""
    return ApiError(
        code,
        f"the {what} is unavailable; retry in a few seconds",
        503,
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


async def _database_fault(_request: Request, exc: Exception) -> JSONResponse:
    log.error("database unavailable: %s", type(exc).__name__, exc_info=exc)
    return error_response(unavailable("database_unavailable", "database"))


async def _storage_fault(_request: Request, exc: Exception) -> JSONResponse:
    log.error("blob store unavailable: %s", type(exc).__name__, exc_info=exc)
    return error_response(unavailable("storage_unavailable", "blob store"))


async def _internal_error(_request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error", exc_info=exc)
    return error_response(ServiceError("internal_error", "internal server error", 500))


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ServiceError, _service_error)
    app.add_exception_handler(CompileError, _compile_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(BlobNotFound, _blob_missing)
    app.add_exception_handler(BlobCorrupt, _blob_corrupt)
    for fault in DATABASE_FAULTS:
        app.add_exception_handler(fault, _database_fault)
    app.add_exception_handler(OSError, _storage_fault)
    app.add_exception_handler(Exception, _internal_error)
