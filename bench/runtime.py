"""Functional-runtime speed: `run_qpc` of ResNet-50 and of a BERT-base encoder against an ONNX
Runtime CPU run of the same model and input, measured in this run (the target: <= 2.5x
ONNX Runtime's time with one thread each, on 1 and on 14 cores).

Both sides run in this process after one warm-up each, interleaved round robin, median of
`--repeat`: ours through a `QpcSession` (the QPC loaded once, like an ORT session), ORT with
its default CPU provider, both with `--threads` threads (BLAS's and ORT's intra-op pool;
default: every CPU). Each model is compiled for 1 core and for `--cores` cores. Every run
is timed twice: wall clock, and the process's CPU time (all threads), which a machine loaded
by other work disturbs much less.

    python bench/runtime.py [--quick] [--models resnet50,bert-base] [--repeat 5] [--cores 14]
                            [--threads N] [--blas-core SkylakeX] [--json out.json]
"""

# ruff: noqa: E402  (the BLAS thread limit must be set before numpy is imported)
from __future__ import annotations

import os
import sys


def _threads(argv: list[str]) -> int:
    """--threads N (default: every CPU), read before numpy is imported."""
    for i, arg in enumerate(argv):
        if arg == "--threads" and i + 1 < len(argv):
            return int(argv[i + 1])
        if arg.startswith("--threads="):
            return int(arg.split("=", 1)[1])
    return os.cpu_count() or 1


def _blas_core(argv: list[str]) -> str | None:
    """--blas-core NAME: OpenBLAS's kernel family (OPENBLAS_CORETYPE), read before numpy is
    imported. numpy's OpenBLAS (0.3.31) takes AMD Zen 5 for Haswell and runs AVX2 kernels,
    half the speed of its AVX-512 ones (SkylakeX) on that CPU."""
    for i, arg in enumerate(argv):
        if arg == "--blas-core" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--blas-core="):
            return arg.split("=", 1)[1]
    return None


THREADS = _threads(sys.argv[1:])
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = str(THREADS)
BLAS_CORE = _blas_core(sys.argv[1:])
if BLAS_CORE:
    os.environ["OPENBLAS_CORETYPE"] = BLAS_CORE

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import RESNET50, RESNET_QUICK, write_resnet
from transformer_models import BERT_BASE, EncoderSpec, write_encoder

TARGET = 2.5
BERT_QUICK = EncoderSpec(layers=2, hidden=128, heads=4, ffn=512, seq=32)
MODELS = ("resnet50", "bert-base")


def _model(name: str, quick: bool, work: Path) -> tuple[Path, list[str]]:
    """The model file and the flags that bind its symbolic dims (batch 1)."""
    if name == "resnet50":
        return write_resnet(RESNET_QUICK if quick else RESNET50, work), []
    if name == "bert-base":
        spec = BERT_QUICK if quick else BERT_BASE
        return write_encoder(spec, work), ["-onnx-define-symbol=batch,1"]
    raise SystemExit(f"unknown model {name!r}; choose from {', '.join(MODELS)}")


def _medians(
    runs: dict[str, Callable[[], object]], repeat: int
) -> tuple[dict[str, float], dict[str, float]]:
    """Median wall and process-CPU seconds of each run."""
    for run in runs.values():
        run()  # warm-up
    wall: dict[str, list[float]] = {name: [] for name in runs}
    cpu: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeat):
        for name, run in runs.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            run()
            cpu[name].append(time.process_time() - start_cpu)
            wall[name].append(time.perf_counter() - start)
    return (
        {name: statistics.median(v) for name, v in wall.items()},
        {name: statistics.median(v) for name, v in cpu.items()},
    )


def _openblas_core() -> str:
    """The kernel family numpy's OpenBLAS runs (`?` when it cannot be asked)."""
    import ctypes

    lib_dir = Path(np.__file__).parent.parent / "numpy.libs"
    for lib in sorted(lib_dir.glob("libscipy_openblas*")):
        for symbol in ("scipy_openblas_get_corename64_", "scipy_openblas_get_corename"):
            get = getattr(ctypes.CDLL(str(lib)), symbol, None)
            if get is not None:
                get.restype = ctypes.c_char_p
                return str(get().decode())
    return "?"


def measure(name: str, args: argparse.Namespace) -> dict[str, object]:
    import onnxruntime as ort

    from compiler_core import QpcSession, compile_model

    model, flags = _model(name, args.quick, Path(args.work_dir))
    options = ort.SessionOptions()
    options.intra_op_num_threads = THREADS
    session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    inp = session.get_inputs()[0]
    shape = [d if isinstance(d, int) else 1 for d in inp.shape]
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    feeds = {inp.name: x}

    results = {}
    sessions = {}
    for cores in (1, args.cores):
        result = compile_model(str(model), [f"-aic-num-cores={cores}", *flags])
        results[cores] = result
        sessions[cores] = QpcSession(result.qpc_path)
    errors = {}
    try:
        want = session.run(None, feeds)[0]
        scale = float(np.max(np.abs(want)))
        for cores, qpc in sessions.items():
            got = next(iter(qpc.run(feeds).values()))
            errors[cores] = float(np.max(np.abs(got - want)))
            print(
                f"{name}, {cores:2d} core(s): max |ours - ORT| = {errors[cores]:.2e} "
                f"(largest |ORT| {scale:.2e})"
            )
        runs: dict[str, Callable[[], object]] = {"ORT CPU run": lambda: session.run(None, feeds)}
        for cores, qpc in sessions.items():
            runs[f"run_qpc, {cores} core(s)"] = lambda qpc=qpc: qpc.run(feeds)
        wall, cpu = _medians(runs, args.repeat)
    finally:
        for qpc in sessions.values():
            qpc.close()
        for result in results.values():
            result.cleanup()

    print(
        f"\n{model.name}: median of {args.repeat}, {os.cpu_count()} CPUs, "
        f"{THREADS} thread(s) each, OpenBLAS core {_openblas_core()}"
    )
    print(f"  {'':<24} {'wall ms':>9} {'CPU ms':>9}")
    for label in wall:
        print(f"  {label:<24} {wall[label] * 1000:9.1f} {cpu[label] * 1000:9.1f}")
    figures: dict[str, object] = {"wall_seconds": wall, "cpu_seconds": cpu, "max_error": errors}
    for cores in sessions:
        key = f"run_qpc, {cores} core(s)"
        by_wall, by_cpu = wall[key] / wall["ORT CPU run"], cpu[key] / cpu["ORT CPU run"]
        met = "met" if max(by_wall, by_cpu) <= TARGET else "NOT MET"
        print(
            f"  run_qpc ({cores:2d} core(s)) / ORT run: wall {by_wall:5.2f}x, CPU {by_cpu:5.2f}x"
            f"   <= {TARGET:g}x  {met}"
        )
        figures[f"ratio_{cores}_cores_wall"] = by_wall
        figures[f"ratio_{cores}_cores_cpu"] = by_cpu
    print()
    return figures


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small models (smoke test)")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per side (median)")
    parser.add_argument("--cores", type=int, default=14, help="-aic-num-cores of the N-core row")
    parser.add_argument(
        "--threads", type=int, default=THREADS, help="BLAS and ORT intra-op threads (all CPUs)"
    )
    parser.add_argument(
        "--blas-core", default=BLAS_CORE, help="OPENBLAS_CORETYPE (default: as detected)"
    )
    parser.add_argument("--work-dir", default=str(Path(__file__).parent / "out"))
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    figures = {name: measure(name, args) for name in args.models.split(",") if name}
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
