"""Compile speed and memory of `qpcfarm compile`, as ratios against peers measured in this run.

Peers (DESIGN.md, Targets): ONNX Runtime's offline optimisation (a session with ORT_ENABLE_ALL
and `optimized_model_filepath`) and a plain `onnx.load` + `onnx.save`. Every whole-process
figure is a fresh child process; its wall time is measured from fork to reap and its peak RSS is
the kernel's exact `ru_maxrss` from `os.wait4` (`LAUNCHER_CODE` says why a launcher forks it).
A second, polled figure (RssAnon from /proc every few ms) shows the anonymous part, since
`ru_maxrss` also counts pages of memory-mapped weight files. Runs are interleaved (round robin
over the repeats), so a busy machine slows every row alike, and the median is reported.

    python bench/compile.py [--quick] [--repeat 3] [--cores 4] [--json out.json]
    python bench/compile.py --light-resnet50 --cores 14 --skip-big

`--light-resnet50` measures onnx's backend-test light_resnet50 (separate BatchNormalization
nodes; its ConstantOfShape weights replaced by seeded random ones) instead of our ResNet-50.
Every figure is given in wall and in CPU time; the compile-time targets are judged in CPU time
(issue 25: "measured ... in CPU time beside the peer"), the wall rows are information. Our
packages are byte-compiled first, as installing the wheel does (`byte_compile_packages`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from models import (  # noqa: E402  (the generators live beside this script)
    MLP_BIG,
    MLP_QUICK,
    RESNET50,
    RESNET_QUICK,
    model_size,
    write_mlp,
    write_resnet,
)

MIB = 1 << 20
POLL_SECONDS = 0.005
PROCESS_TARGET = 1.3
"""The whole `qpcfarm compile` process against ONNX Runtime's whole process (issue 25)."""

BASELINE_CODE = "import compiler_core.compile, compiler_core.cli"
ORT_CODE = """
import sys
import onnxruntime as ort
ort.set_default_logger_severity(3)
so = ort.SessionOptions()
so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
so.optimized_model_filepath = sys.argv[2]
ort.InferenceSession(sys.argv[1], so, providers=["CPUExecutionProvider"])
"""
LOAD_SAVE_CODE = """
import sys
import onnx
onnx.save(onnx.load(sys.argv[1]), sys.argv[2])
"""


# --- the light ResNet-50 -----------------------------------------------------------------------

LIGHT_RESNET50 = "light_resnet50"
LIGHT_SEED = 0


def write_light_resnet50(work: Path, regenerate: bool = False) -> Path:
    """onnx's backend-test `light_resnet50` (opset 9, Caffe2 export: 53 Conv + 53 separate
    BatchNormalization nodes) with real weights: the test model builds every weight with
    ConstantOfShape (all channels alike); here each becomes a seeded random initializer
    (He-scaled conv/FC weights, BN variances in [0.5, 1.5]), and initializers are no longer
    listed as graph inputs, so ONNX Runtime may fold them as our compiler does."""
    out = work / f"{LIGHT_RESNET50}-random-s{LIGHT_SEED}.onnx"
    if out.exists() and not regenerate:
        return out
    import numpy as np
    import onnx
    from onnx import numpy_helper

    source = Path(onnx.__file__).parent / "backend/test/data/light" / f"{LIGHT_RESNET50}.onnx"
    if not source.exists():
        raise SystemExit(f"{source} not found: the installed onnx wheel has no light models")
    model = onnx.load(source)
    graph = model.graph
    rng = np.random.default_rng(LIGHT_SEED)
    shapes = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    made: list[onnx.TensorProto] = []
    kept_nodes = []
    for n in graph.node:
        if n.op_type == "ConstantOfShape" and n.input[0] in shapes:
            dims = tuple(int(d) for d in shapes[n.input[0]])
            made.append(numpy_helper.from_array(_light_weight(n.output[0], dims, rng), n.output[0]))
        else:
            kept_nodes.append(n)
    used = {x for n in kept_nodes for x in n.input}
    old = [
        numpy_helper.from_array(_light_weight(i.name, tuple(i.dims), rng), i.name)
        if i.data_type == onnx.TensorProto.FLOAT
        else i
        for i in graph.initializer
        if i.name in used
    ]
    del graph.node[:]
    graph.node.extend(kept_nodes)
    del graph.initializer[:]
    graph.initializer.extend([*old, *made])
    inputs = [i for i in graph.input if i.name not in shapes]  # the image only
    del graph.input[:]
    graph.input.extend(inputs)
    model.ir_version = max(model.ir_version, 4)
    onnx.checker.check_model(model)
    work.mkdir(parents=True, exist_ok=True)
    onnx.save(model, out)
    return out


