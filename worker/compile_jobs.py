"""A compile job on a worker: claim it, compile it with progress and a heartbeat, store
the QPC and its report, or the structured error.

Results are stored by content: a job run twice (a redelivered message, a re-claim after a
dead worker) stores one QPC row per team and one blob. A cancel, or losing the job to another
worker, stops the compile at its next progress report or heartbeat (the progress callback
raises a private BaseException that no `except Exception` in the compiler swallows); a
compile in a child process (`worker.compile_process`) is also polled between reports, and
killed when it does not stop, so a compile stuck inside one pass is stopped within seconds.
The job works in a private folder (`worker.workdirs`) that is removed even if its process
is killed.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from app.domain import stages
from app.domain.blobs import BlobCorrupt, BlobNotFound, BlobRef, BlobStore
from app.domain.blobs import guard as blob_guard
from app.domain.compilers import QAIC, QPCFARM, local_compilers
from app.domain.compilers import parse as parse_compiler
from app.domain.db.base import utcnow
from app.domain.db.faults import DATABASE_FAULTS
from app.domain.db.models import CompileJob, CompileReport, JobStatus, Model, Qpc
from app.domain.db.ops import insert_or_ignore
from app.domain.services.errors import ServiceError, internal_error_message
from app.domain.services.limits import Limits
from app.domain.services.model_files import check_model_files
from app.domain.services.models import materialize_model
from app.domain.services.qpcs import CONVERSION_METRIC, PROFILE_METRIC
from app.domain.services.upload_check import KIND_ARCHIVE
from app.domain.settings import get_settings
from compiler_core import CompileError, CompileOptions
from compiler_core.convert import CONVERTED_FILE
from compiler_core.model_folder import ModelFolder
from compiler_core.version import COMPILER_VERSION
from worker import claims
from worker.claims import STALE_AFTER_S, touch
from worker.compile_process import CompileProcess
from worker.qpc_digest import EarlyDigest
from worker.workdirs import job_folder

log = logging.getLogger(__name__)

ProgressCallback = Callable[[str, float], None]


def claim(
    session: Session,
    job_id: uuid.UUID,
    worker: str,
    *,
    now: dt.datetime | None = None,
    stale_after_s: float = STALE_AFTER_S,
) -> CompileJob | None:
    """`claims.claim_job` of a compile (its stage starts at `claimed`, progress at 0)."""
    job = claims.claim_job(session, "compile", job_id, worker, now=now, stale_after_s=stale_after_s)
    assert job is None or isinstance(job, CompileJob)
    return job


def fail(
    session: Session,
    job: CompileJob,
    code: str,
    message: str,
    detail: dict[str, Any] | None = None,
    *,
    now: dt.datetime | None = None,
    stage: str | None = None,
) -> None:
    """`claims.fail` on compile_jobs; `stage` (the stage it failed in) is recorded too."""
    extra = {"stage": stage[:64]} if stage is not None else None
    claims.fail(session, CompileJob, job, code, message, detail, now=now, values=extra)


def report_progress(
    session: Session,
    job: CompileJob,
    stage: str | None = None,
    progress: float | None = None,
    *,
    now: dt.datetime | None = None,
) -> bool:
    """Record stage/progress (or just a heartbeat) of a job this worker runs. Commits.

    Returns True when the worker should stop: a cancel was requested, or the job is no longer
    this worker's (re-claimed after a missed heartbeat, or finished elsewhere).
    """
    values: dict[str, Any] = {"heartbeat_at": now or utcnow()}
    if stage is not None:
        values["stage"] = stage[:64]
    if progress is not None:
        values["progress"] = max(0.0, min(1.0, progress))
    assert job.worker is not None, "report_progress needs a claimed job"
    mine, cancel_requested = touch(session, CompileJob, job.id, job.worker, values)
    if mine:
        for name, value in values.items():
            setattr(job, name, value)
        job.cancel_requested = cancel_requested
    return not mine or cancel_requested


@dataclass
class CompileOutcome:
    """What a successful compile adds to the database besides the QPC blob."""

    metrics: dict[str, Any]
    warnings: list[dict[str, Any]]
    pass_times: dict[str, float]
    requirements: dict[str, Any]
    log: str = ""


def succeed(
    session: Session,
    job: CompileJob,
    qpc_ref: BlobRef,
    outcome: CompileOutcome,
    *,
    now: dt.datetime | None = None,
    compiler_version: str = COMPILER_VERSION,
) -> Qpc:
    """Store the team's QPC row (get-or-create by team and sha256) and its report, and mark the job
    succeeded if it is still running. Safe to call twice or from two workers. Commits."""
    now = now or utcnow()
    insert_or_ignore(
        session,
        Qpc,
        {
            "id": uuid.uuid4(),
            "team_id": job.team_id,
            "sha256": qpc_ref.sha256,
            "size": qpc_ref.size,
            "compiler_version": compiler_version,
            "options_key": job.options_key,
            "device": job.device,
            "requirements": outcome.requirements,
            "created_at": now,
        },
        ["team_id", "sha256"],
    )
    qpc = session.execute(
        select(Qpc).where(Qpc.team_id == job.team_id, Qpc.sha256 == qpc_ref.sha256)
    ).scalar_one()
    insert_or_ignore(
        session,
        CompileReport,
        {
            "id": uuid.uuid4(),
            "qpc_id": qpc.id,
            "metrics": outcome.metrics,
            "warnings": outcome.warnings,
            "pass_times": outcome.pass_times,
            "log": outcome.log,
            "created_at": now,
        },
        ["qpc_id"],
    )
    session.execute(
        update(CompileJob)
        .where(CompileJob.id == job.id, CompileJob.status == JobStatus.running)
        .values(
            status=JobStatus.succeeded,
            stage=stages.DONE,
            progress=1.0,
            qpc_id=qpc.id,
            finished_at=now,
            heartbeat_at=now,
        ),
        execution_options={"synchronize_session": False},
    )
    session.commit()
    session.refresh(job)
    return qpc


def _finish_cancelled(session: Session, job: CompileJob) -> None:
    session.execute(
        update(CompileJob)
        .where(CompileJob.id == job.id, CompileJob.status == JobStatus.running)
        .values(status=JobStatus.cancelled, stage=stages.CANCELLED, finished_at=utcnow()),
        execution_options={"synchronize_session": False},
    )
    session.commit()
    session.refresh(job)


class _Stop(BaseException):
    """Raised from the progress callback to abandon a compile. A BaseException so that no
    `except Exception` inside the compiler swallows it."""

    def __init__(self, cancelled: bool) -> None:
        super().__init__("cancelled" if cancelled else "job lost")
        self.cancelled = cancelled


QPC_FILE = "programqpc.bin"
"""The QPC's name in the compiler's output folder (`-aic-binary-dir`)."""

COMPILER_RAN = "the compiler ran"
"""The log line of the compiler's whole time as the worker saw it (its stages, the fit check,
the perf report, the hand-over): bench/service.py --overhead reads it."""

CANCEL_POLL_S = 1.0
"""How often a compile in a child process reads its row's cancel flag between reports."""

