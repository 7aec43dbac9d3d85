"""Compiles in a process of their own, under a memory limit and a wall-clock limit.

Every worker compiles this way (the embedded mode's job processes and worker threads, and
each Celery worker process): a team's model may make the compiler allocate without bound or
run for hours, and the process that runs it must be one the worker can limit and kill. Each
worker owns one child (spawned once, reused for every compile) that runs `compile_model`;
the worker only relays: it sends the model path and options, receives progress reports,
forwards them to the job's progress callback, and reads back the result (the QPC file is
written by the child into the job's private folder).

Limits (`app.domain.services.limits`): the child caps its own address space (`RLIMIT_AS`), so an
allocation beyond it fails there as a `MemoryError` and the compile fails
`compile_memory_limit`; the parent kills the child at the wall-clock deadline and fails the
compile `compile_time_limit`. Either way the child is replaced for the next compile.

Stopping: the parent checks `poll` (the job's cancel, or losing the job) several times a
second whether or not the child reports progress; a stop is passed to the child, which ends
at its next progress report, and a child that has not stopped `CANCEL_GRACE_S` later (stuck
inside one pass) is killed. A child that dies (a crash, the OOM killer) is replaced, and the
compile fails `compiler_crashed`.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import AuthenticationString  # type: ignore[attr-defined]
from pathlib import Path
from typing import Any

from app.domain.services.limits import Limits, apply_memory_limit, caused_by_memory
from compiler_core import CompileError, CompileOptions
from compiler_core.model_folder import LOCAL, ModelFolder

log = logging.getLogger(__name__)

CANCEL_GRACE_S = 2.0
"""How long a stopped child may take to reach its next progress report before it is killed
(a warm child is worth keeping: a new one imports the compiler again)."""
TICK_S = 0.2
"""How often the parent looks at the deadline and at `poll` while the child is silent."""
PARENT_POLL_S = 1.0
"""How often the child checks that its parent is alive (an orphan exits)."""
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


def _watch_parent(parent: int) -> None:
    """Exit when the parent is gone (killed by SIGKILL, by Celery's hard time limit): an
    orphaned compile must not run on, writing into a folder nobody reads."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _child_main(conn: Connection, memory_bytes: int | None, parent: int) -> None:
    """The child's loop: one compile per request, until the pipe closes."""
    apply_memory_limit(memory_bytes)
    _watch_parent(parent)
    from compiler_core.compile import compile_model

    while True:
        try:
            request = conn.recv()
        except EOFError:
            return
        if request == _CANCEL:
            # a cancel that crossed the compile's last report: that compile is over already
            continue
        model_path, options_json, tmp_dir, folder = request
        conn.send(("started",))  # the time limit counts from here, not from the imports

        def progress(stage: str, fraction: float) -> None:
            conn.send(("progress", stage, fraction))
            if conn.poll() and conn.recv() == _CANCEL:
                raise _Cancelled

        # The compiler's own temporary files go to the job's folder too (removed with it,
        # also after a kill).
        tempfile.tempdir = tmp_dir
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
        except BaseException as exc:  # noqa: BLE001 - reported to the parent as a failure
            if caused_by_memory(exc):
                conn.send(("memory",))
            elif isinstance(exc, CompileError):
                conn.send(("compile_error", exc.code, exc.message, exc.to_dict()))
            elif isinstance(exc, Exception):
                log.exception("compile failed unexpectedly")
                conn.send(("crash", type(exc).__name__))
            else:
                raise
        finally:
            tempfile.tempdir = None


def time_limit_error(limits: Limits) -> CompileError:
    seconds = limits.time_s
    return CompileError(
        "compile_time_limit",
        f"the compile did not finish within the farm's time limit of {seconds:g} s and was "
        "stopped; compile a smaller model or fewer specializations, or ask the farm's "
        "operator to raise QPCFARM_COMPILE_TIME_LIMIT_S",
        details={"limit": "time", "limit_s": seconds},
    )


def memory_limit_error(limits: Limits) -> CompileError:
    mib = limits.memory_mib
    return CompileError(
        "compile_memory_limit",
        f"the compile needed more memory than the farm's limit of {mib:,} MiB per compile and "
        "was stopped; check the model's shapes and constants (a constant folded to a huge "
        "tensor, a large -batchsize or symbol value), or ask the farm's operator to raise "
        "QPCFARM_COMPILE_MEMORY_LIMIT_MIB",
        details={"limit": "memory", "limit_mib": mib},
    )


def allow_children() -> None:
    """Let this process start its compile child although multiprocessing counts it as
    daemonic (a Celery prefork child, the embedded mode's job process): such a process may
    not have children only because it could not clean them up at exit, and the compile
    child cleans up after itself (it exits when its parent is gone)."""
    current = multiprocessing.current_process()
    config = current._config  # type: ignore[attr-defined]
    if config.get("daemon"):
        config["daemon"] = False
    # Celery's pool (billiard) gives its processes an authkey of its own type, which
    # multiprocessing's spawn refuses to pickle: the same bytes in multiprocessing's type.
    if not isinstance(config.get("authkey"), AuthenticationString):
        config["authkey"] = AuthenticationString(bytes(current.authkey))


class CompileProcess:
    """One child compiler process under `limits`, started on first use and replaced when it
    dies, is killed, or hit its memory limit."""

    def __init__(self, limits: Limits | None = None) -> None:
        self.limits = limits or Limits()
        self._ctx = multiprocessing.get_context("spawn")
        self._process: Any = None
        self._conn: Connection | None = None
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        return None if self._process is None else int(self._process.pid)

    def start(self) -> CompileProcess:
        """Spawn the child now (its imports take a while), not in the first compile."""
        with self._lock:
            self._ensure()
        return self

    def _ensure(self) -> Connection:
        if self._process is None or not self._process.is_alive():
            self._kill()
            allow_children()
            parent, child = self._ctx.Pipe()
            self._process = self._ctx.Process(
                target=_child_main,
                args=(child, self.limits.memory_bytes, os.getpid()),
                name="qpcfarm-compile",
                daemon=True,
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
        *,
        poll: Callable[[], None] | None = None,
        tmp_dir: Path | None = None,
        folder: ModelFolder = LOCAL,
    ) -> CompiledInChild:
        """Compile in the child; `progress` is called in this thread with each report, and
        `poll` between reports (at least every `TICK_S`); either may raise to stop the
        compile (the exception is re-raised once the child stopped or was killed). The
        child's temporary files go to `tmp_dir`. CompileError `compile_time_limit` or
        `compile_memory_limit` when a limit ends it."""
        with self._lock:
            try:
                return self._relay(model_path, options, progress, poll, tmp_dir, folder)
            except BaseException:
                # Anything unexpected here (Celery's soft time limit, a database error in
                # the callbacks) must not leave the child compiling for nobody.
                if self._conn is not None and self._busy:
                    self._kill()
                raise

    _busy = False

    def _relay(
        self,
        model_path: Path,
        options: CompileOptions,
        progress: Callable[[str, float], None],
        poll: Callable[[], None] | None,
        tmp_dir: Path | None,
        folder: ModelFolder,
    ) -> CompiledInChild:
        conn = self._ensure()
        # full=True: the options that leave the QPC's bytes alone count here too (the output
        # folder, -aic-perf-warnings: the farm's report always has the analysis).
        request = (
            str(model_path),
            options.to_json(full=True),
            str(tmp_dir) if tmp_dir else None,
            folder,
        )
        conn.send(request)
        self._busy = True
        deadline: float | None = None
        stop: BaseException | None = None
        kill_at: float | None = None
        while True:
            try:
                ready = conn.poll(TICK_S)
                if not ready:
                    now = time.monotonic()
                    if kill_at is not None and now >= kill_at:
                        self._kill()
                        assert stop is not None
                        raise stop
                    if stop is None and deadline is not None and now >= deadline:
                        self._kill()
                        log.warning("compile of %s stopped at its time limit", model_path)
                        raise time_limit_error(self.limits)
                    if stop is None and poll is not None:
                        try:
                            poll()
                        except BaseException as exc:  # a cancel or a lost job: tell the child
                            stop, kill_at = exc, now + CANCEL_GRACE_S
                            _tell(conn, _CANCEL)
                    continue
                message = conn.recv()
            except (EOFError, OSError):
                code = None
                if self._process is not None:
                    self._process.join(1)  # its pipe closes just before it is reaped
                    code = self._process.exitcode
                self._kill()
                if stop is not None:
                    raise stop from None
                raise self._crashed(code) from None
            kind = message[0]
            if kind == "started":
                if self.limits.time_s is not None:
                    deadline = time.monotonic() + self.limits.time_s
                continue
            if kind == "progress":
                if stop is None:
                    try:
                        progress(message[1], message[2])
                    except BaseException as exc:  # a cancel or a lost job: tell the child
                        stop, kill_at = exc, time.monotonic() + CANCEL_GRACE_S
                        _tell(conn, _CANCEL)
                continue
            self._busy = False
            if kind == "memory":
                # The allocation failed cleanly, but a process that ran out of address space
                # may hold half-built state: the next compile gets a fresh one.
                self._kill()
                raise memory_limit_error(self.limits)
            if stop is not None:
                raise stop
            if kind == "done":
                return CompiledInChild(Path(message[1]), message[2], message[3], message[4])
            if kind == "compile_error":
                detail = {k: v for k, v in message[3].items() if k not in ("code", "message")}
                raise CompileError(message[1], message[2], **_known(detail))
            raise RuntimeError(f"the compiler failed unexpectedly ({message[1]})")

    def _crashed(self, code: int | None) -> CompileError:
        message = f"the compiler process died (exit code {code}) while compiling; "
        if self.limits.memory_bytes is not None:
            message += (
                f"it ran under the farm's memory limit of {self.limits.memory_mib:,} MiB per "
                "compile, and a model that needs more memory than that can end this way"
            )
        else:
            message += "the model may need more memory than the farm has"
        return CompileError("compiler_crashed", message, details={"exit_code": code})

    def _kill(self) -> None:
        self._busy = False
        if self._process is not None:
            if self._process.is_alive():
                try:
                    os.kill(self._process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
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
                    self._process.join(5)
            self._process = self._conn = None


def _tell(conn: Connection, message: str) -> None:
    """Send to a child that may have died meanwhile (its end is seen at the next receive)."""
    try:
        conn.send(message)
    except OSError:
        pass


def _known(detail: dict[str, Any]) -> dict[str, Any]:
    """The CompileError fields its constructor takes (flag, node, details)."""
    return {k: v for k, v in detail.items() if k in ("flag", "node", "details")}