def _light_weight(name: str, dims: tuple[int, ...], rng: Any) -> Any:
    """A random value for a light-model weight, by its Caffe2 name's suffix."""
    import numpy as np

    kind = name.rsplit("_", 2)[-2]
    if kind == "w":  # conv [out, in, kh, kw] or FC [out, in]
        fan_in = int(np.prod(dims[1:])) if len(dims) > 1 else 1
        value = rng.standard_normal(dims) * np.sqrt(2.0 / fan_in)
    elif kind == "riv":  # running variance
        value = rng.uniform(0.5, 1.5, dims)
    elif kind == "s":  # BN scale
        value = rng.uniform(0.5, 1.0, dims)
    else:  # biases and running means
        value = rng.standard_normal(dims) * 0.1
    return value.astype(np.float32)


# --- one child process ------------------------------------------------------------------------


@dataclass
class ProcessRun:
    wall_s: float
    cpu_s: float
    """User + system CPU time of the child (and its children): what a busy machine inflates
    least, since time spent waiting for a CPU is not counted."""
    peak_rss_mib: float
    """`ru_maxrss` of the child (exact, includes touched pages of mapped files)."""
    peak_anon_mib: float | None
    """Largest RssAnon seen while polling /proc; None if the child ended before a sample."""
    returncode: int
    error: str | None = None


LAUNCHER_CODE = """
import os, sys, time
start = time.perf_counter()
pid = os.fork()
if pid == 0:
    try:
        os.execv(sys.argv[2], sys.argv[2:])
    except OSError as exc:
        sys.stderr.write(f"cannot run {sys.argv[2]}: {exc}\\n")
    os._exit(127)
_, status, usage = os.wait4(pid, 0)
wall = time.perf_counter() - start
with open(sys.argv[1], "w") as f:
    f.write(f"{usage.ru_maxrss} {wall!r} {usage.ru_utime + usage.ru_stime!r}")
code = os.waitstatus_to_exitcode(status)
sys.exit(code if code >= 0 else 128 - code)
"""
"""Forks and reaps the measured process. Linux's exec records the old address space's high-water
RSS in the new program's ru_maxrss, so a child spawned straight from this (large) benchmark
process would report at least the benchmark's own peak. Spawned from this `python -S` launcher
(~8 MiB), it reports its own peak."""


