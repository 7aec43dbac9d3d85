"""One exception type for everything the compiler rejects, with a stable machine-readable code."""

from __future__ import annotations


class CompileError(Exception):
    """A failure the user can act on: bad option, bad model, unsupported op, does not fit.

    `code` is stable (the service stores it and clients switch on it); `flag` or `node` names
    what is at fault when there is one thing to point at.
    """

    def __init__(
        self,
        code: str,
        message: str,
        *,
        flag: str | None = None,
        node: str | None = None,
        details: dict[str, object] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.flag = flag
        self.node = node
        self.details = details or {}

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {"code": self.code, "message": self.message}
        if self.flag is not None:
            out["flag"] = self.flag
        if self.node is not None:
            out["node"] = self.node
        if self.details:
            out["details"] = self.details
        return out

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"
