"""Real exported models: transformers and timm architectures exported by torch, compiled by
qpcfarm in fp32 and fp16 on `--cores` cores, run on the functional runtime against ONNX Runtime.

Every model is built from a config in code with random weights (`real_model_zoo.py`: nothing is
fetched), exported with torch's TorchScript exporter (opset 17) into the work dir, and then, for
each precision:

- compiled in process (`compile_model`, `-aic-num-cores=N`, plus `-convert-to-fp16`), timed
  against an ONNX Runtime session with ORT_ENABLE_ALL and `optimized_model_filepath` on the same
  file (the compile peer of DESIGN.md's targets);
- run once through a `QpcSession` and compared with ONNX Runtime's output on the same inputs:
  "max err" is max |ours - ORT| over max |ORT| (of all outputs); fp32 matches within 1e-4,
  fp16 within 2e-2;
- the run is timed against ORT's (median of 3 after a warm-up);
- "direct .pt2": the same module saved with `torch.export.save` and compiled as a user hands it
  to the farm (`-m=model.pt2`: converted by `torch.onnx.export`'s dynamo exporter at opset 18 in
  the conversion child, compiler_core/convert), run, and compared with torch's own output; the
  cell is the verdict, that error, and the compile time with the conversion.

A failure is reported with its error code (`invalid_model`, `vtcm_overflow`, `runtime_fault`...)
and never stops the table. Needs `pip install -e '.[bench]'` and, for timm, `pip install
--no-deps timm==0.6.13` (the docstring of `real_model_zoo.py` says why).

    python bench/real_models.py [--only bert,timm-swin] [--fp32 | --fp16] [--cores 14]
        [--work-dir bench/out/real] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from real_model_zoo import ALL, Arch  # noqa: E402  (beside this script)

TOLERANCE = {"fp32": 1e-4, "fp16": 2e-2}
OPSET = 17


@dataclass
class Exported:
    arch: Arch
    path: Path | None
    feeds: dict[str, Any]
    params: int = 0
    seconds: float = 0.0
    error: str | None = None
    torch_err: float | None = None
    """max |ORT - torch| / max |torch|: whether the exporter kept the model's meaning."""
    expected: Any = None
    """torch's own output on `feeds`."""
    program: Path | None = None
    """The same module as a `torch.export` program (`.pt2`), for the direct PyTorch path."""
    program_error: str | None = None


@dataclass
class Row:
    name: str
    source: str
    kind: str
    precision: str
    params: int = 0
    export: str = "ok"
    compile: str = "-"
    match: str = "-"
    max_err: float | None = None
    compile_s: float | None = None
    ort_session_s: float | None = None
    run_s: float | None = None
    ort_run_s: float | None = None
    direct: str = "-"
    """The direct PyTorch path: the `.pt2` compiled as is (converted by the farm), its max err
    against torch's own output, and its compile time (conversion included)."""
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.export == "ok" and self.compile == "ok" and self.match == "yes"

    def cells(self) -> list[str]:
        return [
            self.name,
            self.precision,
            _params(self.params),
            self.export,
            self.compile,
            self.match,
            "-" if self.max_err is None else f"{self.max_err:.1e}",
            _ratio(self.compile_s, self.ort_session_s),
            _ratio(self.run_s, self.ort_run_s),
            self.direct,
        ]


def _params(count: int) -> str:
    return f"{count / 1e6:.2f}M" if count else "-"


def _ratio(ours: float | None, theirs: float | None) -> str:
    if ours is None or theirs is None:
        return "-"
    return f"{ours:.2f}s/{theirs:.2f}s = {ours / theirs:.1f}x"


def _error_code(exc: BaseException) -> str:
    code = getattr(exc, "code", None)
    return str(code) if isinstance(code, str) else type(exc).__name__


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


# ----------------------------------------------------------------------------------- export


def export(arch: Arch, folder: Path) -> Exported:
    """Build and export the architecture; check ORT against torch on the example inputs."""
    import numpy as np
    import torch

    start = time.perf_counter()
    try:
        module, inputs = arch.build()
        names = list(inputs)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{arch.name}.onnx"

        class Positional(torch.nn.Module):
            """The exporter passes positional arguments; the models take keywords."""

            def __init__(self) -> None:
                super().__init__()
                self.inner = module

            def forward(self, *args: Any) -> Any:
                return self.inner(**dict(zip(names, args, strict=True)))

        wrapped = Positional().eval()
        args = tuple(inputs.values())
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            expected = wrapped(*args).numpy()
            torch.onnx.export(
                wrapped,
                args,
                str(path),
                input_names=names,
                output_names=["output"],
                opset_version=OPSET,
                dynamo=False,
            )
        feeds = {name: tensor.numpy() for name, tensor in inputs.items()}
        result = Exported(arch, path, feeds, sum(p.numel() for p in module.parameters()))
        result.expected = expected
        try:
            program = folder / f"{arch.name}.pt2"
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.export.save(torch.export.export(wrapped, args), program)
            result.program = program
        except Exception as exc:  # noqa: BLE001 - the ONNX columns go on without it
            result.program_error = f"{type(exc).__name__}: {_first_line(exc)}"
        got = _ort_session(path).run(None, feeds)[0]
        result.torch_err = float(
            np.max(np.abs(got - expected)) / max(np.max(np.abs(expected)), 1e-30)
        )
    except Exception as exc:  # noqa: BLE001 - an architecture that does not export is a row
        return Exported(arch, None, {}, error=f"{type(exc).__name__}: {_first_line(exc)}")
    result.seconds = time.perf_counter() - start
    return result