def run_process(argv: Sequence[str], timeout_s: float) -> ProcessRun:
    """Run `argv` to completion through the launcher; time it and take its exact peak RSS."""
    program = shutil.which(argv[0]) or argv[0]
    with (
        tempfile.TemporaryFile() as out,
        tempfile.TemporaryFile() as err,
        tempfile.NamedTemporaryFile("r", suffix=".rusage") as result,
    ):
        launcher = [sys.executable, "-S", "-c", LAUNCHER_CODE, result.name, program, *argv[1:]]
        start = time.perf_counter()
        proc = subprocess.Popen(launcher, stdout=out, stderr=err, stdin=subprocess.DEVNULL)
        done = threading.Event()
        peak_anon: list[int] = []
        poller = threading.Thread(
            target=_poll_anon, args=(proc.pid, done, peak_anon, start + timeout_s), daemon=True
        )
        poller.start()
        returncode = proc.wait()
        done.set()
        poller.join()
        fields = result.read().split()
        err.seek(0)
        last_line = _last_line(err.read().decode(errors="replace")) or "(no output)"
    if len(fields) != 3:
        raise RuntimeError(f"the launcher failed (exit {returncode}): {last_line}")
    error = None
    if returncode != 0:
        error = last_line
        if returncode == 128 + signal.SIGKILL:
            error = f"killed (timeout {timeout_s:.0f} s or out of memory): {error}"
    return ProcessRun(
        wall_s=float(fields[1]),
        cpu_s=float(fields[2]),
        peak_rss_mib=int(fields[0]) * 1024 / MIB,  # Linux reports KiB
        peak_anon_mib=peak_anon[0] / MIB if peak_anon else None,
        returncode=returncode,
        error=error,
    )


def _poll_anon(launcher: int, done: threading.Event, peak: list[int], deadline: float) -> None:
    """Track the measured process's RssAnon; kill it (only it) past the deadline."""
    children = Path(f"/proc/{launcher}/task/{launcher}/children")
    pid = None
    while not done.wait(POLL_SECONDS):
        try:
            if pid is None:
                found = children.read_text().split()
                if not found:
                    continue
                pid = int(found[0])
            if time.perf_counter() > deadline:
                os.kill(pid, signal.SIGKILL)  # the process we started, by its id
                return
            text = Path(f"/proc/{pid}/status").read_text()
        except (OSError, ValueError):
            return
        for line in text.splitlines():
            if line.startswith("RssAnon:"):
                value = int(line.split()[1]) * 1024
                if not peak or value > peak[0]:
                    peak[:] = [value]


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


# --- repeated measurements --------------------------------------------------------------------


@dataclass
class Measurement:
    label: str
    argv: list[str]
    runs: list[ProcessRun] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.runs) and all(r.returncode == 0 for r in self.runs)

    @property
    def error(self) -> str | None:
        return next((r.error for r in self.runs if r.error), None)

    @property
    def wall_s(self) -> float:
        return statistics.median(r.wall_s for r in self.runs)

    @property
    def cpu_s(self) -> float:
        return statistics.median(r.cpu_s for r in self.runs)

    @property
    def peak_rss_mib(self) -> float:
        return statistics.median(r.peak_rss_mib for r in self.runs)

    @property
    def peak_anon_mib(self) -> float | None:
        values = [r.peak_anon_mib for r in self.runs if r.peak_anon_mib is not None]
        return statistics.median(values) if values else None

    def summary(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "argv": self.argv,
            "ok": self.ok,
            "error": self.error,
            "wall_s_median": self.wall_s if self.runs else None,
            "cpu_s_median": self.cpu_s if self.runs else None,
            "peak_rss_mib_median": self.peak_rss_mib if self.runs else None,
            "peak_anon_mib_median": self.peak_anon_mib if self.runs else None,
            "runs": [asdict(r) for r in self.runs],
        }


def measure_round_robin(measurements: Sequence[Measurement], repeat: int, timeout_s: float) -> None:
    """Run every measurement once per round; a failed one is not retried."""
    for round_no in range(repeat):
        for m in measurements:
            if m.runs and not m.ok:
                continue
            run = run_process(m.argv, timeout_s)
            m.runs.append(run)
            state = "ok" if run.returncode == 0 else f"FAILED: {run.error}"
            print(
                f"  [{round_no + 1}/{repeat}] {m.label:<40} {run.wall_s:7.2f} s "
                f"(CPU {run.cpu_s:6.2f} s) "
                f"{run.peak_rss_mib:8.1f} MiB  {state}",
                file=sys.stderr,
                flush=True,
            )


