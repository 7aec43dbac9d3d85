"""Which files a compile may read: the one rule for every file a compile opens besides the
model itself.

On the farm a job's files come from its upload: the model and, beside it in its archive, the
files its options name (a calibration list and the inputs it lists, a profile, a custom-IO
list, a specialization config, a node-precision file, external data). The worker hands the
compiler the extracted archive's folder (`ModelFolder.at`); every file is then resolved,
symlinks followed, and must land inside that folder, or the compile is refused with
`file_outside_model`. The refusal names the file as the job named it and nothing else: not
the server path it resolved to, not whether something exists there, not its size. A bare
model (no archive) carries no files at all (`ModelFolder.bare`).

Locally (`LOCAL`, the CLI and the Python API's default) option files are read where their
flags name them, as the vendor tool does: the user names files on their own machine. External
data is confined to the model's folder in every mode (the importer checks it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from compiler_core.errors import CompileError

OUTSIDE = "file_outside_model"


@dataclass(frozen=True)
class ModelFolder:
    """Where a compile's files may be: `root` (resolved) when `confined`; anywhere when not."""

    root: Path | None = None
    confined: bool = False

    @classmethod
    def at(cls, folder: str | os.PathLike[str]) -> ModelFolder:
        """Every file must resolve inside `folder` (the job's extracted model folder)."""
        return cls(Path(folder).resolve(), confined=True)

    @classmethod
    def bare(cls) -> ModelFolder:
        """The model came alone: no file besides it may be read."""
        return cls(None, confined=True)

    def resolve(
        self,
        name: str | os.PathLike[str],
        flag: str,
        *,
        relative_to: Path | None = None,
        code: str = OUTSIDE,
    ) -> Path:
        """The path to open for `name` (relative names are taken against `relative_to`, else
        the root; locally against the working directory). Confined: the real path, symlinks
        resolved, which must lie inside the root, else a `code` error that names `name` only."""
        given = Path(name)
        if not self.confined:
            return given if relative_to is None or given.is_absolute() else relative_to / given
        if self.root is None:
            raise CompileError(
                code,
                f"{flag}: '{name}' cannot be read: the model was uploaded alone (a bare .onnx); "
                "upload an archive (.zip or .tar) holding the model and its files",
                flag=flag if flag.startswith("-") else None,
            )
        base = relative_to if relative_to is not None else self.root
        real = (given if given.is_absolute() else base / given).resolve()
        if not real.is_relative_to(self.root):
            raise CompileError(
                code,
                f"{flag}: '{name}' is not a file inside the model's folder (absolute paths, "
                "'..' and symlinks may not lead out of it)",
                flag=flag if flag.startswith("-") else None,
                details={"file": str(name)},
            )
        return real

    def shown(self, path: str | os.PathLike[str]) -> str:
        """How messages name a file: relative to the root when confined (a server path is
        nobody's business), as given otherwise."""
        if not self.confined:
            return str(path)
        if self.root is not None:
            try:
                return Path(path).resolve().relative_to(self.root).as_posix()
            except ValueError:
                pass
        return Path(path).name

    def read_text(self, name: str | os.PathLike[str], flag: str) -> str:
        """The text of the file an option names; a missing or unreadable file is an
        `invalid_option` naming the flag and the file as given."""
        path = self.resolve(name, flag)
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            if isinstance(exc, UnicodeDecodeError):
                reason = "it is not UTF-8 text"
            raise CompileError(
                "invalid_option", f"{flag}: cannot read {name}: {reason}", flag=flag
            ) from None


LOCAL = ModelFolder()
"""Files are read where they are named (the caller's own machine)."""