STAGE_WRITE_GAP_S = 0.1
"""A stage change is written at once unless the row was written less than this ago (then with
the next report due): a small compile passes a dozen stages in 0.1 s, and each write is a
transaction that takes the database's writer lock, which submits wait for."""


@dataclass
class _Progress:
    """The compiler's progress callback: writes stage and progress to the job row (a stage
    change at once unless the last write is under `STAGE_WRITE_GAP_S` old, otherwise at most
    every `interval` s), keeps a log, and stops the compile when the job is cancelled or
    taken over. A failure records the last stage reported, written or not."""

    session: Session
    job: CompileJob
    interval: float
    observer: ProgressCallback | None
    should_cancel: Callable[[], bool] | None
    stage_observer: ProgressCallback | None = None
    """The worker's own observer (`qpc_digest.EarlyDigest`), beside the caller's."""
    started: float = field(default_factory=time.monotonic)
    lines: list[str] = field(default_factory=list)
    _stage: str | None = None
    _fraction: float = 0.0
    _written: float = 0.0
    _written_stage: str | None = None
    _polled: float = 0.0
    job_id: uuid.UUID = field(init=False)
    worker: str | None = field(init=False)
    """The row's id and worker, kept apart from it: a rollback expires the row's attributes,
    and reading them back needs the database that just did not answer."""

    def __post_init__(self) -> None:
        self.job_id, self.worker = self.job.id, self.job.worker

    def __call__(self, stage: str, fraction: float) -> None:
        now = time.monotonic()
        if self.observer is not None:
            self.observer(stage, fraction)
        if self.stage_observer is not None:
            self.stage_observer(stage, fraction)
        changed = stage != self._stage
        if changed:
            self.note(f"stage {stage}")
            self._stage = stage
        self._fraction = fraction
        since = now - self._written
        if since >= self.interval or (changed and since >= STAGE_WRITE_GAP_S):
            self._write(now)
        self.check()

    def _write(self, now: float) -> None:
        """Write stage and progress; a database that does not answer skips the write (the
        compile goes on, the next report writes again)."""
        self._written, self._written_stage = now, self._stage
        try:
            stop = report_progress(self.session, self.job, self._stage, self._fraction)
        except DATABASE_FAULTS:
            self.session.rollback()
            log.warning("job %s: progress not written, the database did not answer", self.job_id)
            return
        if stop:
            raise _Stop(cancelled=self.job.cancel_requested or self._cancel_requested())

    @property
    def stage(self) -> str | None:
        """The stage reported last (written or not): a failure records it."""
        return self._stage

    def check(self) -> None:
        if self.should_cancel is not None and self.should_cancel():
            # the heartbeat stopped: a cancel, or the job went to another worker (then it is
            # abandoned, not marked cancelled: the row belongs to the other worker now)
            raise _Stop(cancelled=self._cancel_requested() or self._still_mine())

    def poll(self) -> None:
        """Between reports of a compile in a child: the heartbeat's stop, and the row's
        cancel flag every `CANCEL_POLL_S` (a pass may run for minutes without a report)."""
        self.check()
        now = time.monotonic()
        if self._stage != self._written_stage and now - self._written >= STAGE_WRITE_GAP_S:
            self._write(now)  # a stage held back by the write gap: the row names it now
        if now - self._polled >= CANCEL_POLL_S:
            self._polled = now
            if self._cancel_requested():
                raise _Stop(cancelled=True)

    def _still_mine(self) -> bool:
        """Whether the row still names this worker; unknown (no answer) counts as not: the
        compile is then abandoned, not marked, and the claim sorts the row out later."""
        try:
            worker = self.session.execute(
                select(CompileJob.worker).where(
                    CompileJob.id == self.job_id, CompileJob.status == JobStatus.running
                )
            ).scalar_one_or_none()
            self.session.commit()
        except DATABASE_FAULTS:
            self.session.rollback()
            log.warning("job %s: ownership unknown, the database did not answer", self.job_id)
            return False
        return worker is not None and worker == self.worker

    def _cancel_requested(self) -> bool:
        """Whether a cancel was asked; a database that is down meanwhile (no answer) is no
        cancel: the compile goes on and the next poll asks again."""
        try:
            flag = self.session.execute(
                select(CompileJob.cancel_requested).where(CompileJob.id == self.job_id)
            ).scalar_one_or_none()
            self.session.commit()
        except DATABASE_FAULTS:
            self.session.rollback()
            log.warning("job %s: cancel poll skipped, the database did not answer", self.job_id)
            return False
        return bool(flag)

    def note(self, text: str) -> None:
        self.lines.append(f"[{time.monotonic() - self.started:8.3f}s] {text}")