PACKAGES = ("compiler_core", "app")
"""What `qpcfarm compile` imports of ours."""


def byte_compile_packages() -> list[Path]:
    """Write the .pyc files of our packages, as installing the wheel does (pip byte-compiles).
    A source checkout run with PYTHONDONTWRITEBYTECODE=1 has none, and then every measured
    process compiles every module from source (0.4-0.5 s of CPU here), which no installed
    qpcfarm does; ONNX Runtime's were written at its install."""
    import compileall
    import importlib.util

    folders = []
    for name in PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            continue
        folder = Path(next(iter(spec.submodule_search_locations)))
        if not compileall.compile_dir(folder, quiet=1):
            raise SystemExit(f"byte-compiling {folder} failed")
        folders.append(folder)
    return folders


def compile_argv(model: Path, out_dir: Path, cores: int) -> list[str]:
    flags = [f"-m={model}", f"-aic-binary-dir={out_dir}", f"-aic-num-cores={cores}"]
    script = Path(sys.executable).with_name("qpcfarm")
    if script.exists():
        return [str(script), "compile", *flags]
    found = shutil.which("qpcfarm")
    if found:
        return [found, "compile", *flags]
    return [sys.executable, "-m", "compiler_core.cli", "compile", *flags]


def python_argv(code: str, *args: Path) -> list[str]:
    return [sys.executable, "-c", code, *(str(a) for a in args)]


# --- in-process, warm -------------------------------------------------------------------------


def warm_in_process(model: Path, out_dir: Path, cores: int, repeat: int) -> dict[str, Any]:
    """Median of `repeat` compiles and ORT offline optimisations in this process, after one
    warm-up each (imports, lazy initialisation and the page cache are then paid for)."""
    import onnxruntime as ort

    from compiler_core.compile import compile_model

    flags = [f"-aic-num-cores={cores}", f"-aic-binary-dir={out_dir / 'qpc-warm'}"]

    def compile_once() -> dict[str, float]:
        return compile_model(str(model), flags).pass_times

    def ort_once() -> None:
        ort.set_default_logger_severity(3)  # not the NCHWc "hardware specific" notice
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.optimized_model_filepath = str(out_dir / "ort-warm.onnx")
        ort.InferenceSession(str(model), so, providers=["CPUExecutionProvider"])

    compile_once()
    ort_once()
    compile_s: list[float] = []
    ort_s: list[float] = []
    compile_cpu_s: list[float] = []
    ort_cpu_s: list[float] = []
    split: dict[str, list[float]] = {k: [] for k in SPLIT_KEYS}
    pass_times: dict[str, float] = {}
    for _ in range(repeat):
        wall, cpu, usage = time.perf_counter(), time.process_time(), _usage()
        pass_times = compile_once()
        compile_s.append(time.perf_counter() - wall)
        compile_cpu_s.append(time.process_time() - cpu)
        _add_split(split, "compile", usage)
        usage = _usage()
        wall, cpu = _timed(ort_once)
        _add_split(split, "ort", usage)
        ort_s.append(wall)
        ort_cpu_s.append(cpu)
    with open(out_dir / "qpc-warm" / "programqpc.bin", "rb") as qpc:
        digest = hashlib.file_digest(qpc, "sha256").hexdigest()
    return {
        "cores": cores,
        "qpc_sha256": digest,
        "compile_s": compile_s,
        "ort_s": ort_s,
        "compile_cpu_s": compile_cpu_s,
        "ort_cpu_s": ort_cpu_s,
        "compile_s_median": statistics.median(compile_s),
        "ort_s_median": statistics.median(ort_s),
        "compile_cpu_s_median": statistics.median(compile_cpu_s),
        "ort_cpu_s_median": statistics.median(ort_cpu_s),
        "pass_times": pass_times,
        **split,
        **{f"{key}_median": statistics.median(values) for key, values in split.items()},
    }