# ------------------------------------------------------------------------------ measurement


def _ort_session(path: Path, optimized: Path | None = None) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if optimized is not None:
        options.optimized_model_filepath = str(optimized)
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def measure(exported: Exported, precision: str, cores: int, work: Path) -> Row:
    """Compile, run and compare one exported model at one precision."""
    import numpy as np

    from compiler_core import CompileOptions, QpcSession, compile_model

    arch = exported.arch
    row = Row(arch.name, arch.source, arch.kind, precision, exported.params)
    if exported.path is None:
        row.export = "fail"
        row.notes.append(f"export: {exported.error}")
        return row
    if exported.torch_err is not None and exported.torch_err > 1e-3:
        row.notes.append(f"export: ORT differs from torch by {exported.torch_err:.1e} (exporter)")
    out_dir = work / f"{arch.name}-{precision}"
    flags = [f"-aic-binary-dir={out_dir}", f"-aic-num-cores={cores}"]
    if precision == "fp16":
        flags.append("-convert-to-fp16")

    start = time.perf_counter()
    optimized = work / f"{arch.name}.ort.onnx"
    session = _ort_session(exported.path, optimized)
    row.ort_session_s = time.perf_counter() - start
    try:
        start = time.perf_counter()
        result = compile_model(exported.path, CompileOptions.from_flags(flags))
        row.compile_s = time.perf_counter() - start
    except Exception as exc:  # noqa: BLE001 - every failure is a row with its code
        row.compile = _error_code(exc)
        row.notes.append(f"compile: {_first_line(exc)}")
        return row
    row.compile = "ok"

    try:
        qpc = QpcSession(result.qpc_path)
        start = time.perf_counter()
        ours = qpc.run(exported.feeds)
        row.run_s = time.perf_counter() - start
    except Exception as exc:  # noqa: BLE001
        row.match = _error_code(exc)
        row.notes.append(f"run: {_first_line(exc)}")
        return row
    theirs = session.run(None, exported.feeds)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        session.run(None, exported.feeds)
        times.append(time.perf_counter() - start)
    row.ort_run_s = statistics.median(times)

    names = [o.name for o in session.get_outputs()]
    worst = 0.0
    for name, want in zip(names, theirs, strict=True):
        got = np.asarray(ours[name], dtype=np.float64)
        if got.shape != want.shape:
            row.match = "shape"
            row.notes.append(f"run: output '{name}' has shape {got.shape}, ORT {want.shape}")
            return row
        if not np.all(np.isfinite(want)) or not np.any(want):
            row.match = "dead"
            row.notes.append(f"run: ORT's output '{name}' is all zeros or not finite")
            return row
        scale = float(np.max(np.abs(want)))
        diff = np.abs(got - want)
        worst = max(worst, float(np.max(diff)) / scale if np.all(np.isfinite(diff)) else np.inf)
    row.max_err = worst
    row.match = "yes" if worst <= TOLERANCE[precision] else "no"
    row.direct = direct(exported, flags, work / f"{arch.name}-{precision}-pt2", precision, row)
    return row


