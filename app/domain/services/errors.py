"""One error type for the services, carrying what the HTTP layer answers with."""

from __future__ import annotations

from typing import Any


class ServiceError(Exception):
    """A refusal the client can act on: `code` is stable, `status` is the HTTP status."""

    def __init__(
        self, code: str, message: str, status: int = 400, detail: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.status = status
        self.detail = detail or {}
        self.headers: dict[str, str] = {}
        """Response headers the HTTP layer adds (`Retry-After` of a quota)."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"code": self.code, "message": self.message}
        out.update(self.detail)
        return out

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


def not_found(kind: str, ident: object) -> ServiceError:
    """404 for a missing row, and equally for another team's row (existence is not leaked)."""
    return ServiceError("not_found", f"{kind} {ident} not found", 404)


def from_compile_error(exc: Any, status: int = 422) -> ServiceError:
    """A compiler_core CompileError as a ServiceError with the compiler's code and fields."""
    detail = {k: v for k, v in exc.to_dict().items() if k not in ("code", "message")}
    return ServiceError(exc.code, exc.message, status, detail)


def internal_error_message(exc: BaseException) -> str:
    """What a job that failed on an unexpected exception tells its owner: the exception's
    type, never its text (which may hold server paths or a traceback's details; the
    worker's log has them)."""
    return (
        f"the farm failed unexpectedly ({type(exc).__name__}); this is a bug of the farm, "
        "not of the request: the worker's log has the details"
    )