SPLIT_KEYS = ("compile_user_s", "compile_sys_s", "ort_user_s", "ort_sys_s")
"""The in-process CPU time split into user and system (kernel) time: writing a 100 MB file is
mostly system time (copying into the page cache), which both sides pay alike; the user time is
the work each does itself."""


def _usage() -> tuple[float, float]:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime, ru.ru_stime


def _add_split(split: dict[str, list[float]], side: str, before: tuple[float, float]) -> None:
    user, system = _usage()
    split[f"{side}_user_s"].append(user - before[0])
    split[f"{side}_sys_s"].append(system - before[1])


def _timed(fn: Callable[[], object]) -> tuple[float, float]:
    """Wall and process CPU time (all threads) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


# --- report -----------------------------------------------------------------------------------


@dataclass
class Ratio:
    name: str
    value: float | None
    target: float | None
    note: str = ""

    @property
    def verdict(self) -> str:
        if self.value is None:
            return "NOT MET" if self.target is not None else "n/a"
        if self.target is None:
            return "info"
        return "met" if self.value <= self.target else "NOT MET"

    def line(self) -> str:
        value = "-" if self.value is None else f"{self.value:6.2f}x"
        target = "" if self.target is None else f"<= {self.target:.1f}x"
        note = f"  ({self.note})" if self.note else ""
        return f"  {self.name:<56} {value:>8}  {target:>8}  {self.verdict}{note}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "value": self.value,
            "target": self.target,
            "verdict": self.verdict,
            "note": self.note,
        }


def _div(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def memory_ratio(
    name: str, compile_m: Measurement, baseline: Measurement, size_bytes: int
) -> Ratio:
    if not compile_m.ok:
        return Ratio(name, None, 1.5, f"did not compile: {compile_m.error}")
    above = compile_m.peak_rss_mib - baseline.peak_rss_mib
    return Ratio(name, above / (size_bytes / MIB), 1.5, f"{above:.0f} MiB above baseline")


def anon_ratio(name: str, compile_m: Measurement, baseline: Measurement, size_bytes: int) -> Ratio:
    if not compile_m.ok or compile_m.peak_anon_mib is None or baseline.peak_anon_mib is None:
        return Ratio(name, None, None)
    above = compile_m.peak_anon_mib - baseline.peak_anon_mib
    return Ratio(name, above / (size_bytes / MIB), None, "anonymous memory only, polled")


def wall_ratio(name: str, a: Measurement, b: Measurement, target: float | None = None) -> Ratio:
    if not a.ok or not b.ok:
        failed = a if not a.ok else b
        return Ratio(name, None, target, f"{failed.label} failed: {failed.error}")
    return Ratio(name, a.wall_s / b.wall_s, target)


def cpu_ratio(name: str, a: Measurement, b: Measurement, target: float | None = None) -> Ratio:
    """A ratio in CPU time (user + system), the measure of issue 25's targets: steadier than
    wall time on a shared machine, where the wall rows follow whatever else runs."""
    if not a.ok or not b.ok:
        failed = a if not a.ok else b
        return Ratio(name, None, target, f"{failed.label} failed: {failed.error}")
    return Ratio(name, a.cpu_s / b.cpu_s, target, "CPU time, user + system")


def table(rows: Sequence[Measurement]) -> list[str]:
    lines = [f"  {'':<40} {'wall s':>8} {'CPU s':>8} {'peak RSS MiB':>13} {'peak anon MiB':>14}"]
    for m in rows:
        if not m.runs:
            continue
        anon = "-" if m.peak_anon_mib is None else f"{m.peak_anon_mib:.1f}"
        tail = "" if m.ok else f"  FAILED: {m.error}"
        lines.append(
            f"  {m.label:<40} {m.wall_s:8.2f} {m.cpu_s:8.2f} {m.peak_rss_mib:13.1f} "
            f"{anon:>14}{tail}"
        )
    return lines


# --- main -------------------------------------------------------------------------------------


@dataclass
class Results:
    """Everything one run measured, for the printed report and for `--json`."""

    args: argparse.Namespace
    model: Path
    model_bytes: int
    processes: list[Measurement]
    warm: dict[str, Any]
    ratios: list[Ratio]
    big: Path | None = None
    big_bytes: int = 0
    big_compile: Measurement | None = None
    big_ratios: list[Ratio] = field(default_factory=list)
    load_average: tuple[float, float, float] = field(default_factory=os.getloadavg)

    def report(self) -> list[str]:
        load = self.load_average
        lines = [
            "",
            f"qpcfarm compile benchmark: median of {self.args.repeat} run(s); peak RSS = exact "
            f"ru_maxrss of the child; {os.cpu_count()} CPUs, load average at the start "
            f"{load[0]:.2f} {load[1]:.2f}",
            "",
            f"model: {self.model.name}  {self.model_bytes / MIB:.1f} MiB",
            *table(self.processes),
            *self._warm_lines(),
            "",
            "ratios",
            *(r.line() for r in self.ratios),
            *self._big_lines(),
        ]
        verdicts = [r for r in [*self.ratios, *self.big_ratios] if r.target is not None]
        met = sum(r.verdict == "met" for r in verdicts)
        lines += ["", f"targets met: {met}/{len(verdicts)}"]
        lines += [f"  NOT MET: {r.name}" for r in verdicts if r.verdict != "met"]
        return lines

    def _warm_lines(self) -> list[str]:
        warm = self.warm
        if "error" in warm:
            return [f"  in-process warm: FAILED: {warm['error']}"]
        top = sorted(warm["pass_times"].items(), key=lambda kv: -kv[1])[:6]
        return [
            f"  {'in-process warm: compile_model, ' + str(warm['cores']) + ' cores':<40} "
            f"{warm['compile_s_median']:8.2f} {warm['compile_cpu_s_median']:8.2f}",
            f"  {'in-process warm: ORT offline session':<40} {warm['ort_s_median']:8.2f} "
            f"{warm['ort_cpu_s_median']:8.2f}",
            f"  in-process warm CPU, user / system: compile {warm['compile_user_s_median']:.2f} / "
            f"{warm['compile_sys_s_median']:.2f} s, ORT {warm['ort_user_s_median']:.2f} / "
            f"{warm['ort_sys_s_median']:.2f} s",
            "  compile stages (last warm run): " + ", ".join(f"{k} {v:.2f}s" for k, v in top),
            f"  QPC sha256 (warm compile): {warm['qpc_sha256']}",
        ]

    def _big_lines(self) -> list[str]:
        if self.big is None or self.big_compile is None:
            return []
        file_bytes = self.big.stat().st_size
        data_mib = (self.big_bytes - file_bytes) / MIB
        ok = self.big_compile.ok
        state = "compiled" if ok else f"DID NOT COMPILE: {self.big_compile.error}"
        return [
            "",
            f"external-data model: {self.big.name}  {self.big_bytes / MIB:.1f} MiB (file "
            f"{file_bytes / MIB:.1f} MiB + external data {data_mib:.1f} MiB), median of "
            f"{self.args.big_repeat} run(s): {state}",
            *table([self.big_compile]),
            *(r.line() for r in self.big_ratios),
        ]

    def to_json(self) -> dict[str, Any]:
        big: dict[str, Any] | None = None
        if self.big is not None and self.big_compile is not None:
            big = {
                "path": str(self.big),
                "bytes_total": self.big_bytes,
                "bytes_file": self.big.stat().st_size,
                "compiled": self.big_compile.ok,
                "compile": self.big_compile.summary(),
                "ratios": [r.as_dict() for r in self.big_ratios],
            }
        return {
            "repeat": self.args.repeat,
            "big_repeat": self.args.big_repeat,
            "cores": self.args.cores,
            "quick": self.args.quick,
            "cpu_count": os.cpu_count(),
            "load_average": self.load_average,
            "model": {"path": str(self.model), "bytes": self.model_bytes},
            "processes": [m.summary() for m in self.processes],
            "in_process_warm": self.warm,
            "ratios": [r.as_dict() for r in self.ratios],
            "big_model": big,
        }


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    load_average = os.getloadavg()
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    resnet_spec = RESNET_QUICK if args.quick else RESNET50
    mlp_spec = MLP_QUICK if args.quick else MLP_BIG

    _progress(f"generating models in {work} (reused when present) ...")
    if args.light_resnet50:
        resnet = write_light_resnet50(work, regenerate=args.regenerate)
    else:
        resnet = write_resnet(resnet_spec, work, regenerate=args.regenerate)
    resnet_bytes = model_size(resnet)
    big = None if args.skip_big else write_mlp(mlp_spec, work, regenerate=args.regenerate)

    folders = byte_compile_packages()
    _progress(f"byte-compiled (as pip install does): {', '.join(map(str, folders))}")

    n = args.cores
    baseline = Measurement("baseline (import compile + cli)", python_argv(BASELINE_CODE))
    compile_1 = Measurement("qpcfarm compile, 1 core", compile_argv(resnet, work / "qpc-1", 1))
    compile_n = Measurement(f"qpcfarm compile, {n} cores", compile_argv(resnet, work / "qpc-n", n))
    ort_m = Measurement(
        "ORT offline optimisation (ENABLE_ALL)",
        python_argv(ORT_CODE, resnet, work / f"{resnet.stem}.ort.onnx"),
    )
    load_save = Measurement(
        "onnx.load + onnx.save", python_argv(LOAD_SAVE_CODE, resnet, work / "resaved.onnx")
    )
    processes = [baseline, compile_1, compile_n, ort_m, load_save]
    _progress(f"measuring {resnet.name}: {args.repeat} round(s)")
    measure_round_robin(processes, args.repeat, args.timeout)

    _progress("in-process warm measurement ...")
    try:
        warm = warm_in_process(resnet, work, n, args.repeat)
    except Exception as exc:  # a compiler failure is a figure here, not a crash
        warm = {"error": f"{type(exc).__name__}: {exc}"}

    size = "model size"
    results = Results(
        args=args,
        model=resnet,
        model_bytes=resnet_bytes,
        processes=processes,
        warm=warm,
        load_average=load_average,
        ratios=[
            _warm_cpu_ratio(warm),
            _warm_ratio(warm),
            _warm_user_ratio(warm),
            cpu_ratio(
                f"compile process ({n} cores) / ORT process, CPU", compile_n, ort_m, PROCESS_TARGET
            ),
            cpu_ratio(
                "compile process (1 core) / ORT process, CPU", compile_1, ort_m, PROCESS_TARGET
            ),
            wall_ratio(f"compile process ({n} cores) / ORT process, wall", compile_n, ort_m),
            wall_ratio("compile process (1 core) / ORT process, wall", compile_1, ort_m),
            cpu_ratio("import baseline / ORT process, CPU", baseline, ort_m),
            _minus_baseline_ratio(compile_n, baseline, ort_m),
            wall_ratio(f"compile process ({n} cores) / load+save process", compile_n, load_save),
            wall_ratio("compile process (1 core) / load+save process", compile_1, load_save),
            memory_ratio(
                f"(compile {n} cores peak - baseline) / {size}", compile_n, baseline, resnet_bytes
            ),
            memory_ratio(
                f"(compile 1 core peak - baseline) / {size}", compile_1, baseline, resnet_bytes
            ),
            anon_ratio(
                f"(compile {n} cores anon peak - baseline) / {size}",
                compile_n,
                baseline,
                resnet_bytes,
            ),
        ],
    )
    if big is not None:
        results.big, results.big_bytes = big, model_size(big)
        big_compile = Measurement(
            f"qpcfarm compile, {n} cores", compile_argv(big, work / "qpc-big", n)
        )
        _progress(f"measuring {big.name}: {args.big_repeat} round(s)")
        measure_round_robin([big_compile], args.big_repeat, args.timeout)
        results.big_compile = big_compile
        results.big_ratios = [
            memory_ratio(
                f"(compile {n} cores peak - baseline) / total size",
                big_compile,
                baseline,
                results.big_bytes,
            ),
            anon_ratio(
                f"(compile {n} cores anon peak - baseline) / total size",
                big_compile,
                baseline,
                results.big_bytes,
            ),
        ]

    print("\n".join(results.report()))
    if args.json:
        Path(args.json).write_text(json.dumps(results.to_json(), indent=2) + "\n")
    return 0


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _minus_baseline_ratio(
    compile_m: Measurement, baseline: Measurement, ort_m: Measurement
) -> Ratio:
    """How far the compile is from the target once the cost of importing it is taken off."""
    name = "(compile process - import baseline) / ORT process, wall"
    if not (compile_m.ok and baseline.ok and ort_m.ok):
        return Ratio(name, None, None)
    return Ratio(
        name,
        (compile_m.wall_s - baseline.wall_s) / ort_m.wall_s,
        None,
        f"{baseline.wall_s:.2f} s of the compile is importing",
    )


def _warm_ratio(warm: dict[str, Any]) -> Ratio:
    name = "compile in-process warm / ORT in-process warm, wall"
    if "error" in warm:
        return Ratio(name, None, None)
    return Ratio(name, warm["compile_s_median"] / warm["ort_s_median"], None, "wall time")


def _warm_cpu_ratio(warm: dict[str, Any]) -> Ratio:
    """Issue 25's in-process target, in CPU time (all threads, user + system)."""
    name = "compile in-process warm / ORT in-process warm, CPU"
    if "error" in warm:
        return Ratio(name, None, 1.0, f"failed: {warm['error']}")
    ratio = warm["compile_cpu_s_median"] / warm["ort_cpu_s_median"]
    return Ratio(name, ratio, 1.0, f"{warm['cores']} cores, process CPU time, all threads")


