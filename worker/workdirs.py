"""Each job's private work folder, and the removal of folders whose job's process was killed.

A job extracts its model, and the compiler writes its QPC and temporary files, into a
folder of its own. A process that ends normally removes it; one that is killed (SIGKILL, the
OOM killer, a time limit) cannot, and a load test left 45 MB behind after 17 kills. So every
folder lives under one root (`work_root`) beside a lock file that its process holds
(`flock`, released by the kernel when the process dies, however it dies): a folder whose lock
can be taken belongs to nobody alive and is removed (`remove_abandoned`, called at each
worker start and by the reaper). A folder whose process still runs is never touched, whichever
farm or worker on the host it belongs to.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)

ROOT_NAME = "qpcfarm-work"
LOCK_SUFFIX = ".lock"
_NAME = re.compile(r"^(compile|profile)-[0-9a-f-]{36}-[0-9a-f]{8}$")
"""A job folder's name: kind, job id, a random part (a job re-run by a second worker of the
same host gets a folder of its own)."""


def work_root(configured: Path | None = None) -> Path:
    """Where job folders live: `configured` (QPCFARM_WORK_DIR), else the system temp folder's
    `qpcfarm-work`. Created private to this user."""
    root = Path(configured) if configured is not None else Path(tempfile.gettempdir()) / ROOT_NAME
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    return root


def _lock(path: Path, *, wait: bool) -> int | None:
    """An open, exclusively locked fd on `path` that still names the file locked (a remover
    may unlink it between our open and our lock), or None when another process holds it."""
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT if wait else os.O_RDWR, 0o600)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)
        if not wait:
            return None


@contextmanager
def job_folder(kind: str, job_id: uuid.UUID, root: Path | None = None) -> Iterator[Path]:
    """A new private folder for one run of a job, removed when the block ends; its lock is
    held meanwhile, so `remove_abandoned` leaves it alone until this process is gone."""
    base = work_root(root)
    name = f"{kind}-{job_id}-{uuid.uuid4().hex[:8]}"
    lock = base / f"{name}{LOCK_SUFFIX}"
    fd = _lock(lock, wait=True)
    assert fd is not None
    folder = base / name
    try:
        folder.mkdir(mode=0o700)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        lock.unlink(missing_ok=True)
        os.close(fd)


def remove_abandoned(root: Path | None = None) -> list[Path]:
    """Remove the job folders under `root` whose process is gone (their lock is free);
    returns them. Folders of running jobs, and anything not named like a job folder, stay."""
    base = work_root(root)
    removed: list[Path] = []
    for lock in sorted(base.glob(f"*{LOCK_SUFFIX}")):
        name = lock.name[: -len(LOCK_SUFFIX)]
        if not _NAME.match(name):
            continue
        fd = _lock(lock, wait=False)
        if fd is None:  # held: the job's process is alive
            continue
        try:
            folder = base / name
            if folder.exists():
                shutil.rmtree(folder, ignore_errors=True)
                removed.append(folder)
            lock.unlink(missing_ok=True)
        finally:
            os.close(fd)
    if removed:
        log.warning(
            "removed %d work folder(s) of killed jobs: %s",
            len(removed),
            ", ".join(p.name for p in removed),
        )
    return removed
