"""The vendor SDK as a compile backend: the farm's `qaic` compiler runs the SDK's own
`qaic-compile` (`<QPCFARM_QAIC_SDK>/exec/qaic-compile`) on a job's model with the job's
flags, and its report is what the tool printed.

The command line follows the vendor's documented CLI: single-dash flags, `-m=<model>`,
`-aic-hw`, `-aic-binary-dir=<dir>` (the QPC is `<dir>/programqpc.bin`), the job's options as
`compiler_core.options.vendor_flags` spells them, plus `-aic-perf-metrics` and
`-aic-perf-warnings` (the farm's report always holds them, as with its own compiler). Exit
status 0 and `programqpc.bin` written: success; anything else fails the job
`vendor_compile_failed` with the exit status and the end of stderr. The run's stdout and
stderr are kept as the report's log; lines of the form `Name: number` (or `Name = number`)
become metrics (snake_case names, `"estimated": false`, `"source": "qaic-compile"`) and
lines that start with `Warning`/`WARNING`/`[W]` become warnings (`code: vendor_warning`).

It runs under the farm's compile limits, as the farm's own compiler does
(`app.domain.services.limits`, `worker.compile_process`): its address space is capped
(`RLIMIT_AS`, set before the tool starts: `limited_command`), and a run that fails saying it
ran out of memory fails `compile_memory_limit`; the worker kills a run that passes the time
limit and the job fails `compile_time_limit`.

Written against the documented CLI and tested with a stand-in executable; it has not been
run against the real SDK here (docs/service.md).
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.domain.compilers import QAIC_COMPILE
from app.domain.services.limits import Limits, limited_command
from compiler_core import CompileError, CompileOptions
from compiler_core.options import vendor_flags
from worker.compile_process import memory_limit_error, time_limit_error

QPC_FILE = "programqpc.bin"
POLL_S = 0.2
KILL_WAIT_S = 2.0
STDERR_TAIL = 2000
MAX_LOG_CHARS = 4 << 20
"""A report's log keeps at most this much of each stream (the head: errors come first)."""
FAILED = "vendor_compile_failed"
NO_QPC = "vendor_no_qpc"
WARNING_CODE = "vendor_warning"
_METRIC = re.compile(r"^\s*([A-Za-z][A-Za-z0-9 ()/%_.-]{1,80}?)\s*[:=]\s*(-?\d+(?:\.\d+)?)\s*"
                     r"(bytes|B|KB|MB|us|ms|s|%)?\s*$")  # fmt: skip
_WARNING = re.compile(r"^\s*(?:\[W\]|warning\b|WARNING\b)[:\s-]*(.*)$", re.IGNORECASE)
_OUT_OF_MEMORY = re.compile(
    r"std::bad_alloc|out of memory|cannot allocate memory|MemoryError|ENOMEM", re.IGNORECASE
)
"""What a program says when an allocation failed (C++, C/errno, Python)."""


@dataclass
class VendorResult:
    qpc_path: Path
    command: list[str]
    stdout: str
    stderr: str
    metrics: dict[str, Any] = field(default_factory=dict)
    warnings: list[dict[str, Any]] = field(default_factory=list)


def command(sdk: Path, model: Path, options: CompileOptions, out_dir: Path) -> list[str]:
    """The vendor command line of a job (refuses qpcfarm-only options: CompileError)."""
    flags = vendor_flags(options)
    extra = [f for f in ("-aic-hw", "-aic-perf-metrics", "-aic-perf-warnings")
             if not any(x == f or x.startswith(f + "=") for x in flags)]  # fmt: skip
    return [str(sdk / QAIC_COMPILE), f"-m={model}", *flags, *extra, f"-aic-binary-dir={out_dir}"]


def snake(name: str) -> str:
    return re.sub(r"[^0-9a-z]+", "_", name.strip().lower()).strip("_")


