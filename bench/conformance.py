"""ONNX node conformance: every `onnx.backend.test` node case through qpcfarm and ONNX Runtime.

Each case is compiled with `compile_model` (fp32, 1 core and `--cores` cores), run on the
functional runtime with `run_qpc` and compared with the case's expected outputs at its own
rtol/atol, the way `onnx.backend.test.runner` compares; ONNX Runtime runs the same cases in the
same run. Every (case, engine) task runs in a worker process watched by the parent: a worker
that crashes or overruns `--timeout` is killed and replaced, and the task counts as a failure,
so no case can stop the run. Workers are forked once and take many tasks each.

A qpcfarm result is "unsupported" only when the compiler says so with a CompileError coded
`unsupported_operator` or `unsupported_type` (the importer's check, naming the op); every other
error, crash, timeout or wrong answer is a failure.

    python bench/conformance.py                       # all 1,884 cases, 1 and 4 cores, ORT
    python bench/conformance.py --filter 'conv|gemm' --cores 2 --jobs 2 --json report.json
"""

# ruff: noqa: E402  (the BLAS thread limit must be set before numpy is imported)
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # workers share the CPUs: one BLAS thread each

import argparse
import json
import multiprocessing
import multiprocessing.connection
import re
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx.numpy_helper

NUMERIC_DTYPES = frozenset(
    {"float16", "float32", "float64", "bool"}
    | {f"{sign}int{bits}" for sign in ("", "u") for bits in (8, 16, 32, 64)}
)
_NUMERIC_ELEM_TYPES = frozenset(
    onnx.helper.np_dtype_to_tensor_dtype(np.dtype(name)) for name in NUMERIC_DTYPES
)
UNSUPPORTED_CODES = frozenset({"unsupported_operator", "unsupported_type"})
PASS, FAIL, UNSUPPORTED = "pass", "fail", "unsupported"

Value = Any
"""A case input or output: an ndarray, a list of them (sequence) or None (empty optional)."""


@dataclass(frozen=True)
class Case:
    """One conformance case, self-contained: the model's bytes and its data sets."""

    name: str
    op_type: str
    model: bytes
    data_sets: tuple[tuple[tuple[Value, ...], tuple[Value, ...]], ...]
    rtol: float
    atol: float
    numeric: bool
    """Every graph input and output is a tensor of a numeric or bool element type."""


@dataclass
class Outcome:
    case: str
    engine: str
    status: str
    detail: str = ""
    seconds: float = 0.0


Engine = Callable[[Case], tuple[str, str]]
"""Runs one case, returns (status, detail); exceptions are failures."""


# --- cases --------------------------------------------------------------------------------------


def load_cases(pattern: str | None = None) -> list[Case]:
    """The node test cases onnx generates in memory, optionally those whose name matches."""
    import onnx.backend.test.case.node as node_cases

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        raw = node_cases.collect_testcases("")
    regex = re.compile(pattern) if pattern else None
    base_ops = {
        c.name: c.model.graph.node[0].op_type
        for c in raw
        if c.model is not None and len(c.model.graph.node)
    }
    cases = []
    for case in raw:
        if regex is not None and not regex.search(case.name):
            continue
        assert case.model is not None and case.data_sets is not None
        data_sets = tuple(
            (tuple(_normalize(v) for v in ins), tuple(_normalize(v) for v in outs))
            for ins, outs in case.data_sets
        )
        cases.append(
            Case(
                name=case.name,
                op_type=_op_type(case.name, case.model, base_ops),
                model=case.model.SerializeToString(),
                data_sets=data_sets,
                rtol=float(case.rtol),
                atol=float(case.atol),
                numeric=_is_numeric(case.model, data_sets),
            )
        )
    return cases


def _op_type(name: str, model: onnx.ModelProto, base_ops: dict[str, str]) -> str:
    """The op a case tests: an `_expanded` case tests the op of the case it expands."""
    base = re.sub(r"_expanded(_ver\d+)?$", "", name)
    if base != name and base in base_ops:
        return base_ops[base]
    return model.graph.node[0].op_type if model.graph.node else "?"


def _normalize(value: Any) -> Value:
    if isinstance(value, onnx.TensorProto):
        return onnx.numpy_helper.to_array(value)
    if isinstance(value, np.generic):
        return np.asarray(value)
    if isinstance(value, list | tuple):
        return [_normalize(v) for v in value]
    return value