def _warm_user_ratio(warm: dict[str, Any]) -> Ratio:
    name = "compile in-process warm / ORT in-process warm, user CPU"
    if "error" in warm:
        return Ratio(name, None, None)
    ratio = warm["compile_user_s_median"] / warm["ort_user_s_median"]
    return Ratio(name, ratio, None, "user time only: the work outside the kernel")


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    here = Path(__file__).resolve().parent
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    p.add_argument(
        "--quick",
        action="store_true",
        help="small ResNet and a ~320 MiB external-data model (smoke test)",
    )
    p.add_argument("--repeat", type=int, default=3, help="runs per figure (median)")
    p.add_argument(
        "--big-repeat",
        type=int,
        default=1,
        help="compile runs of the > 2 GiB model (RSS is exact per run)",
    )
    p.add_argument("--cores", type=int, default=4, help="-aic-num-cores of the N-core rows")
    p.add_argument("--work-dir", default=str(here / "out"), help="models and QPCs go here")
    p.add_argument("--json", help="write every figure to this JSON file")
    p.add_argument("--skip-big", action="store_true", help="skip the external-data model")
    p.add_argument(
        "--light-resnet50",
        action="store_true",
        help="measure onnx's light_resnet50 test model (random weights) instead of our ResNet-50",
    )
    p.add_argument("--regenerate", action="store_true", help="rewrite the models")
    p.add_argument(
        "--timeout", type=float, default=1800.0, help="seconds before a child process is killed"
    )
    args = p.parse_args(argv)
    if args.repeat < 1 or args.big_repeat < 1:
        p.error("--repeat and --big-repeat must be >= 1")
    return args


if __name__ == "__main__":
    sys.exit(main())