SHAPES_ADVICE = (
    "; on the farm, give them as the compile's -input-shapes or as the upload's input_shapes "
    "(recorded with the model: the default of its compiles)"
)


def _farm_advice(exc: CompileError) -> None:
    """Add the farm's second way to give a model's input shapes (at upload) to the
    compiler's ask for them, which knows only the compile's flag."""
    if exc.code == "input_shape_required" and SHAPES_ADVICE not in exc.message:
        exc.message += SHAPES_ADVICE
        exc.args = (exc.message,)


def _shapes_from(conversion: dict[str, Any], model: Model) -> dict[str, str]:
    """Which input shapes a conversion used: the upload's (recorded with the model, the
    default) or the compile's own `-input-shapes`; nothing when it used the model's own."""
    used = conversion.get("input_shapes")
    if not used:
        return {}
    return {"input_shapes_from": "upload" if used == model.input_shapes else "-input-shapes"}


def run_compile(
    session: Session,
    store: BlobStore,
    job: CompileJob,
    progress_cb: ProgressCallback | None = None,
    should_cancel: Callable[[], bool] | None = None,
    *,
    progress_interval_s: float = 1.0,
    compiler: CompileProcess | None = None,
    work_root: Path | None = None,
) -> CompileJob:
    """Compile a job this worker has claimed, from model blob to stored QPC and report.

    Progress goes to the job row (and to `progress_cb`); a cancel (the row's flag or
    `should_cancel()`) stops the compile at its next progress report, or, in `compiler`'s
    child, within seconds whatever it is doing. Ends the job succeeded, failed (a
    CompileError keeps its code, flag and node; a limit of `compiler` is
    `compile_time_limit` or `compile_memory_limit`; anything else is `internal_error`) or
    cancelled. The job's files live in a folder under `work_root` (`worker.workdirs`). A job
    that is not running is returned untouched. Commits.
    """
    if job.status != JobStatus.running:
        return job
    job_id = job.id  # for the log after a rollback, which expires the row's attributes
    progress = _Progress(session, job, progress_interval_s, progress_cb, should_cancel)
    try:
        model = session.get(Model, job.model_id)
        if model is None:
            raise CompileError("model_missing", f"model {job.model_id} no longer exists")
        compiler_spec = check_compiler(job.compiler)
        options = CompileOptions.from_json(job.options)
        with job_folder("compile", job.id, work_root) as work:
            try:
                model_path = materialize_model(store, model, work)
            except BlobNotFound:
                raise CompileError(
                    "model_missing", f"the blob of model {model.id} is missing"
                ) from None
            except BlobCorrupt:
                raise CompileError(
                    "blob_corrupt",
                    f"the stored bytes of model {model.id} failed their integrity check and "
                    "were quarantined; upload the model again",
                ) from None
            except ServiceError as exc:
                raise CompileError(exc.code, exc.message) from None
            progress.note(f"compiling {model.name} ({model.size:,} bytes) on {job.worker}")
            # The farm's report always carries perf metrics and warnings: they are outputs of
            # the compile, not choices that change the QPC (and not part of the cache key).
            model_dir = model_path.parent if model.kind == KIND_ARCHIVE else None
            check_model_files(options, model_dir)
            # Every file the compile reads must be inside the model's own folder.
            folder = ModelFolder.at(model_dir) if model_dir else ModelFolder.bare()
            if compiler_spec.backend == QAIC:
                ref, outcome = _vendor_compile(
                    session, store, model_path, options, work, model_dir, progress,
                    compiler_spec.sdk, compiler.limits if compiler is not None else None,
                )  # fmt: skip
            else:
                farm_options = options.with_(
                    aic_binary_dir=str(work / "out"), aic_perf_warnings=True, aic_perf_metrics=True
                )
                farm_options = _profile_in(farm_options, work)
                early = EarlyDigest(work / "out" / QPC_FILE)
                progress.stage_observer = early.on_progress
                began = time.monotonic()
                result = _compile(model_path, farm_options, progress, compiler, work, folder)
                progress.note(f"{COMPILER_RAN} {time.monotonic() - began:.3f} s")
                progress.check()
                qpc_path = Path(result.qpc_path)
                ref = store.put_file(qpc_path, digest=early.result(qpc_path))  # linked in
                # Held until `succeed` commits the row naming it: retention cannot collect it now.
                blob_guard.lock_for_write(session, ref.sha256)
                if not store.exists(ref.sha256):  # collected between the put and the lock
                    ref = store.put_file(result.qpc_path)
                progress.note(f"stored QPC {ref.sha256} ({ref.size:,} bytes)")
                metrics = dict(result.metrics)
                if farm_options.dump_profile:
                    profile = store.put_file(Path(farm_options.dump_profile))
                    metrics[PROFILE_METRIC] = {"sha256": profile.sha256, "size": profile.size}
                    progress.note(f"stored quantization profile {profile.sha256}")
                conversion = metrics.get(CONVERSION_METRIC)
                converted = work / "out" / CONVERTED_FILE
                if isinstance(conversion, dict) and converted.is_file():
                    onnx_ref = store.put_file(converted)
                    metrics[CONVERSION_METRIC] = {
                        **conversion,
                        **_shapes_from(conversion, model),
                        "onnx": {"sha256": onnx_ref.sha256, "size": onnx_ref.size},
                    }
                    progress.note(
                        f"stored the ONNX {conversion.get('converter')} made: {onnx_ref.sha256}"
                    )
                outcome = CompileOutcome(
                    metrics=metrics,
                    warnings=result.warnings,
                    pass_times=result.pass_times,
                    requirements=_requirements(result.qpc_path),
                    log="\n".join(progress.lines) + "\n",
                )
        succeed(session, job, ref, outcome, compiler_version=compiler_spec.recorded)
    except _Stop as stop:
        session.rollback()
        if stop.cancelled:
            _finish_cancelled(session, job)
        else:
            log.warning("job %s was taken over by another worker; abandoning it", job.id)
            session.refresh(job)
    except CompileError as exc:
        session.rollback()
        _farm_advice(exc)
        fail(session, job, exc.code, exc.message, exc.to_dict(), stage=progress.stage)
    except DATABASE_FAULTS:
        # Not the job's fault: it stays running under this worker's name, unfinished; the
        # caller's retry or the reaper (once its heartbeat is stale) hands it out again.
        session.rollback()
        log.warning("job %s: the database did not answer; left to be run again", job_id)
        raise
    except Exception as exc:
        log.exception("job %s failed unexpectedly", job.id)
        session.rollback()
        fail(session, job, "internal_error", internal_error_message(exc), stage=progress.stage)
    return job


