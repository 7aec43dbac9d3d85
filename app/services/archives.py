"""Safe extraction of a model archive (.zip, .tar, .tar.gz) holding one .onnx and its data.

Uploads are hostile until proven otherwise: every member name is checked before anything is
written (no absolute paths, no `..`, no links, no devices), the member count is bounded, and the
bytes actually written are counted against the upload limit (declared sizes can lie).
"""

from __future__ import annotations

import stat
import tarfile
import zipfile
from pathlib import Path, PurePosixPath
from typing import IO

from qpcfarm.app.services.errors import ServiceError

MAX_MEMBERS = 1000
_COPY_CHUNK = 1 << 20


def bad_archive(message: str) -> ServiceError:
    return ServiceError("bad_archive", message, 422)


def sniff_kind(head: bytes) -> str:
    """ "zip", "tar", "tar.gz" or "onnx" (anything else is handed to the ONNX importer)."""
    if head.startswith((b"PK\x03\x04", b"PK\x05\x06")):
        return "zip"
    if head.startswith(b"\x1f\x8b"):
        return "tar.gz"
    if len(head) >= 262 and head[257:262] == b"ustar":
        return "tar"
    return "onnx"


def is_archive_name(filename: str | None) -> bool:
    name = (filename or "").lower()
    return name.endswith((".zip", ".tar", ".tar.gz", ".tgz"))


def extract_archive(path: Path, dest: Path, *, max_bytes: int) -> Path:
    """Extract the archive at `path` into the empty folder `dest`; return the one .onnx in it.

    Raises ServiceError("bad_archive") for anything unsafe or not exactly one model.
    """
    with open(path, "rb") as handle:
        kind = sniff_kind(handle.read(512))
    budget = _Budget(max_bytes)
    if kind == "zip":
        _extract_zip(path, dest, budget)
    elif kind in ("tar", "tar.gz"):
        _extract_tar(path, dest, budget)
    else:
        raise bad_archive("not a .zip, .tar or .tar.gz archive")
    return _the_model(dest)


class _Budget:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.members = 0
        self.used = 0

    def member(self) -> None:
        self.members += 1
        if self.members > MAX_MEMBERS:
            raise bad_archive(f"more than {MAX_MEMBERS} members")

    def check_declared(self, n: int) -> None:
        """Refuse early when a member's declared size alone would pass the limit."""
        if self.used + n > self.max_bytes:
            self.spend(n)

    def spend(self, n: int) -> None:
        self.used += n
        if self.used > self.max_bytes:
            raise bad_archive(
                f"uncompressed contents exceed the upload limit of {self.max_bytes:,} bytes"
            )


def _safe_target(dest: Path, name: str) -> Path:
    """Where member `name` goes under `dest`, or bad_archive if it would go anywhere else."""
    try:
        return dest.joinpath(*inside_parts(name))
    except ValueError as exc:
        raise bad_archive(f"member {name[:200]!r} {exc}") from None


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
    except (zipfile.BadZipFile, OSError) as exc:
        raise bad_archive(f"unreadable zip: {exc}") from None
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
            declared += info.file_size
            targets.append((info, target))
        if declared > budget.max_bytes:
            raise bad_archive(
                f"uncompressed contents ({declared:,} bytes) exceed the upload limit "
                f"of {budget.max_bytes:,} bytes"
            )
        try:
            for info, target in targets:
                budget.member()
                if info.is_dir():
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                with archive.open(info) as source:
                    _write(source, target, budget)
        except (zipfile.BadZipFile, OSError, EOFError, NotImplementedError) as exc:
            raise bad_archive(f"corrupt zip: {exc}") from None


def _extract_tar(path: Path, dest: Path, budget: _Budget) -> None:
    try:
        archive = tarfile.open(path, "r:*")
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise bad_archive(f"unreadable tar: {exc}") from None
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
        except (tarfile.TarError, OSError, EOFError) as exc:
            raise bad_archive(f"corrupt tar: {exc}") from None


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
