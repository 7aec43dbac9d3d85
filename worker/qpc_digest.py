"""The QPC's sha256 taken while the compiler is still at work.

A compile writes its QPC in its `write-qpc` stage and then builds its perf report (the cost
model over the program, 0.1-0.5 s for a ResNet-50); the file is final once that stage ends
(written to a temp name, renamed into place). So when the progress callback sees `write-qpc`
end, a thread hashes the file and fsyncs it (`blobs.base.file_digest`) while the compiler
goes on, and the store links the file in with that digest (`put_file(digest=...)`) instead
of reading it again, as long as it is the same inode with the same size and mtime: the
compiler writes nothing to it after that stage.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from app.domain.blobs.base import FileDigest, file_digest

log = logging.getLogger(__name__)

WRITE_QPC = "write-qpc"
"""The compiler's stage that writes the QPC (compiler_core.build)."""


class EarlyDigest:
    """`file_digest(path)` in a thread started by `start` (once); `result` waits for it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._thread: threading.Thread | None = None
        self._digest: FileDigest | None = None

    def on_progress(self, stage: str, fraction: float) -> None:
        """A progress observer: starts the digest when `write-qpc` ends."""
        if stage == WRITE_QPC and fraction >= 1.0:
            self.start()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="qpc-digest", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:
            self._digest = file_digest(self.path)
        except OSError as exc:  # the store hashes the file itself then
            log.warning("early digest of %s failed: %s", self.path, exc)

    def result(self, path: Path) -> FileDigest | None:
        """The digest, if it was started and `path` is the file it hashed; else None."""
        if self._thread is None or path != self.path:
            return None
        self._thread.join()
        return self._digest