@dataclass(frozen=True)
class CompilerChoice:
    backend: str
    recorded: str
    """What the QPC row records as its compiler (`0.1.0` for qpcfarm, `qaic@1.18.2.0`)."""
    sdk: Path | None = None


def check_compiler(named: str | None) -> CompilerChoice:
    """The compiler a job runs with here: qpcfarm (none named, or this version named), or
    the vendor SDK of this host at the version named. Anything else is refused
    `compiler_unavailable` (routing sends a job only to workers that advertise its compiler;
    this guards a message that went astray)."""
    default = CompilerChoice(QPCFARM, COMPILER_VERSION)
    if not named:
        return default
    backend, version = parse_compiler(named)
    if backend == QPCFARM and version in (None, COMPILER_VERSION):
        return default
    have = local_compilers(get_settings())
    for c in have:
        if c.backend == QAIC == backend and version in (None, c.version):
            return CompilerChoice(QAIC, str(c), get_settings().qaic_sdk)
    raise CompileError(
        "compiler_unavailable",
        f"this worker has compiler(s) {', '.join(map(str, have))}, not {named}",
    )


def _vendor_compile(
    session: Session,
    store: BlobStore,
    model_path: Path,
    options: CompileOptions,
    work: Path,
    model_dir: Path | None,
    progress: _Progress,
    sdk: Path | None,
    limits: Limits | None,
) -> tuple[BlobRef, CompileOutcome]:
    """The job compiled by the vendor's qaic-compile (`worker.qaic_backend`), under the
    limits of the worker's own compiles (`compiler.limits`; None: in process, unlimited)."""
    from worker import qaic_backend

    assert sdk is not None
    progress("vendor-compile", 0.0)
    result = qaic_backend.run(
        sdk, model_path, options, work, cwd=model_dir or model_path.parent, poll=progress.poll,
        limits=limits,
    )  # fmt: skip
    progress.check()
    progress.note("ran: " + " ".join(result.command))
    ref = store.put_file(result.qpc_path)
    blob_guard.lock_for_write(session, ref.sha256)  # as for the farm's own QPCs
    if not store.exists(ref.sha256):
        ref = store.put_file(result.qpc_path)
    progress.note(f"stored QPC {ref.sha256} ({ref.size:,} bytes)")
    log = "\n".join(progress.lines) + "\n"
    log += f"--- qaic-compile stdout ---\n{result.stdout}\n"
    log += f"--- qaic-compile stderr ---\n{result.stderr}"
    try:
        requirements = _requirements(result.qpc_path)
    except Exception:  # a container qpcfarm cannot read: the vendor's own tools can
        requirements = {}
    outcome = CompileOutcome(
        metrics=result.metrics,
        warnings=result.warnings,
        pass_times={},
        requirements=requirements,
        log=log,
    )
    return ref, outcome