def parse_output(text: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(metrics, warnings) of what qaic-compile printed (see the module docstring)."""
    metrics: dict[str, Any] = {}
    warnings: list[dict[str, Any]] = []
    for line in text.splitlines():
        warned = _WARNING.match(line)
        if warned:
            message = warned.group(1).strip() or line.strip()
            warnings.append(
                {"code": WARNING_CODE, "message": message, "nodes": [], "suggestion": "",
                 "kind": "vendor"}
            )  # fmt: skip
            continue
        found = _METRIC.match(line)
        if found:
            value = float(found.group(2))
            metrics[snake(found.group(1))] = int(value) if value.is_integer() else value
    if metrics:
        metrics = {"estimated": False, "source": "qaic-compile", **metrics}
    return metrics, warnings


def run(
    sdk: Path,
    model: Path,
    options: CompileOptions,
    work: Path,
    *,
    cwd: Path,
    poll: Callable[[], None] | None = None,
    limits: Limits | None = None,
) -> VendorResult:
    """Run qaic-compile for one job in `work` (its output folder `work/qpc`), from `cwd` (the
    model's folder: the files the options name are relative to it), under `limits` (the
    farm's compile limits; None: none). `poll` is called while it runs and may raise to stop
    it (a cancel): the process is then terminated, killed after `KILL_WAIT_S`, and the
    exception propagates; so it is at the time limit, with CompileError
    `compile_time_limit`."""
    limits = limits or Limits()
    out_dir = work / "qpc"
    argv = command(sdk, model, options, out_dir)
    stdout_path, stderr_path = work / "qaic-compile.stdout", work / "qaic-compile.stderr"
    with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
        try:
            process = subprocess.Popen(
                limited_command(argv, limits.memory_bytes), cwd=cwd, stdout=out, stderr=err,
                stdin=subprocess.DEVNULL, env={**os.environ, "LC_ALL": "C"},
            )  # fmt: skip
        except OSError as exc:
            raise CompileError(FAILED, f"could not start {argv[0]}: {exc.strerror}") from None
        deadline = None if limits.time_s is None else time.monotonic() + limits.time_s
        try:
            while process.poll() is None:
                if poll is not None:
                    poll()
                if deadline is not None and time.monotonic() > deadline:
                    raise time_limit_error(limits)
                time.sleep(POLL_S)
        except BaseException:
            _stop(process)
            raise
    stdout, stderr = _read(stdout_path), _read(stderr_path)
    if process.returncode != 0:
        tail = stderr[-STDERR_TAIL:].strip() or stdout[-STDERR_TAIL:].strip()
        if limits.memory_bytes is not None and _OUT_OF_MEMORY.search(tail):
            raise memory_limit_error(limits)
        raise CompileError(
            FAILED,
            f"qaic-compile exited with status {process.returncode}: {tail or '(no output)'}",
            details={"exit_code": process.returncode, "command": argv},
        )
    qpc = out_dir / QPC_FILE
    if not qpc.is_file():
        raise CompileError(NO_QPC, f"qaic-compile exited 0 but wrote no {QPC_FILE} in {out_dir}")
    metrics, warnings = parse_output(stdout + "\n" + stderr)
    return VendorResult(qpc, argv, stdout, stderr, metrics, warnings)


def _read(path: Path) -> str:
    with open(path, "rb") as f:
        return f.read(MAX_LOG_CHARS).decode("utf-8", errors="replace")


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(KILL_WAIT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


# ------------------------------------------------------------------------------ profiles

NO_DEVICE = "no_device"
RUN_FAILED = "vendor_run_failed"
RUN_TIMEOUT_S = 3600.0


def devices(pattern: str) -> list[Path]:
    """The host's cards: the device nodes `pattern` (a glob) matches, in order."""
    import glob

    return [Path(p) for p in sorted(glob.glob(pattern))]


def profile(
    sdk: Path, qpc_path: Path, work: Path, *, iterations: int, device_pattern: str
) -> dict[str, Any]:
    """Run a vendor QPC on the host's first card with profiling and post-process the raw
    statistics: `qaic-runner -t <qpc folder> -d <card> -n <iterations> --aic-profiling-type
    stats --aic-profiling-type trace --aic-profiling-out-dir <raw>`, then `qaic-opstats --qpc
    <programqpc.bin> --input-dir <raw> --output-dir <out> --summary --trace`. Returns the
    profile row's values: `summary` (`{"estimated": false, "source", "runner", "files"}`, the
    runner's `Name: number` lines as figures), `summary_text` (the text files opstats wrote,
    else its stdout), `summary_csv` (its first CSV) and `trace` (the bytes of its first
    `.json`, or None). No card: CompileError `no_device`; a tool failing: `vendor_run_failed`.
    """
    from app.domain.compilers import QAIC_OPSTATS, QAIC_RUNNER

    cards = devices(device_pattern)
    if not cards:
        raise CompileError(
            NO_DEVICE,
            f"this QPC was made by the vendor's compiler and runs only on a card; this "
            f"worker has none ({device_pattern} matches nothing)",
        )
    index = re.sub(r"\D", "", cards[0].name) or "0"
    raw, out = work / "raw", work / "opstats"
    runner = _tool(sdk / QAIC_RUNNER, [
        "-t", str(qpc_path.parent), "-d", index, "-n", str(iterations),
        "--aic-profiling-type", "stats", "--aic-profiling-type", "trace",
        "--aic-profiling-out-dir", str(raw),
    ])  # fmt: skip
    opstats = _tool(sdk / QAIC_OPSTATS, [
        "--qpc", str(qpc_path), "--input-dir", str(raw), "--output-dir", str(out),
        "--summary", "--trace",
    ])  # fmt: skip
    files = sorted(p for p in out.rglob("*") if p.is_file()) if out.is_dir() else []
    texts = [p.read_text(errors="replace") for p in files if p.suffix == ".txt"]
    csvs = [p.read_text(errors="replace") for p in files if p.suffix == ".csv"]
    traces = [p.read_bytes() for p in files if p.suffix == ".json"]
    figures, _ = parse_output(runner)
    return {
        "summary": {
            "estimated": False,
            "source": "qaic-runner + qaic-opstats",
            "device": str(cards[0]),
            "iterations": iterations,
            "runner": figures,
            "files": [str(p.relative_to(out)) for p in files],
        },
        "summary_text": "\n".join(texts) or opstats,
        "summary_csv": csvs[0] if csvs else None,
        "trace": traces[0] if traces else None,
    }


def _tool(exe: Path, args: list[str]) -> str:
    if not exe.is_file():
        raise CompileError(RUN_FAILED, f"the SDK has no {exe}")
    try:
        done = subprocess.run(
            [str(exe), *args], capture_output=True, timeout=RUN_TIMEOUT_S,
            stdin=subprocess.DEVNULL, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        raise CompileError(
            RUN_FAILED, f"{exe.name} did not finish in {RUN_TIMEOUT_S:g} s"
        ) from None
    output = (done.stdout + done.stderr).decode("utf-8", errors="replace")
    if done.returncode != 0:
        raise CompileError(
            RUN_FAILED,
            f"{exe.name} exited with status {done.returncode}: {output.strip()[-STDERR_TAIL:]}",
            details={"exit_code": done.returncode},
        )
    return output