def direct(exported: Exported, flags: list[str], out_dir: Path, precision: str, row: Row) -> str:
    """Compile the `.pt2` as the farm takes it (converted by torch.onnx.export in the
    conversion child), run it, compare with torch's own output: "yes 3e-07, 12.1s"."""
    import numpy as np
    import onnx

    from compiler_core import CompileOptions, QpcSession, compile_model

    if exported.program is None:
        row.notes.append(f"torch.export: {exported.program_error}")
        return "export"
    options = CompileOptions.from_flags([*flags[1:], f"-aic-binary-dir={out_dir}"])
    try:
        start = time.perf_counter()
        result = compile_model(exported.program, options)
        seconds = time.perf_counter() - start
        graph = onnx.load(out_dir / "converted.onnx", load_external_data=False).graph
        initializers = {t.name for t in graph.initializer}
        names = [i.name for i in graph.input if i.name not in initializers]
        feeds = dict(zip(names, exported.feeds.values(), strict=True))
        (got,) = QpcSession(result.qpc_path).run(feeds).values()
    except Exception as exc:  # noqa: BLE001 - a failure is the cell, with its code
        row.notes.append(f"direct .pt2: {_first_line(exc)}")
        return _error_code(exc)
    want = np.asarray(exported.expected, dtype=np.float64)
    if np.shape(got) != want.shape:
        return "shape"
    err = float(np.max(np.abs(np.asarray(got, dtype=np.float64) - want)))
    err /= max(float(np.max(np.abs(want))), 1e-30)
    verdict = "yes" if err <= TOLERANCE[precision] else "no"
    return f"{verdict} {err:.0e}, {seconds:.1f}s"


# ------------------------------------------------------------------------------------ table


HEADER = [
    "model",
    "prec",
    "params",
    "export",
    "compile",
    "match",
    "max err",
    "compile vs ORT session",
    "run vs ORT",
    "direct .pt2 (vs torch)",
]


def render(rows: Sequence[Row]) -> list[str]:
    table = [HEADER, *(row.cells() for row in rows)]
    widths = [max(len(cells[i]) for cells in table) for i in range(len(HEADER))]
    lines = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"
        for cells in table
    ]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return lines


def summary(rows: Sequence[Row]) -> list[str]:
    lines = []
    for precision in ("fp32", "fp16"):
        chosen = [r for r in rows if r.precision == precision]
        if not chosen:
            continue
        ok = sum(r.ok for r in chosen)
        compiled = [r for r in chosen if r.compile == "ok"]
        ratios = [
            r.compile_s / r.ort_session_s for r in compiled if r.compile_s and r.ort_session_s
        ]
        runs = [r.run_s / r.ort_run_s for r in compiled if r.run_s and r.ort_run_s]
        line = f"{precision}: {ok}/{len(chosen)} export, compile and match"
        if ratios:
            line += f"; compile/ORT session median {statistics.median(ratios):.1f}x"
        if runs:
            line += f"; run/ORT median {statistics.median(runs):.0f}x"
        lines.append(line)
    return lines


def select(only: str | None) -> list[Arch]:
    """`--only`: each comma-separated term names one architecture exactly, or else every
    architecture whose name contains it."""
    if not only:
        return list(ALL)
    chosen: list[Arch] = []
    for term in (t.strip() for t in only.split(",") if t.strip()):
        exact = [a for a in ALL if a.name == term]
        matches = exact or [a for a in ALL if term in a.name]
        if not matches:
            names = ", ".join(a.name for a in ALL)
            raise SystemExit(f"--only: no architecture matches '{term}'; known: {names}")
        chosen += [a for a in matches if a not in chosen]
    return [a for a in ALL if a in chosen]


def run(
    archs: Sequence[Arch], precisions: Sequence[str], cores: int, work: Path, progress: bool = True
) -> list[Row]:
    rows = []
    for arch in archs:
        exported = export(arch, work)
        for precision in precisions:
            try:
                row = measure(exported, precision, cores, work)
            except Exception as exc:  # noqa: BLE001 - a bug of the bench is a row too
                row = Row(
                    arch.name,
                    arch.source,
                    arch.kind,
                    precision,
                    exported.params,
                    compile=_error_code(exc),
                    notes=[traceback.format_exc(limit=3)],
                )
            rows.append(row)
            if progress:
                print("  " + " | ".join(row.cells()), file=sys.stderr, flush=True)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated names (or parts of names) to run")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--fp32", action="store_true", help="fp32 only")
    group.add_argument("--fp16", action="store_true", help="fp16 only (-convert-to-fp16)")
    parser.add_argument("--cores", type=int, default=14, help="-aic-num-cores (default 14)")
    parser.add_argument("--work-dir", type=Path, default=Path(__file__).parent / "out" / "real")
    parser.add_argument("--json", type=Path, help="write every row here")
    parser.add_argument("--list", action="store_true", help="list the architectures and exit")
    args = parser.parse_args(argv)
    if args.list:
        for arch in ALL:
            print(f"{arch.name:24} {arch.source:13} {arch.kind}")
        return 0

    precisions = ["fp32"] if args.fp32 else ["fp16"] if args.fp16 else ["fp32", "fp16"]
    rows = run(select(args.only), precisions, args.cores, args.work_dir)
    print("\n".join(render(rows)))
    print()
    print("\n".join(summary(rows)))
    notes = [f"- {r.name} {r.precision}: {n}" for r in rows for n in r.notes]
    if notes:
        print("\nNotes:\n" + "\n".join(notes))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