def _profile_in(options: CompileOptions, work: Path) -> CompileOptions:
    """`-dump-profile` writes into the job's folder (the farm stores the file as a blob); the
    name the user gave stays in the options that key the cache."""
    if not options.dump_profile:
        return options
    path = str(work / "profile.json")
    same = options.load_profile == options.dump_profile
    return options.with_(dump_profile=path, load_profile=path if same else None)


def _compile(
    model_path: Path,
    options: CompileOptions,
    progress: _Progress,
    compiler: Any,
    work: Path,
    folder: ModelFolder,
) -> Any:
    if compiler is not None:  # a process of its own, under the farm's limits
        tmp = work / "tmp"
        tmp.mkdir()
        return compiler.compile(
            model_path, options, progress, poll=progress.poll, tmp_dir=tmp, folder=folder
        )
    from compiler_core.compile import compile_model  # heavy: loaded on the first compile

    return compile_model(model_path, options, progress=progress, model_folder=folder)


def _requirements(qpc_path: Path) -> dict[str, Any]:
    """What the QPC needs from a device, and what it takes from its caller: each program's
    (specialization's) symbols and I/O names, types and shapes (the pages show them)."""
    from compiler_core.qpc.container import load_qpc

    with load_qpc(qpc_path) as qpc:
        network = qpc.network
        if network is None:
            return {}
        programs = [
            {
                "name": spec.name,
                "symbols": dict(spec.symbols),
                "inputs": [_io(io) for io in spec.inputs],
                "outputs": [_io(io) for io in spec.outputs],
            }
            for spec in network.programs()
        ]
        return {**network.requirements.to_dict(), "programs": programs}


def _io(io: Any) -> dict[str, Any]:
    return {"name": io.name, "dtype": io.dtype, "dims": list(io.dims)}
