"""Functional-runtime speed: `run_qpc` of ResNet-50 against an ONNX Runtime CPU run of the same
model and input, measured in this run (DESIGN.md, Targets: <= 3x ONNX Runtime's time).

Both sides run in this process after one warm-up each, interleaved round robin, median of
`--repeat`: ours through a `QpcSession` (the QPC loaded once, like an ORT session), ORT with
its default CPU provider. The QPC is compiled for 1 core and for `--cores` cores; the functional
runtime executes every core's stream on the host, so the core count changes the tiling, not
the parallelism.

    python bench/runtime.py [--quick] [--repeat 5] [--cores 14] [--json out.json]
"""

# ruff: noqa: E402  (the BLAS thread limit must be set before numpy is imported)
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, str(os.cpu_count() or 1))

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import RESNET50, RESNET_QUICK, write_resnet  # noqa: E402

TARGET = 3.0


def _median_seconds(runs: dict[str, Callable[[], object]], repeat: int) -> dict[str, float]:
    for run in runs.values():
        run()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeat):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small ResNet (smoke test)")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per side (median)")
    parser.add_argument("--cores", type=int, default=14, help="-aic-num-cores of the N-core row")
    parser.add_argument("--work-dir", default=str(Path(__file__).parent / "out"))
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)

    import onnxruntime as ort

    from compiler_core import QpcSession, compile_model

    work = Path(args.work_dir)
    model = write_resnet(RESNET_QUICK if args.quick else RESNET50, work)
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    shape = [int(d) for d in session.get_inputs()[0].shape]
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    feeds = {name: x}

    results = {}
    sessions = {}
    for cores in (1, args.cores):
        result = compile_model(str(model), [f"-aic-num-cores={cores}"])
        results[cores] = result
        sessions[cores] = QpcSession(result.qpc_path)
    try:
        want = session.run(None, feeds)[0]
        for cores, qpc in sessions.items():
            got = next(iter(qpc.run(feeds).values()))
            err = float(np.max(np.abs(got - want)))
            print(f"{cores:2d} core(s): max |ours - ORT| = {err:.2e}")
        runs: dict[str, Callable[[], object]] = {"ORT CPU run": lambda: session.run(None, feeds)}
        for cores, qpc in sessions.items():
            runs[f"run_qpc, {cores} core(s)"] = lambda qpc=qpc: qpc.run(feeds)
        medians = _median_seconds(runs, args.repeat)
    finally:
        for qpc in sessions.values():
            qpc.close()
        for result in results.values():
            result.cleanup()

    peer = medians["ORT CPU run"]
    print(f"\nfunctional run of {model.name}: median of {args.repeat}, {os.cpu_count()} CPUs")
    for label, seconds in medians.items():
        print(f"  {label:<24} {seconds * 1000:9.1f} ms")
    print("\nratios")
    figures = {}
    for cores in sessions:
        ratio = medians[f"run_qpc, {cores} core(s)"] / peer
        met = "met" if ratio <= TARGET else "NOT MET"
        print(f"  run_qpc ({cores} core(s)) / ORT run   {ratio:6.2f}x   <= {TARGET:g}x  {met}")
        figures[f"ratio_{cores}_cores"] = ratio
    if args.json:
        args.json.write_text(json.dumps({"seconds": medians, **figures}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