def _is_numeric(model: onnx.ModelProto, data_sets: Iterable[tuple[Sequence[Value], ...]]) -> bool:
    for info in (*model.graph.input, *model.graph.output):
        kind = info.type.WhichOneof("value")
        if kind != "tensor_type" or info.type.tensor_type.elem_type not in _NUMERIC_ELEM_TYPES:
            return False
    return all(
        isinstance(v, np.ndarray) and v.dtype.name in NUMERIC_DTYPES
        for data in data_sets
        for group in data
        for v in group
    )


# --- comparison ---------------------------------------------------------------------------------


def compare(expected: Sequence[Value], actual: Sequence[Value], rtol: float, atol: float) -> None:
    """Raise AssertionError unless `actual` matches, as `onnx.backend.test.runner` checks."""
    np.testing.assert_equal(len(actual), len(expected))
    for index, (ref, out) in enumerate(zip(expected, actual, strict=True)):
        if isinstance(ref, list | tuple) or isinstance(out, list | tuple):
            if not isinstance(out, list | tuple) or not isinstance(ref, list | tuple):
                raise AssertionError(f"output {index}: {type(out)} where {type(ref)} expected")
            compare(ref, out, rtol, atol)
            continue
        if ref is None or out is None:
            if ref is not out:
                raise AssertionError(f"output {index}: {out!r} where {ref!r} expected")
            continue
        out = np.asarray(out)
        np.testing.assert_array_equal(
            out.shape, ref.shape, err_msg=f"output {index} has incorrect shape"
        )
        if ref.dtype == object:
            np.testing.assert_array_equal(out, ref)
            continue
        np.testing.assert_equal(out.dtype, ref.dtype)
        out_rtol = rtol
        if out.dtype.name == "bfloat16":
            out_rtol = max(rtol, 2**-6)
            out, ref = out.astype(np.float32), ref.astype(np.float32)
        np.testing.assert_allclose(out, ref, rtol=out_rtol, atol=atol)


def _check(case: Case, run: Callable[[tuple[Value, ...]], list[Value]]) -> tuple[str, str]:
    for inputs, expected in case.data_sets:
        try:
            compare(expected, run(inputs), case.rtol, case.atol)
        except AssertionError as exc:
            return FAIL, "wrong answer: " + _first_lines(str(exc), 6)
    return PASS, ""


# --- engines ------------------------------------------------------------------------------------


def _input_names(model: onnx.ModelProto) -> list[str]:
    initializers = {t.name for t in model.graph.initializer}
    return [i.name for i in model.graph.input if i.name not in initializers]


def qpcfarm_engine(cores: int) -> Engine:
    """Compile (fp32, `cores` cores) and run on the functional runtime."""
    return _QpcfarmEngine(cores)


@dataclass(frozen=True)
class _QpcfarmEngine:
    cores: int

    def __call__(self, case: Case) -> tuple[str, str]:
        from compiler_core.compile import compile_model
        from compiler_core.errors import CompileError
        from compiler_core.runtime import run_qpc

        model = onnx.load_from_string(case.model)
        try:
            result = compile_model(case.model, [f"-aic-num-cores={self.cores}"])
        except CompileError as exc:
            status = UNSUPPORTED if exc.code in UNSUPPORTED_CODES else FAIL
            return status, _first_lines(str(exc), 3)
        names = _input_names(model)
        outputs = [o.name for o in model.graph.output]
        try:

            def run(inputs: tuple[Value, ...]) -> list[Value]:
                got = run_qpc(result.qpc_path, dict(zip(names, inputs, strict=True)))
                return [got[name] for name in outputs]

            return _check(case, run)
        finally:
            result.cleanup()


