"""Safe extraction of a model archive (.zip, .tar, .tar.gz) holding one .onnx and its data.

Uploads are hostile until proven otherwise: every member name is checked before anything is
written (no absolute paths, no `..`, no links, no devices, no encryption, bounded length and
depth), the member count is bounded, and the bytes actually written are counted, before they
are written, against two bounds (declared sizes can lie): the total
(`archive_max_unpacked_bytes`, and never more than the caller's limit) and the ratio to the
archive's own size (`archive_max_ratio`: a zip bomb stops at a few MiB, not at the total).
A damaged archive (bad deflate data, a truncated member) is a `bad_archive` whose message names
no server path.
"""

from __future__ import annotations

import stat
import tarfile
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO

from app.domain.services.errors import ServiceError
from app.domain.settings import Settings, get_settings
from compiler_core.file_kinds import archive_kind

MAX_MEMBERS = 1000
MAX_NAME_CHARS = 1024
"""Longest member name (all its folders included)."""
MAX_NAME_DEPTH = 32
"""Deepest folder nesting of a member."""
RATIO_ALLOWANCE = 1 << 20
"""Bytes any archive may unpack to whatever its ratio (a small archive of small files)."""
_COPY_CHUNK = 1 << 20
_READ_FAULTS = (
    zipfile.BadZipFile,
    zipfile.LargeZipFile,
    tarfile.TarError,
    zlib.error,
    EOFError,
    NotImplementedError,
    RuntimeError,  # zipfile: an encrypted member, a compression it lacks
    ValueError,
    OSError,
)


@dataclass(frozen=True)
class ArchiveLimits:
    """What extracting an archive may write: in total, and as a multiple of its size."""

    max_unpacked_bytes: int
    max_ratio: float

    @classmethod
    def from_settings(cls, settings: Settings) -> ArchiveLimits:
        return cls(settings.archive_max_unpacked_bytes, settings.archive_max_ratio)


def bad_archive(message: str) -> ServiceError:
    return ServiceError("bad_archive", message, 422)


def sniff_kind(head: bytes) -> str:
    """ "zip", "tar", "tar.gz" or "onnx" (anything else is handed to the ONNX importer)."""
    return archive_kind(head) or "onnx"


def is_archive_name(filename: str | None) -> bool:
    name = (filename or "").lower()
    return name.endswith((".zip", ".tar", ".tar.gz", ".tgz"))


def extract_archive(
    path: Path, dest: Path, *, max_bytes: int, limits: ArchiveLimits | None = None
) -> Path:
    """Extract the archive at `path` into the empty folder `dest`; return the one .onnx in it.

    `limits` default to this process's settings (the describer and worker processes read the
    same `QPCFARM_*` environment as the API); `max_bytes` caps the total further (the upload
    limit). Raises ServiceError `bad_archive` for anything unsafe or not exactly one model,
    `archive_too_large` / `archive_ratio` (413) when it would unpack past a bound.
    """
    limits = limits or ArchiveLimits.from_settings(get_settings())
    with open(path, "rb") as handle:
        kind = sniff_kind(handle.read(512))
    size = path.stat().st_size
    budget = _Budget(
        min(max_bytes, limits.max_unpacked_bytes),
        int(size * limits.max_ratio) + RATIO_ALLOWANCE,
        limits.max_ratio,
    )
    if kind == "zip":
        _extract_zip(path, dest, budget)
    elif kind in ("tar", "tar.gz"):
        _extract_tar(path, dest, budget)
    else:
        raise bad_archive("not a .zip, .tar or .tar.gz archive")
    return _the_model(dest)


def archive_too_large(max_bytes: int) -> ServiceError:
    return ServiceError(
        "archive_too_large",
        f"the archive unpacks to more than {max_bytes:,} bytes, the limit "
        "(QPCFARM_ARCHIVE_MAX_UNPACKED_BYTES, and the upload limit)",
        413,
        {"max_bytes": max_bytes},
    )


def archive_ratio(max_ratio: float) -> ServiceError:
    return ServiceError(
        "archive_ratio",
        f"the archive unpacks to more than {max_ratio:g} times its own size, the limit "
        "(QPCFARM_ARCHIVE_MAX_RATIO): a compression bomb is not a model",
        413,
        {"max_ratio": max_ratio},
    )


class _Budget:
    def __init__(self, max_bytes: int, ratio_bytes: int, max_ratio: float) -> None:
        self.max_bytes = max_bytes
        self.ratio_bytes = ratio_bytes
        self.max_ratio = max_ratio
        self.members = 0
        self.used = 0

    def member(self) -> None:
        self.members += 1
        if self.members > MAX_MEMBERS:
            raise bad_archive(f"more than {MAX_MEMBERS} members")

    def check_declared(self, n: int) -> None:
        """Refuse early when a member's declared size alone would pass a limit."""
        self.check(self.used + n)

    def check(self, total: int) -> None:
        if total > self.ratio_bytes:  # first: a bomb is named as one, whatever its total
            raise archive_ratio(self.max_ratio)
        if total > self.max_bytes:
            raise archive_too_large(self.max_bytes)

    def spend(self, n: int) -> None:
        """Count `n` bytes about to be written; refuse before they are."""
        self.check(self.used + n)
        self.used += n


