"""Compiler backends and versions: what a worker can compile with, and what a job asks for.

A compiler is `backend@version`: `qpcfarm@0.1.0` (this package's compiler at its version) or
`qaic@1.18.2.0` (the vendor's `qaic-compile`, when the worker's host has the SDK). A worker
advertises the compilers it has (`local_compilers`, kept fresh in the `worker_compilers`
table by `app.domain.services.compilers`); a job that names one goes to the Celery queue of
that compiler (`queue_name`), which only workers having it consume. A job that names none runs
on any worker's `qpcfarm` (the farm's default), as before compilers could be named.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from compiler_core.version import COMPILER_VERSION

if TYPE_CHECKING:
    from app.domain.settings import Settings

QPCFARM, QAIC = "qpcfarm", "qaic"
BACKENDS: tuple[str, ...] = (QPCFARM, QAIC)
QAIC_COMPILE = Path("exec") / "qaic-compile"
"""Where the vendor compiler lives under the SDK's home (`/opt/qti-aic/exec/qaic-compile`)."""
QAIC_QPC = Path("exec") / "qaic-qpc"
"""The vendor's QPC tool (`qaic-qpc validate -i programqpc.bin`)."""
QAIC_RUNNER = Path("exec") / "qaic-runner"
QAIC_OPSTATS = Path("exec") / "qaic-opstats"
UNKNOWN_VERSION = "unknown"
_VERSION = re.compile(r"^[0-9A-Za-z][0-9A-Za-z.+_-]{0,25}$")
_DOTTED = re.compile(r"\b\d+(?:\.\d+){1,3}\b")


@dataclass(frozen=True, order=True)
class Compiler:
    backend: str
    version: str

    def __str__(self) -> str:
        return f"{self.backend}@{self.version}"


DEFAULT = Compiler(QPCFARM, COMPILER_VERSION)
"""This process's own compiler: what a job that names none is compiled with here."""


class CompilerSpecError(ValueError):
    """A `compiler` that is not `backend` or `backend@version` of a known backend."""


def parse(text: str) -> tuple[str, str | None]:
    """(backend, version or None) of `qpcfarm`, `qpcfarm@0.1.0`, `qaic@1.18.2.0`, ..."""
    backend, sep, version = text.strip().partition("@")
    if backend not in BACKENDS:
        raise CompilerSpecError(
            f"unknown compiler backend {backend!r} in {text!r}: give backend or "
            f"backend@version, backend one of {', '.join(BACKENDS)}"
        )
    if not sep:
        return backend, None
    if not _VERSION.match(version):
        raise CompilerSpecError(f"malformed compiler version {version!r} in {text!r}")
    return backend, version


def queue_name(compiler: Compiler) -> str:
    """The Celery queue of a compiler's jobs (consumed only by workers having it)."""
    return f"qpcfarm.{compiler.backend}-{compiler.version}"


def version_key(version: str) -> tuple[tuple[int, int | str], ...]:
    """Orders versions numerically part by part (`0.10.0` after `0.9.1`)."""
    parts = re.split(r"[.+_-]", version)
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in parts)


def sdk_compiler(sdk: Path) -> Path:
    return sdk / QAIC_COMPILE


def sdk_version(sdk: Path) -> str:
    """The SDK's version from its `versions/*.xml` files (the vendor installs them there):
    the first dotted number found; `unknown` when there is none. An assumption about the
    SDK's layout, not checked against a real install (see docs/service.md)."""
    folder = sdk / "versions"
    try:
        files = sorted(folder.glob("*.xml")) if folder.is_dir() else []
    except OSError:
        files = []
    for path in files:
        try:
            found = _DOTTED.search(path.read_text(errors="replace"))
        except OSError:
            continue
        if found:
            return found.group(0)
    return UNKNOWN_VERSION


def local_compilers(settings: Settings) -> list[Compiler]:
    """The compilers a worker of these settings has: `qpcfarm` at this package's version,
    and `qaic` at the SDK's version when `<qaic_sdk>/exec/qaic-compile` is an executable."""
    found = [DEFAULT]
    exe = sdk_compiler(settings.qaic_sdk)
    if exe.is_file():
        found.append(Compiler(QAIC, settings.qaic_version or sdk_version(settings.qaic_sdk)))
    return found
