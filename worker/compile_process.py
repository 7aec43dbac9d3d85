"""Compiles in a process of their own, for workers that live in the API's process.

The embedded mode runs its worker threads inside `qpcfarm serve`; a compile there holds the
GIL for seconds and every request waits behind it. So each worker thread owns one child
process (spawned once, reused for every compile) that runs `compile_model`; the thread only
relays: it sends the model path and options, receives progress reports, forwards them to the
job's progress callback, and reads back the result (the QPC file is written by the child into
the job's private folder). A cancel from the progress callback is passed to the child, which
stops at its next progress report; a child that does not stop, or dies (a crash, the OOM
killer), is killed and replaced, and the compile fails with `compiler_crashed`.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from compiler_core import CompileError, CompileOptions
from compiler_core.model_folder import LOCAL, ModelFolder

log = logging.getLogger(__name__)

CANCEL_GRACE_S = 10.0
"""How long a cancelled child may take to reach its next progress report."""
_CANCEL = "cancel"


@dataclass
class CompiledInChild:
    """What the parent needs of a `CompileResult` (the rest stays in the child)."""

    qpc_path: Path
    metrics: dict[str, Any]
    warnings: list[dict[str, Any]]
    pass_times: dict[str, float]


class _Cancelled(BaseException):
    """Raised in the child from its progress callback when the parent asked it to stop."""


def _child_main(conn: Connection) -> None:
    """The child's loop: one compile per request, until the pipe closes."""
    from compiler_core.compile import compile_model

    while True:
        try:
            request = conn.recv()
        except EOFError:
            return
        if request == _CANCEL:
            # a cancel that crossed the compile's last report: that compile is over already
            continue
        model_path, options_json, folder = request

        def progress(stage: str, fraction: float) -> None:
            conn.send(("progress", stage, fraction))
            if conn.poll() and conn.recv() == _CANCEL:
                raise _Cancelled

        try:
            options = CompileOptions.from_json(options_json)
            result = compile_model(model_path, options, progress=progress, model_folder=folder)
            conn.send(
                (
                    "done",
                    str(result.qpc_path),
                    result.metrics,
                    result.warnings,
                    result.pass_times,
                )
            )
        except _Cancelled:
            conn.send(("cancelled",))
        except CompileError as exc:
            conn.send(("compile_error", exc.code, exc.message, exc.to_dict()))
        except Exception as exc:  # noqa: BLE001 - reported to the parent as a failure
            log.exception("compile failed unexpectedly")
            conn.send(("crash", type(exc).__name__))


class CompileProcess:
    """One child compiler process, started on first use and replaced when it dies."""

    def __init__(self) -> None:
        self._ctx = multiprocessing.get_context("spawn")
        self._process: Any = None
        self._conn: Connection | None = None
        self._lock = threading.Lock()

    def _ensure(self) -> Connection:
        if self._process is None or not self._process.is_alive():
            parent, child = self._ctx.Pipe()
            self._process = self._ctx.Process(
                target=_child_main, args=(child,), name="qpcfarm-compile", daemon=True
            )
            self._process.start()
            child.close()
            self._conn = parent
        assert self._conn is not None
        return self._conn

    def compile(
        self,
        model_path: Path,
        options: CompileOptions,
        progress: Callable[[str, float], None],
        folder: ModelFolder = LOCAL,
    ) -> CompiledInChild:
        """Compile in the child; `progress` is called in this thread with each report and
        may raise to stop the compile (the exception is re-raised once the child stopped)."""
        with self._lock:
            conn = self._ensure()
            # full=True: the options that leave the QPC's bytes alone count here too (the
            # output folder, -aic-perf-warnings: the farm's report always has the analysis).
            conn.send((str(model_path), options.to_json(full=True), folder))
            stop: BaseException | None = None
            while True:
                try:
                    if stop is not None and not conn.poll(CANCEL_GRACE_S):
                        self._kill()
                        raise stop
                    message = conn.recv()
                except (EOFError, OSError):
                    code = self._process.exitcode if self._process is not None else None
                    self._kill()
                    if stop is not None:
                        raise stop from None
                    raise CompileError(
                        "compiler_crashed",
                        f"the compiler process died (exit code {code}) while compiling; "
                        "the model may need more memory than the farm has",
                    ) from None
                kind = message[0]
                if kind == "progress":
                    if stop is None:
                        try:
                            progress(message[1], message[2])
                        except BaseException as exc:  # a cancel or a lost job: tell the child
                            stop = exc
                            conn.send(_CANCEL)
                    continue
                if stop is not None:
                    raise stop
                if kind == "done":
                    return CompiledInChild(Path(message[1]), message[2], message[3], message[4])
                if kind == "compile_error":
                    detail = {k: v for k, v in message[3].items() if k not in ("code", "message")}
                    raise CompileError(message[1], message[2], **_known(detail))
                raise RuntimeError(f"the compiler failed unexpectedly ({message[1]})")

    def _kill(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.join(5)
        if self._conn is not None:
            self._conn.close()
        self._process = self._conn = None

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
            if self._process is not None:
                self._process.join(2)
                if self._process.is_alive():
                    self._process.kill()
            self._process = self._conn = None


def _known(detail: dict[str, Any]) -> dict[str, Any]:
    """The CompileError fields its constructor takes (flag, node, details)."""
    return {k: v for k, v in detail.items() if k in ("flag", "node", "details")}
