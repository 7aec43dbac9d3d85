"""The importer's check of an upload, in processes of their own.

Describing an upload runs the compiler's importer (protobuf parsing, the ONNX checker, shape
inference) and, for an archive, its extraction: seconds of CPU for a large real model, and
code that a hostile file may crash. In the API process it held the GIL against every other
request. So the upload's thread hands the stored file's path to a small pool of child
processes (`DESCRIBE_PROCESSES`, spawned on first use, shared by every app in the process)
and waits for the answer: the request still gets its 201 or its 422, from the same code.

A child that dies on a file (a crash inside a parser) is replaced: the upload is tried once
more on a fresh pool (a pool that breaks fails every call in flight, other uploads' too), and
a file that breaks it twice is refused as `invalid_model`.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

from qpcfarm.app.services.errors import ServiceError

DESCRIBE_PROCESSES = max(1, min(4, os.cpu_count() or 1))

PARENT_POLL_S = 1.0

_pool: ProcessPoolExecutor | None = None
_lock = threading.Lock()

Inspected = tuple[str, tuple[int, list[dict[str, Any]], list[dict[str, Any]]]]
"""(kind, (opset, inputs, outputs)) of an accepted upload."""


def inspect_in_child(path: Path, filename: str | None, max_bytes: int, work: Path) -> Inspected:
    """`models.inspect_upload(path, filename, max_bytes, work)`, run in a describer process;
    its ServiceError is raised here as it would be in process."""
    for attempt in (1, 2):
        pool = _get_pool()
        try:
            outcome = pool.submit(_inspect, str(path), filename, max_bytes, str(work)).result()
        except BrokenProcessPool:
            _discard(pool)
            if attempt == 2:
                raise ServiceError(
                    "invalid_model",
                    "the model cannot be read (the importer's process died reading it)",
                    422,
                ) from None
            continue
        if outcome[0] == "ok":
            return outcome[1]  # type: ignore[no-any-return]
        _, code, message, status, detail = outcome
        raise ServiceError(code, message, status, detail)
    raise AssertionError("unreachable")


def _inspect(path: str, filename: str | None, max_bytes: int, work: str) -> tuple[Any, ...]:
    """In the child: the inspection's result, or its refusal as plain values."""
    from qpcfarm.app.services.models import inspect_upload

    try:
        return ("ok", inspect_upload(Path(path), filename, max_bytes, Path(work)))
    except ServiceError as exc:
        return ("error", exc.code, exc.message, exc.status, exc.detail)


def _get_pool() -> ProcessPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ProcessPoolExecutor(
                DESCRIBE_PROCESSES,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_watch_parent,
                initargs=(os.getpid(),),
            )
        return _pool


def _watch_parent(parent: int) -> None:
    """In each describer: exit when the API process is gone (killed, or ended by a signal
    that skipped its exit handlers), instead of waiting for work forever."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _discard(pool: ProcessPoolExecutor) -> None:
    global _pool
    with _lock:
        if _pool is pool:
            _pool = None
    pool.shutdown(wait=False, cancel_futures=True)


def shutdown() -> None:
    """Stop the describer processes (they are started again on the next upload): the app's
    shutdown calls it, since uvicorn may end the process by a signal that skips exit
    handlers."""
    global _pool
    with _lock:
        pool, _pool = _pool, None
    if pool is not None:
        pool.shutdown(wait=True, cancel_futures=True)