def ort_engine(case: Case) -> tuple[str, str]:
    """ONNX Runtime (CPU, one thread) on the same model and data."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.log_severity_level = 4
    try:
        session = ort.InferenceSession(case.model, options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # ORT raises its own exception types
        text = str(exc)
        unsupported = "NOT_IMPLEMENTED" in text or "not implemented" in text.lower()
        return (UNSUPPORTED if unsupported else FAIL), _first_lines(text, 3)
    names = [i.name for i in session.get_inputs()]

    def run(inputs: tuple[Value, ...]) -> list[Value]:
        feeds = dict(zip(names, inputs, strict=False))
        return list(session.run(None, feeds))

    return _check(case, run)


# --- the worker pool ----------------------------------------------------------------------------


@dataclass
class _Worker:
    process: BaseProcess
    conn: Connection
    task: tuple[int, str] | None = None
    started: float = 0.0


_CASES: list[Case] = []
_ENGINES: dict[str, Engine] = {}
"""Set in the parent before workers are forked; workers read them, never write them."""


def _worker_main(conn: Connection, tmp: str) -> None:
    tempfile.tempdir = tmp
    warnings.simplefilter("ignore")
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        index, engine = task
        start = time.perf_counter()
        try:
            status, detail = _ENGINES[engine](_CASES[index])
        except BaseException as exc:  # noqa: BLE001  (every error is the case's failure)
            status = FAIL
            detail = f"{type(exc).__name__}: {_first_lines(str(exc), 3)}"
            detail += "\n" + _first_lines("".join(traceback.format_tb(exc.__traceback__)[-2:]), 6)
        conn.send((index, engine, status, detail, time.perf_counter() - start))


def run_tasks(
    cases: Sequence[Case],
    engines: dict[str, Engine],
    *,
    jobs: int = 2,
    timeout: float = 60.0,
    progress: Callable[[Outcome], None] | None = None,
) -> list[Outcome]:
    """Run every engine on every case in forked workers; crashes and overruns are failures."""
    global _CASES, _ENGINES
    context = multiprocessing.get_context("fork")
    _CASES, _ENGINES = list(cases), dict(engines)
    pending = [(i, e) for e in engines for i in range(len(cases))]
    pending.reverse()
    outcomes: list[Outcome] = []
    root = tempfile.mkdtemp(prefix="conformance-")
    workers: list[_Worker] = []

    def spawn(slot: int) -> _Worker:
        parent, child = context.Pipe()
        tmp = os.path.join(root, f"w{slot}-{time.monotonic_ns()}")
        os.makedirs(tmp)
        process = context.Process(target=_worker_main, args=(child, tmp), daemon=True)
        process.start()
        child.close()
        return _Worker(process, parent)

    def finish(worker: _Worker, status: str, detail: str) -> None:
        assert worker.task is not None
        index, engine = worker.task
        outcome = Outcome(
            cases[index].name, engine, status, detail, time.perf_counter() - worker.started
        )
        outcomes.append(outcome)
        worker.task = None
        if progress is not None:
            progress(outcome)

    def replace(slot: int, status: str, detail: str) -> None:
        worker = workers[slot]
        worker.process.kill()
        worker.process.join()
        worker.conn.close()
        finish(worker, status, detail)
        workers[slot] = spawn(slot)

    try:
        workers = [spawn(slot) for slot in range(max(1, min(jobs, len(pending))))]
        while pending or any(w.task is not None for w in workers):
            for worker in workers:
                if worker.task is None and pending:
                    worker.task = pending.pop()
                    worker.started = time.perf_counter()
                    worker.conn.send(worker.task)
            busy = [w for w in workers if w.task is not None]
            now = time.perf_counter()
            wait = max(0.0, min(w.started + timeout - now for w in busy))
            ready = multiprocessing.connection.wait(
                [w.conn for w in busy] + [w.process.sentinel for w in busy], timeout=wait
            )
            for slot, worker in enumerate(workers):
                if worker.task is None:
                    continue
                if worker.conn in ready:
                    try:
                        _, _, status, detail, _ = worker.conn.recv()
                    except (EOFError, OSError):
                        code = worker.process.exitcode
                        replace(slot, FAIL, f"crash: worker died (exit code {code})")
                        continue
                    finish(worker, status, detail)
                elif worker.process.sentinel in ready:
                    code = worker.process.exitcode
                    replace(slot, FAIL, f"crash: worker died (exit code {code})")
                elif time.perf_counter() - worker.started > timeout:
                    replace(slot, FAIL, f"timeout: no result after {timeout:g} s")
    finally:
        for worker in workers:
            if worker.process.is_alive():
                try:
                    worker.conn.send(None)
                except OSError:
                    pass
        for worker in workers:
            worker.process.join(timeout=5)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join()
        shutil.rmtree(root, ignore_errors=True)
    return outcomes


# --- report -------------------------------------------------------------------------------------


@dataclass
class Report:
    engines: list[str]
    totals: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)
    """scope ("numeric", "all") -> engine -> status -> count"""
    by_op: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)
    """op type -> engine -> status -> count (all cases)"""
    failures: dict[str, list[dict[str, str]]] = field(default_factory=dict)
    """engine -> failed cases with their reason"""
    seconds: float = 0.0


def summarize(cases: Sequence[Case], outcomes: Sequence[Outcome], engines: Sequence[str]) -> Report:
    by_name = {c.name: c for c in cases}
    report = Report(list(engines))
    for scope in ("numeric", "all"):
        report.totals[scope] = {e: {PASS: 0, FAIL: 0, UNSUPPORTED: 0} for e in engines}
    by_op: dict[str, dict[str, Counter[str]]] = defaultdict(lambda: defaultdict(Counter))
    for outcome in sorted(outcomes, key=lambda o: (o.engine, o.case)):
        case = by_name[outcome.case]
        report.totals["all"][outcome.engine][outcome.status] += 1
        if case.numeric:
            report.totals["numeric"][outcome.engine][outcome.status] += 1
        by_op[case.op_type][outcome.engine][outcome.status] += 1
        if outcome.status == FAIL:
            report.failures.setdefault(outcome.engine, []).append(
                {"case": case.name, "op_type": case.op_type, "detail": outcome.detail}
            )
    report.by_op = {op: {e: dict(c) for e, c in v.items()} for op, v in sorted(by_op.items())}
    return report


def format_report(report: Report, *, all_ops: bool = True) -> str:
    engines = report.engines
    lines = []
    head = f"{'op type':28}" + "".join(f"{e + ' p/f/u':>22}" for e in engines)
    if all_ops:
        lines.append(head)
        for op, counts in report.by_op.items():
            cells = []
            for e in engines:
                c = counts.get(e, {})
                cells.append(f"{c.get(PASS, 0)}/{c.get(FAIL, 0)}/{c.get(UNSUPPORTED, 0)}")
            lines.append(f"{op:28}" + "".join(f"{cell:>22}" for cell in cells))
        lines.append("")
    for scope in ("numeric", "all"):
        lines.append(f"{scope} cases:")
        for e in engines:
            t = report.totals[scope][e]
            total = sum(t.values())
            share = 100.0 * t[PASS] / total if total else 0.0
            lines.append(
                f"  {e:10} pass {t[PASS]:5}  fail {t[FAIL]:5}  unsupported {t[UNSUPPORTED]:5}"
                f"  of {total:5}  ({share:.1f}% pass)"
            )
    for e in engines:
        failed = Counter(f["op_type"] for f in report.failures.get(e, []))
        if failed:
            top = ", ".join(f"{op} {n}" for op, n in failed.most_common(20))
            lines.append(f"failures by op type ({e}, top 20): {top}")
    return "\n".join(lines)


def _first_lines(text: str, count: int) -> str:
    return "\n".join(text.strip().splitlines()[:count])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--filter", help="regex on case names (re.search)")
    parser.add_argument("--cores", type=int, default=4, help="cores of the second qpcfarm pass")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="worker processes")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per case and engine")
    parser.add_argument("--json", type=Path, help="write the report (and every outcome) here")
    parser.add_argument("--no-ort", action="store_true", help="skip ONNX Runtime")
    parser.add_argument("--quiet", action="store_true", help="totals only, no per-op table")
    parser.add_argument("--failures", action="store_true", help="print each failure's reason")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    cases = load_cases(args.filter)
    engines: dict[str, Engine] = {"qpc-1": qpcfarm_engine(1)}
    if args.cores > 1:
        engines[f"qpc-{args.cores}"] = qpcfarm_engine(args.cores)
    if not args.no_ort:
        engines["ort"] = ort_engine
    total = len(cases) * len(engines)
    done = 0

    def progress(outcome: Outcome) -> None:
        nonlocal done
        done += 1
        if done % 200 == 0 or done == total:
            print(f"  {done}/{total} ({time.perf_counter() - start:.0f} s)", file=sys.stderr)

    print(
        f"{len(cases)} cases ({sum(c.numeric for c in cases)} numeric) x {len(engines)} engines, "
        f"{args.jobs} jobs",
        file=sys.stderr,
    )
    outcomes = run_tasks(cases, engines, jobs=args.jobs, timeout=args.timeout, progress=progress)
    report = summarize(cases, outcomes, list(engines))
    report.seconds = time.perf_counter() - start
    if args.failures:
        for engine, failed in report.failures.items():
            for f in failed:
                print(f"[{engine}] {f['case']} ({f['op_type']}): {f['detail']}")
    print(format_report(report, all_ops=not args.quiet))
    print(f"{report.seconds:.0f} s")
    if args.json:
        payload = asdict(report)
        payload["outcomes"] = [asdict(o) for o in outcomes]
        args.json.write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
