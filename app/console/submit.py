"""`qpcfarm submit`: compile on a farm, as a drop-in for `qpcfarm compile`.

    qpcfarm submit -m=model.onnx -aic-binary-dir=out [qaic-compile flags] --server URL
                   [--api-key KEY] [--timeout S] [--compiler C]

The compile flags are parsed locally first (a bad flag fails before anything is uploaded, with
the same one-line error as the local compile); then the model is uploaded (a `.zip` of it and its
external data files when it has any), the job is submitted with the canonical flags, a progress
line follows it on stderr, and `out/programqpc.bin` is downloaded and checked against the
server's sha256. Warnings, metrics and pass times print with the local compile's renderers.

Only light standard modules are imported at module level: `qpcfarm compile` imports this
module through the command table and must not pay for httpx, onnx or zipfile.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, TextIO

from app.domain.stages import stage_words

if TYPE_CHECKING:
    import onnx

    from app.console.client import FarmClient
    from compiler_core.options import CompileOptions

PROG = "qpcfarm"
QPC_FILE_NAME = "programqpc.bin"
DEFAULT_SERVER = "http://127.0.0.1:8000"
DEFAULT_TIMEOUT_S = 3600.0
API_KEY_FILE = "api-key"
TERMINAL = frozenset({"succeeded", "failed", "cancelled"})
POLL_FIRST_S, POLL_MAX_S = 0.05, 0.5

USAGE = f"""\
usage: {PROG} submit -m=<model.onnx> -aic-binary-dir=<dir> [compile flags] [--server URL]
                      [--api-key KEY] [--timeout S] [--compiler C]

