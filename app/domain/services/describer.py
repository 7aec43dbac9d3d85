"""The importer's check of an upload, in processes of their own, under limits.

Describing an upload runs the compiler's importer (protobuf parsing, the ONNX checker, shape
inference) and, for an archive, its extraction: seconds of CPU for a large real model, and
code that a hostile file may crash, keep busy for hours or make allocate without bound. In
the API process it held the GIL against every other request. So the upload's thread hands
the stored file's path to one of a few checker processes (`DESCRIBE_PROCESSES` slots, each a
one-process pool spawned on first use, shared by every app in the process) and waits for the
answer: the request still gets its 201 or its 422, from the same code.

Limits (`app.domain.services.limits`, set by `configure` from the app's settings): each checker caps
its address space (`RLIMIT_AS`), so an upload whose check needs more fails there with a
`MemoryError`; the upload's thread waits at most the time limit, counted from the moment its
checker took the file (not while it waited for a free one), then kills that checker. Either
way the upload is refused 422 `model_check_limit`, saying which limit, and the slot gets a
fresh process: other teams' uploads keep their checkers.

A checker that dies on a file (a crash inside a parser) is replaced: the upload is tried once
more on a fresh process, and a file that kills it twice is refused as `invalid_model`.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

from app.domain.services.errors import ServiceError
from app.domain.services.limits import Limits, apply_memory_limit, caused_by_memory

DESCRIBE_PROCESSES = max(1, min(4, os.cpu_count() or 1))

PARENT_POLL_S = 1.0

LIMIT_CODE = "model_check_limit"

Inspected = tuple[str, tuple[int, list[dict[str, Any]], list[dict[str, Any]]]]
"""(kind, (opset, inputs, outputs)) of an accepted upload."""


class _Slots:
    """`size` checker processes, each a one-process pool, handed to one caller at a time."""

    def __init__(self, size: int, limits: Limits) -> None:
        self.limits = limits
        self._free: list[ProcessPoolExecutor | None] = [None] * size
        self._busy: set[ProcessPoolExecutor] = set()
        self._cond = threading.Condition()
        self._closed = False

    def take(self) -> tuple[ProcessPoolExecutor, bool]:
        """A checker of its own for the caller, and whether it is new (started because the
        slot had none: its process still has to start and import the importer)."""
        with self._cond:
            self._cond.wait_for(lambda: bool(self._free) or self._closed)
            if self._closed:
                raise RuntimeError("the upload checkers are shut down")
            pool = self._free.pop()
            fresh = pool is None
            if pool is None:
                pool = ProcessPoolExecutor(
                    1,
                    mp_context=multiprocessing.get_context("spawn"),
                    initializer=_start_checker,
                    initargs=(os.getpid(), self.limits.memory_bytes),
                )
            self._busy.add(pool)
            return pool, fresh

    def give_back(self, pool: ProcessPoolExecutor, *, replace: bool = False) -> None:
        """Return the caller's checker; `replace`: it is killed (or broken) and the slot
        gets a fresh one on its next use."""
        if replace:
            _kill(pool)
        with self._cond:
            self._busy.discard(pool)
            if self._closed:
                if not replace:
                    pool.shutdown(wait=False, cancel_futures=True)
                return
            self._free.append(None if replace else pool)
            self._cond.notify()

    def pids(self) -> list[int]:
        """The checker processes running now (for tests and diagnostics)."""
        with self._cond:
            pools = [p for p in [*self._free, *self._busy] if p is not None]
        return [pid for pool in pools for pid in _pids(pool)]

    def close(self, wait: bool) -> None:
        with self._cond:
            self._closed = True
            idle = [p for p in self._free if p is not None]
            busy = list(self._busy)
            self._free.clear()
            self._cond.notify_all()
        for pool in idle:
            pool.shutdown(wait=wait, cancel_futures=True)
        for pool in busy:  # a check in flight ends with its process
            _kill(pool)


_slots: _Slots | None = None
_limits = Limits()
_lock = threading.Lock()


def configure(limits: Limits) -> None:
    """Use `limits` for the checkers started from now on (the app's start sets them from its
    settings); running checkers with other limits are replaced."""
    global _limits
    with _lock:
        changed = limits != _limits
        _limits = limits
    if changed:
        shutdown()


def inspect_in_child(
    path: Path,
    filename: str | None,
    max_bytes: int,
    work: Path,
    input_shapes: list[tuple[str, list[int]]] | None = None,
) -> Inspected:
    """`upload_check.inspect_upload(path, filename, max_bytes, work, input_shapes)`, run in a
    checker process under the limits; its ServiceError is raised here as it would be in
    process."""
    outcome = run_limited(_inspect, str(path), filename, max_bytes, str(work), input_shapes)
    if outcome[0] == "ok":
        return outcome[1]  # type: ignore[no-any-return]
    _, code, message, status, detail = outcome
    raise ServiceError(code, message, status, detail)


def run_limited(function: Callable[..., tuple[Any, ...]], *args: Any) -> tuple[Any, ...]:
    """`function(*args)` in a checker process under the limits: its result, unless a limit
    stops it (ServiceError `model_check_limit`, the checker replaced: a `("memory",)` result
    or a MemoryError says the memory limit stopped it) or its process dies twice
    (`invalid_model`). `function` must be importable by name (a module's function)."""
    for attempt in (1, 2):
        slots = _get_slots()
        pool, fresh = slots.take()
        replace = True
        try:
            if fresh:  # the limit counts the check, not the process's start and imports
                pool.submit(_warm).result()
            outcome = pool.submit(function, *args).result(timeout=slots.limits.time_s)
            replace = outcome[0] == "memory"  # a fresh process after an exhausted one
        except FutureTimeout:
            raise time_limit_error(slots.limits) from None
        except MemoryError:
            raise memory_limit_error(slots.limits) from None
        except BrokenProcessPool:
            if attempt == 2:
                raise ServiceError(
                    "invalid_model",
                    "the model cannot be read (the importer's process died reading it)",
                    422,
                ) from None
            continue
        finally:
            slots.give_back(pool, replace=replace)
        if outcome[0] == "memory":
            raise memory_limit_error(slots.limits)
        return outcome
    raise AssertionError("unreachable")


def time_limit_error(limits: Limits) -> ServiceError:
    return ServiceError(
        LIMIT_CODE,
        f"checking the model took longer than the farm's limit of {limits.time_s:g} s per "
        "upload and was stopped; check the model (deeply nested functions or subgraphs, a "
        "huge graph), or ask the farm's operator to raise QPCFARM_CHECK_TIME_LIMIT_S",
        422,
        {"limit": "time", "limit_s": limits.time_s},
    )


def memory_limit_error(limits: Limits) -> ServiceError:
    return ServiceError(
        LIMIT_CODE,
        f"checking the model needed more memory than the farm's limit of "
        f"{limits.memory_mib:,} MiB per upload and was stopped; check the model's declared "
        "shapes and sizes, or ask the farm's operator to raise QPCFARM_CHECK_MEMORY_LIMIT_MIB",
        422,
        {"limit": "memory", "limit_mib": limits.memory_mib},
    )


def _inspect(
    path: str,
    filename: str | None,
    max_bytes: int,
    work: str,
    input_shapes: list[tuple[str, list[int]]] | None = None,
) -> tuple[Any, ...]:
    """In the child: the inspection's result, or its refusal as plain values."""
    from app.domain.services.upload_check import inspect_upload

    try:
        return ("ok", inspect_upload(Path(path), filename, max_bytes, Path(work), input_shapes))
    except ServiceError as exc:
        if caused_by_memory(exc):  # the importer's catch-all wraps it as invalid_model
            return ("memory",)
        return ("error", exc.code, exc.message, exc.status, exc.detail)
    except MemoryError:
        return ("memory",)


def _warm() -> int:
    """In a new checker: import what a check needs."""
    import app.domain.services.upload_check  # noqa: F401

    return os.getpid()


def _get_slots() -> _Slots:
    global _slots
    with _lock:
        if _slots is None:
            _slots = _Slots(DESCRIBE_PROCESSES, _limits)
        return _slots


def _start_checker(parent: int, memory_bytes: int | None) -> None:
    """In each checker: cap its memory, and exit when the API process is gone (killed, or
    ended by a signal that skipped its exit handlers) instead of waiting for work forever."""
    apply_memory_limit(memory_bytes)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _pids(pool: ProcessPoolExecutor) -> list[int]:
    processes = getattr(pool, "_processes", None) or {}
    return [p.pid for p in list(processes.values()) if p.pid is not None]


def _kill(pool: ProcessPoolExecutor) -> None:
    """End a checker now, whatever it is doing (a check past its time limit)."""
    for pid in _pids(pool):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    pool.shutdown(wait=False, cancel_futures=True)


def checker_pids() -> list[int]:
    """The pids of the running checker processes."""
    return _get_slots().pids()


def shutdown() -> None:
    """Stop the checker processes (they are started again on the next upload): the app's
    shutdown calls it, since uvicorn may end the process by a signal that skips exit
    handlers."""
    global _slots
    with _lock:
        slots, _slots = _slots, None
    if slots is not None:
        slots.close(wait=True)