def _safe_target(dest: Path, name: str) -> Path:
    """Where member `name` goes under `dest`, or bad_archive if it would go anywhere else."""
    if len(name) > MAX_NAME_CHARS:
        raise bad_archive(
            f"member {name[:60]!r}... has a name of {len(name):,} characters "
            f"(at most {MAX_NAME_CHARS})"
        )
    try:
        parts = inside_parts(name)
    except ValueError as exc:
        raise bad_archive(f"member {name[:200]!r} {exc}") from None
    if len(parts) > MAX_NAME_DEPTH:
        raise bad_archive(
            f"member {name[:60]!r}... is {len(parts)} folders deep (at most {MAX_NAME_DEPTH})"
        )
    if any(len(part.encode()) > 255 for part in parts):
        raise bad_archive(f"member {name[:60]!r}... has a path part longer than 255 bytes")
    return dest.joinpath(*parts)


def inside_parts(name: str) -> list[str]:
    """The parts of `name` as a path inside a folder (an archive, the model's folder);
    ValueError saying why it is not one: absolute, a drive, '..', NUL or empty."""
    posix = name.replace("\\", "/")
    if not posix or posix.startswith("/") or (len(posix) > 1 and posix[1] == ":"):
        raise ValueError("has an absolute path")
    parts = [p for p in PurePosixPath(posix).parts if p not in ("", ".")]
    if ".." in parts:
        raise ValueError("points outside the archive ('..')")
    if "\x00" in posix or not parts:
        raise ValueError("has an invalid name")
    return parts


def _fault(kind: str, exc: BaseException) -> ServiceError:
    """A damaged archive's refusal: what went wrong, never a server path."""
    if isinstance(exc, OSError):
        detail = exc.strerror or type(exc).__name__
    else:
        detail = str(exc).split("\n")[0][:200] or type(exc).__name__
        if "/" in detail:  # a path of ours may be quoted: say only what kind of failure
            detail = type(exc).__name__
    return bad_archive(f"corrupt {kind}: {detail}")


def _write(source: IO[bytes], target: Path, budget: _Budget) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():
        raise bad_archive(f"member {target.name!r} appears twice")
    with open(target, "wb") as out:
        while chunk := source.read(_COPY_CHUNK):
            budget.spend(len(chunk))
            out.write(chunk)


def _extract_zip(path: Path, dest: Path, budget: _Budget) -> None:
    try:
        archive = zipfile.ZipFile(path)
    except _READ_FAULTS as exc:
        raise _fault("zip", exc) from None
    with archive:
        infos = archive.infolist()
        if len(infos) > MAX_MEMBERS:
            raise bad_archive(f"more than {MAX_MEMBERS} members")
        declared = 0
        targets = []
        for info in infos:
            target = _safe_target(dest, info.filename)
            # Unix file type bits, when the creator recorded them (0: a plain file).
            file_type = stat.S_IFMT(info.external_attr >> 16)
            if file_type == stat.S_IFLNK:
                raise bad_archive(f"member {info.filename!r} is a symbolic link")
            if file_type not in (0, stat.S_IFREG, stat.S_IFDIR):
                raise bad_archive(f"member {info.filename!r} is not a regular file")
            if info.flag_bits & 0x1:
                raise bad_archive(f"member {info.filename[:200]!r} is encrypted")
            declared += info.file_size
            targets.append((info, target))
        budget.check(declared)
        try:
            for info, target in targets:
                budget.member()
                if info.is_dir():
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                with archive.open(info) as source:
                    _write(source, target, budget)
        except ServiceError:
            raise
        except _READ_FAULTS as exc:
            raise _fault("zip", exc) from None


def _extract_tar(path: Path, dest: Path, budget: _Budget) -> None:
    try:
        archive = tarfile.open(path, "r:*")
    except _READ_FAULTS as exc:
        raise _fault("tar", exc) from None
    with archive:
        try:
            # Iterating reads headers lazily, so a huge member count fails at member 1001.
            for member in archive:
                budget.member()
                target = _safe_target(dest, member.name)
                if member.issym() or member.islnk():
                    raise bad_archive(f"member {member.name!r} is a link")
                if member.isdir():
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                if not member.isfile():
                    raise bad_archive(f"member {member.name!r} is not a regular file")
                budget.check_declared(member.size)
                source = archive.extractfile(member)
                if source is None:
                    raise bad_archive(f"member {member.name!r} has no data")
                with source:
                    _write(source, target, budget)
        except ServiceError:
            raise
        except _READ_FAULTS as exc:
            raise _fault("tar", exc) from None


def _the_model(dest: Path) -> Path:
    models = sorted(
        p
        for p in dest.rglob("*.onnx")
        if p.is_file()
        and not any(part.startswith((".", "__MACOSX")) for part in p.relative_to(dest).parts)
    )
    if not models:
        raise bad_archive("the archive holds no .onnx model")
    if len(models) > 1:
        names = ", ".join(str(p.relative_to(dest)) for p in models[:5])
        raise bad_archive(f"the archive holds {len(models)} .onnx models ({names}); expected one")
    return models[0]