Compile on a qpcfarm server; writes <dir>/{QPC_FILE_NAME} like `{PROG} compile`.

  --server URL    the farm (default: $QPCFARM_SERVER, else {DEFAULT_SERVER})
  --api-key KEY   the team's API key (default: $QPCFARM_API_KEY, else the file
                  <$QPCFARM_DATA_DIR or ./qpcfarm-data>/{API_KEY_FILE})
  --timeout S     give up waiting for the job after S seconds (default {DEFAULT_TIMEOUT_S:g})
  --compiler C    compile with C, `backend` or `backend@version` (qpcfarm, qaic@1.18.2.0):
                  only a worker that has it runs the job (default: the farm's qpcfarm)

Compile flags are those of `{PROG} compile` ({PROG} compile -h lists them).
"""


class SubmitError(Exception):
    """A user-facing failure: one line on stderr, exit 1."""


@dataclass(frozen=True)
class SubmitArgs:
    flags: list[str]
    server: str
    api_key: str | None
    timeout: float
    compiler: str | None = None


# ------------------------------------------------------------------------------ arguments

_CLIENT_OPTIONS = ("--server", "--api-key", "--timeout", "--compiler")


def parse_args(argv: Sequence[str], env: dict[str, str] | None = None) -> SubmitArgs:
    """Split the client's `--options` from the single-dash compile flags."""
    env = dict(os.environ) if env is None else env
    given: dict[str, str] = {}
    flags: list[str] = []
    items = list(argv)
    i = 0
    while i < len(items):
        arg = items[i]
        name, has_value, value = arg.partition("=")
        if name in _CLIENT_OPTIONS:
            if not has_value:
                if i + 1 >= len(items):
                    raise SubmitError(f"{PROG} submit: {name} needs a value")
                i += 1
                value = items[i]
            given[name] = value
        elif arg.startswith("--") and arg not in ("--help", "--usage"):
            raise SubmitError(
                f"{PROG} submit: unknown option {arg} (client options: "
                f"{', '.join(_CLIENT_OPTIONS)}; compile flags take one dash)"
            )
        else:
            flags.append(arg)
        i += 1
    timeout = DEFAULT_TIMEOUT_S
    if "--timeout" in given:
        try:
            timeout = float(given["--timeout"])
        except ValueError:
            timeout = -1.0
        if not timeout > 0:
            raise SubmitError(
                f"{PROG} submit: --timeout must be a positive number of seconds, "
                f"not {given['--timeout']!r}"
            )
    server = given.get("--server") or env.get("QPCFARM_SERVER") or DEFAULT_SERVER
    if not server.startswith(("http://", "https://")):
        raise SubmitError(f"{PROG} submit: --server must be an http(s):// URL, not {server!r}")
    key = resolve_api_key(given.get("--api-key"), env)
    return SubmitArgs(flags, server, key, timeout, given.get("--compiler") or None)


def resolve_api_key(explicit: str | None, env: dict[str, str]) -> str | None:
    """--api-key, else $QPCFARM_API_KEY, else the embedded server's key file, else None."""
    if explicit:
        return explicit.strip()
    if env.get("QPCFARM_API_KEY"):
        return env["QPCFARM_API_KEY"].strip()
    key_file = Path(env.get("QPCFARM_DATA_DIR") or "./qpcfarm-data") / API_KEY_FILE
    try:
        text = key_file.read_text().strip()
    except OSError:
        return None
    return text or None


def check_options(options: CompileOptions) -> tuple[Path, Path]:
    """What a remote compile needs of the flags: the model file and the output directory,
    with the local compile's messages; refuse what the farm cannot do."""
    from compiler_core.cli import binary_dir, model_path
    from compiler_core.errors import CompileError

    if options.operators_supported is not None:
        raise CompileError(
            "invalid_option",
            f"-operators-supported is not a compile: run {PROG} compile -operators-supported=onnx",
            flag="-operators-supported",
        )
    return model_path(options), binary_dir(options)


def option_files(options: CompileOptions) -> dict[str, tuple[str, Path]]:
    """The local files that file-valued options name (the compiler's `MODEL_FILE_OPTIONS`):
    option -> (name in the upload, path). Submit uploads each in the model's archive, beside
    the model, as `<flag name><suffix>` (the farm reads it there:
    app/domain/services/model_files.py)."""
    from compiler_core.errors import CompileError
    from compiler_core.options import MODEL_FILE_OPTIONS

    files = {}
    for spec in MODEL_FILE_OPTIONS:
        value = getattr(options, spec.attr)
        if value is None:
            continue
        path = Path(value)
        if not path.is_file():
            raise CompileError(
                "invalid_option", f"{spec.flag}={value}: no such file", flag=spec.flag
            )
        files[spec.attr] = (spec.name + path.suffix, path)
    return files


def remote_flags(
    options: CompileOptions, files: dict[str, tuple[str, Path]] | None = None
) -> list[str]:
    """The canonical flags the server gets: no local-only option (the model and the output
    directory stay here); file options name their file's place in the upload."""
    from compiler_core.options import LOCAL_ONLY_OPTIONS

    local = {spec.attr: None for spec in LOCAL_ONLY_OPTIONS}
    uploaded = {attr: name for attr, (name, _) in (files or {}).items()}
    return options.with_(**local, **uploaded).to_flags()


# ---------------------------------------------------------------------------- the model

_LOCATION_KEY = b"\x0a\x08location"
"""How a `location` external-data entry starts on the wire (field 1, 8 bytes, "location")."""


def external_data_files(model: Path) -> list[str]:
    """The external data files a model refers to (relative paths, sorted); [] for none.

    A cheap byte search first: a model without the wire bytes of a `location` key has no
    external data and is never parsed (a multi-GB single-file model costs one scan)."""
    import mmap

    if model.stat().st_size == 0:
        return []
    with open(model, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m.find(_LOCATION_KEY) < 0:
            return []
    import onnx

    try:
        proto = onnx.load(str(model), load_external_data=False)
    except Exception:  # noqa: BLE001 - not ONNX: let the server say so, as the importer would
        return []
    locations = {
        entry.value
        for tensor in _all_tensors(proto)
        if tensor.data_location == onnx.TensorProto.EXTERNAL
        for entry in tensor.external_data
        if entry.key == "location"
    }
    return sorted(locations)


def _all_tensors(proto: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    graphs = [proto.graph]
    node_lists = [list(f.node) for f in proto.functions]
    while graphs or node_lists:
        if graphs:
            graph = graphs.pop()
            yield from graph.initializer
            for sparse in graph.sparse_initializer:
                yield sparse.values
                yield sparse.indices
            node_lists.append(list(graph.node))
            continue
        for node in node_lists.pop():
            for attr in node.attribute:
                if attr.HasField("t"):
                    yield attr.t
                yield from attr.tensors
                if attr.HasField("sparse_tensor"):
                    yield attr.sparse_tensor.values
                    yield attr.sparse_tensor.indices
                if attr.HasField("g"):
                    graphs.append(attr.g)
                graphs.extend(attr.graphs)


def _data_file(model: Path, location: str) -> Path:
    from compiler_core.errors import CompileError

    relative = PurePosixPath(location.replace("\\", "/"))
    if relative.is_absolute() or ".." in relative.parts or not relative.parts:
        raise CompileError(
            "invalid_external_data",
            f"external data location {location!r} of {model.name} is not a path inside the "
            "model's folder",
        )
    path = model.parent.joinpath(*relative.parts)
    if not path.is_file():
        raise CompileError(
            "external_data_not_found",
            f"external data file {location} of {model.name} not found (looked in {path})",
        )
    return path


@contextmanager
def upload_source(
    model: Path, extra: Sequence[tuple[str, Path]] = ()
) -> Iterator[tuple[Path, str]]:
    """(file to upload, its name): the model itself, or a temporary `.zip` of the model, its
    external data files at their relative locations and the `extra` (name, file) pairs
    (stored, not compressed: weights do not compress and the zip is only a container)."""
    import tempfile
    import zipfile

    from compiler_core.convert import recognise
    from compiler_core.errors import CompileError

    framework = recognise(model)
    if framework is not None and framework.format is not None:  # converted by the farm
        if extra:
            raise CompileError(
                "invalid_option",
                f"{extra[0][1]}: option files travel with an ONNX model's archive only",
            )
        if not model.is_dir():
            yield model, model.name
            return
        fd, name = tempfile.mkstemp(prefix="qpcfarm-upload-", suffix=".zip")
        os.close(fd)
        try:  # a SavedModel directory travels as a .zip of it
            with zipfile.ZipFile(name, "w", compression=zipfile.ZIP_STORED) as zf:
                for path in sorted(model.rglob("*")):
                    if path.is_file():
                        zf.write(path, (model.name / path.relative_to(model)).as_posix())
            yield Path(name), f"{model.name}.zip"
        finally:
            Path(name).unlink(missing_ok=True)
        return
    locations = external_data_files(model)
    if not locations and not extra:
        yield model, model.name
        return
    files = [(loc, _data_file(model, loc)) for loc in locations]
    taken = {PurePosixPath(loc.replace("\\", "/")).as_posix() for loc in locations}
    for name, path in extra:
        if name in taken or name == model.name:
            raise CompileError(
                "invalid_option", f"{path}: the upload already has a file named {name}"
            )
        files.append((name, path))
    fd, name = tempfile.mkstemp(prefix="qpcfarm-upload-", suffix=".zip")
    os.close(fd)
    archive = Path(name)
    try:
        with zipfile.ZipFile(archive, "w", compression=zipfile.ZIP_STORED) as zf:
            zf.write(model, model.name)
            for location, path in files:
                zf.write(path, PurePosixPath(location.replace("\\", "/")).as_posix())
        yield archive, f"{model.stem}.zip"
    finally:
        archive.unlink(missing_ok=True)


# ----------------------------------------------------------------------------- progress


class ProgressDisplay:
    """The job's status on stderr: a redrawn bar on a terminal, one line per change else."""

    WIDTH = 30

    def __init__(self, stream: TextIO, job_id: str) -> None:
        self.stream = stream
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.job = job_id[:8]
        self._last: tuple[str, str, int] | None = None
        self._drawn = False

    def update(self, job: dict[str, Any]) -> None:
        status = str(job.get("status") or "")
        stage = stage_words(str(job.get("stage") or ""))
        percent = int(round(100.0 * float(job.get("progress") or 0.0)))
        state = (status, stage, percent)
        if state == self._last:
            return
        previous, self._last = self._last, state
        if self.tty:
            filled = self.WIDTH * percent // 100
            bar = "#" * filled + "-" * (self.WIDTH - filled)
            label = stage if status == "running" and stage else status
            self.stream.write(f"\r{PROG}: job {self.job} [{bar}] {percent:3d}% {label:<31}")
            self._drawn = True
        elif previous is None or previous[:2] != state[:2]:
            where = f" {stage} {percent}%" if status == "running" and stage else ""
            self.stream.write(f"{PROG}: job {self.job} {status}{where}\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False


def wait_for_job(
    client: FarmClient,
    job: dict[str, Any],
    timeout: float,
    display: ProgressDisplay,
    *,
    clock: Any = time.monotonic,
    sleep: Any = time.sleep,
) -> dict[str, Any]:
    """Poll the job until it ends (or `timeout` passes), showing its progress."""
    deadline = clock() + timeout
    interval = POLL_FIRST_S
    try:
        display.update(job)
        while job.get("status") not in TERMINAL:
            if clock() >= deadline:
                raise SubmitError(
                    f"job {job['id']} did not finish within {timeout:g} s (it keeps running on "
                    "the server; GET /v1/compile-jobs/<id> follows it)"
                )
            sleep(interval)
            interval = min(interval * 1.5, POLL_MAX_S)
            job = client.get_job(str(job["id"]))
            display.update(job)
    finally:
        display.close()
    return job


def cache_hit_line(job: dict[str, Any]) -> str:
    """Said when the farm compiled nothing: the QPC is an earlier identical compile's."""
    return (
        f"{PROG}: job {str(job.get('id'))[:8]}: cache hit: the farm had compiled this model "
        "with these flags and this compiler version before; that QPC is reused (nothing was "
        "compiled)"
    )


def job_failure(job: dict[str, Any]) -> str:
    """One line saying why a job did not succeed."""
    error = job.get("error")
    if isinstance(error, dict):
        message = str(error.get("message") or error.get("code") or "unknown error")
    elif error:
        message = str(error)
    else:
        message = str(job.get("error_message") or "no error given")
    if job.get("status") == "cancelled":
        return f"job {job.get('id')} was cancelled"
    return message


# -------------------------------------------------------------------------------- command


def submit_command(argv: list[str]) -> int:
    """The `submit` entry of `app.console.cli.SERVICE_COMMANDS`: 0 on success, 1 on any failure."""
    from compiler_core.errors import CompileError

    if any(a in ("-h", "-help", "--help", "-usage", "--usage") for a in argv):
        sys.stdout.write(USAGE)
        return 0
    try:
        return _submit(parse_args(argv))
    except (SubmitError, CompileError) as exc:
        message = exc.message if isinstance(exc, CompileError) else str(exc)
        print(f"{PROG}: error: {' '.join(message.split())}", file=sys.stderr)
        return 1


def shown_locally(warning: dict[str, Any], options: CompileOptions) -> bool:
    """Whether `qpcfarm compile` with these flags would print this warning of the farm's
    report: the farm always runs the perf analysis (its report is for everyone), a local
    compile only with -aic-perf-warnings; deprecated flags were printed before the upload."""
    from compiler_core.report import KIND_PERF, warning_kind

    if warning.get("message") in options.warnings:
        return False
    return options.aic_perf_warnings or warning_kind(warning) != KIND_PERF


def _submit(args: SubmitArgs) -> int:
    from compiler_core.options import CompileOptions
    from compiler_core.report import render_metrics, render_pass_times, render_warning

    options = CompileOptions.from_flags(args.flags)
    model, out_dir = check_options(options)
    files = option_files(options)
    flags = remote_flags(options, files)
    for message in options.warnings:
        print(f"warning: {message}", file=sys.stderr)

    from app.console.client import FarmClient

    with (
        FarmClient(args.server, args.api_key) as client,
        upload_source(model, list(files.values())) as (path, name),
    ):
        uploaded = client.upload_model(path, name, input_shapes=options.input_shapes)
        job = client.submit_job(str(uploaded["id"]), flags, compiler=args.compiler)
        job = wait_for_job(client, job, args.timeout, ProgressDisplay(sys.stderr, str(job["id"])))
        if job.get("cache_hit"):
            print(cache_hit_line(job), file=sys.stderr)
        if job.get("status") != "succeeded":
            raise SubmitError(job_failure(job))
        if not job.get("qpc_id"):
            raise SubmitError(f"job {job['id']} succeeded without a QPC (a server bug)")
        qpc_path = out_dir / QPC_FILE_NAME
        client.download_qpc(str(job["qpc_id"]), qpc_path)
    if options.mdp_dump_partition_config:  # local-only: written here, from the QPC
        from compiler_core.mdp.build import dump_from_qpc

        dump_from_qpc(qpc_path, options.mdp_dump_partition_config)

    for warning in job.get("warnings") or []:
        if isinstance(warning, dict) and shown_locally(warning, options):
            print(render_warning(warning), file=sys.stderr)
    if options.aic_perf_metrics:
        sys.stdout.write(render_metrics(job.get("metrics") or {}))
    if options.time_passes:
        sys.stdout.write(render_pass_times(job.get("pass_times") or {}))
    print(qpc_path)
    return 0
