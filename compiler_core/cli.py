"""`qpcfarm`: the command line front end.

`qpcfarm compile` takes exactly the flags of `qaic-compile` (single dash, parsed by
`compiler_core.options`); every other command is an argparse subcommand listed in
`SUBCOMMANDS`, where later commands (serve, worker, submit, admin, db, opstats) slot in. The
handlers import the heavy modules (onnx, numpy, the compiler, the service) only when they run, so
`qpcfarm -h` stays fast and this module never imports `app` or `worker` at import time.

Errors: a `CompileError` prints one line, `qpcfarm: error: <message>`, and exits 1; anything
else is a bug and exits 2 with one line too (`QPCFARM_DEBUG=1` shows the traceback).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from compiler_core.blas_core import set_openblas_core
from compiler_core.errors import CompileError
from compiler_core.options import CompileOptions, usage, wants_help
from compiler_core.report import render_metrics, render_pass_times, render_warning
from compiler_core.version import COMPILER_VERSION

PROG = "qpcfarm"
QPC_FILE_NAME = "programqpc.bin"


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage errors as CompileError, so they print as one line."""

    def error(self, message: str) -> NoReturn:
        raise CompileError("invalid_arguments", f"{self.prog}: {message}")


@dataclass(frozen=True)
class Subcommand:
    """An argparse subcommand: `configure` adds its arguments, `run` handles parsed args."""

    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# ---------------------------------------------------------------------------------------------
# qpcfarm compile


def compile_command(argv: Sequence[str]) -> int:
    """`qpcfarm compile <qaic-compile flags>`."""
    if not argv:
        raise CompileError(
            "invalid_option",
            "no options given: qpcfarm compile -m=<model.onnx> -aic-binary-dir=<dir> "
            "(-h lists the options)",
        )
    if wants_help(argv):
        sys.stdout.write(usage())
        return 0
    options = CompileOptions.from_flags(argv)
    if options.operators_supported is not None:
        if options.operators_supported == "onnx":
            sys.stdout.write(render_operators())
        else:
            from compiler_core.convert.operators import render, supported_rows

            sys.stdout.write(render(supported_rows(options.operators_supported)))
        return 0
    for message in options.warnings:
        print(f"warning: {message}", file=sys.stderr)
    model = model_path(options)
    out_dir = binary_dir(options)

    from compiler_core.compile import compile_model

    out_dir.mkdir(parents=True, exist_ok=True)
    result = compile_model(str(model), options)
    for warning in result.warnings:
        if warning.get("message") not in options.warnings:  # printed above already
            print(render_warning(warning), file=sys.stderr)
    if options.aic_perf_metrics:
        sys.stdout.write(render_metrics(result.metrics))
    if options.time_passes:
        sys.stdout.write(render_pass_times(result.pass_times))
    print(result.qpc_path)
    return 0


def model_path(options: CompileOptions) -> Path:
    """The `-m` model file, or the one-line error a compile (local or remote) gives."""
    if options.model is None:
        raise CompileError(
            "invalid_option", "no model given: pass -m=<model.onnx> (or -model=...)", flag="-m"
        )
    path = Path(options.model)
    if not path.exists():
        raise CompileError(
            "model_not_found", f"model file not found: {options.model} (-m)", flag="-m"
        )
    from compiler_core.convert import recognise

    recognised = recognise(path)
    if recognised is not None and recognised.format is not None:
        return path  # a TensorFlow or PyTorch model: converted to ONNX by the compile
    if recognised is not None:
        raise CompileError(
            "invalid_model", f"{options.model} is {recognised.looks_like}", flag="-m"
        )
    if not path.is_file():
        raise CompileError(
            "model_not_found",
            f"model path is not a file: {options.model} (-m; a directory is taken only when "
            "it is a TensorFlow SavedModel, holding saved_model.pb)",
            flag="-m",
        )
    from compiler_core.file_kinds import model_problem, sniff_file

    problem = model_problem(sniff_file(path), options.model)
    if problem is not None:
        raise CompileError("invalid_model", problem, flag="-m")
    return path


def binary_dir(options: CompileOptions) -> Path:
    """The `-aic-binary-dir` directory, or the one-line error a compile gives."""
    if options.aic_binary_dir is None:
        raise CompileError(
            "invalid_option",
            "no output directory given: pass -aic-binary-dir=<dir> (the QPC is written to "
            f"<dir>/{QPC_FILE_NAME})",
            flag="-aic-binary-dir",
        )
    path = Path(options.aic_binary_dir)
    if path.exists() and not path.is_dir():
        raise CompileError(
            "invalid_option",
            f"Invalid value for -aic-binary-dir: {options.aic_binary_dir} (it is a file, "
            "not a directory)",
            flag="-aic-binary-dir",
        )
    return path


def render_operators() -> str:
    """`-operators-supported=onnx`: one registry entry per line: op, domain, opsets, dtypes."""
    from compiler_core.ops import REGISTRY

    rows = [
        (
            opdef.op_type,
            opdef.domain or "ai.onnx",
            f"{opdef.since}-{opdef.until}" if opdef.until is not None else f"{opdef.since}+",
            ",".join(sorted(opdef.dtypes)),
        )
        for opdef in REGISTRY.all()
    ]
    if not rows:
        return ""
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return "".join(
        f"{op:<{widths[0]}}  {domain:<{widths[1]}}  {opsets:<{widths[2]}}  {dtypes}\n"
        for op, domain, opsets, dtypes in rows
    )


# ---------------------------------------------------------------------------------------------
# qpcfarm run / qpc validate / qpc inspect


def qpc_path(arg: str) -> Path:
    """A QPC file, or a directory holding `programqpc.bin` (as `-aic-binary-dir` writes it);
    a file of another kind (an ONNX model...) is named as what it is."""
    from compiler_core.file_kinds import ONNX, QPC, sniff_file

    path = Path(arg)
    if path.is_dir():
        path = path / QPC_FILE_NAME
    if not path.is_file():
        raise CompileError("file_not_found", f"QPC file not found: {path}")
    kind = sniff_file(path)
    if kind == ONNX:
        raise CompileError(
            "invalid_qpc",
            f"{path} is an ONNX model, not a QPC: compile it first "
            f"({PROG} compile -m={path} -aic-binary-dir=out) and give out/{QPC_FILE_NAME}",
        )
    if kind is not None and kind != QPC:
        raise CompileError("invalid_qpc", f"{path} is {kind}, not a QPC")
    return path


def load_inputs(arg: str) -> dict[str, Any]:
    """`--inputs IN.npz`: arrays by input name; any other file is named as what it is."""
    import zipfile

    import numpy as np

    from compiler_core.file_kinds import inputs_problem, sniff_file

    path = Path(arg)
    if not path.is_file():
        raise CompileError("file_not_found", f"inputs file not found: {path}")
    problem = inputs_problem(sniff_file(path))
    if problem is not None:
        raise CompileError("bad_inputs", f"--inputs {path} {problem}")
    try:
        with np.load(path, allow_pickle=False) as archive:
            return {name: archive[name] for name in archive.files}
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
        raise CompileError(
            "bad_inputs", f"--inputs {path} is not a readable .npz archive of arrays: {exc}"
        ) from None


def _configure_run(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("qpc", metavar="QPC", help="programqpc.bin, or the directory holding it")
    parser.add_argument("--inputs", metavar="IN.npz", help="inputs by name (numpy .npz)")
    parser.add_argument("--outputs", metavar="OUT.npz", help="write the outputs here (.npz)")
    parser.add_argument(
        "--profiling-out-dir",
        metavar="DIR",
        help="write each inference's raw stats buffer here (stats-inf-<n>.bin, for opstats)",
    )
    parser.add_argument(
        "-n", "--iterations", type=int, default=1, metavar="N", help="inferences to run"
    )


def run_command(args: argparse.Namespace) -> int:
    import warnings

    import numpy as np

    from compiler_core.runtime import QpcSession
    from compiler_core.runtime.numerics import NonFiniteWarning

    path = qpc_path(args.qpc)
    inputs = load_inputs(args.inputs) if args.inputs is not None else {}
    with QpcSession(str(path)) as session, warnings.catch_warnings():
        for message in narrowed_inputs(session, inputs):
            print(f"warning: {message}", file=sys.stderr)
        warnings.simplefilter("ignore", NonFiniteWarning)  # printed below, as a warning line
        outputs = session.run(
            inputs, profiling_out_dir=args.profiling_out_dir, iterations=args.iterations
        )
        numerics = session.numerics
    if numerics is not None:
        print(render_warning(numerics.to_dict()), file=sys.stderr)
    if args.outputs is not None:
        arrays: dict[str, Any] = {name: np.asarray(v) for name, v in outputs.items()}
        np.savez(args.outputs, **arrays)
    width = max((len(name) for name in outputs), default=0)
    for name, value in outputs.items():
        array = np.asarray(value)
        print(f"{name:<{width}}  {'x'.join(map(str, array.shape)) or 'scalar'}  {array.dtype}")
    return 0


def narrowed_inputs(session: Any, inputs: dict[str, Any]) -> list[str]:
    """One line per input the QPC takes in a narrower dtype than given (float64 for a
    float32 input, int64 for int32): `run` casts it, as numpy does (`same_kind`), and says
    so, since values may round or overflow; a cast across kinds is refused by the runtime."""
    import numpy as np

    if not inputs:
        return []
    spec = session.select(inputs)
    wanted = {io.name: np.dtype(io.dtype) for io in spec.inputs}
    lines = []
    for name, value in inputs.items():
        given, expected = np.asarray(value).dtype, wanted.get(name)
        if expected is None or given == expected:
            continue
        if not np.can_cast(given, expected, casting="safe") and np.can_cast(
            given, expected, casting="same_kind"
        ):
            lines.append(
                f"input '{name}' is {given}, the QPC takes {expected}: cast to {expected} "
                f"(values may round or overflow; save the .npz as {expected} to silence this)"
            )
    return lines


def _configure_qpc(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="qpc_command", metavar="ACTION", required=True)
    validate = actions.add_parser(
        "validate", help="check a QPC's integrity and its fit to a device"
    )
    validate.add_argument("file", metavar="FILE", help="programqpc.bin, or its directory")
    validate.add_argument("--device", metavar="NAME", help="device profile to check against")
    validate.set_defaults(run=validate_command)
    inspect = actions.add_parser("inspect", help="summarise a QPC")
    inspect.add_argument("file", metavar="FILE", help="programqpc.bin, or its directory")
    inspect.add_argument("--json", action="store_true", help="print JSON instead of text")
    inspect.set_defaults(run=inspect_command)


def validate_command(args: argparse.Namespace) -> int:
    from compiler_core.qpc.validate import validate_qpc

    report = validate_qpc(str(qpc_path(args.file)), device=args.device)
    for check in report.checks:
        print(f"{'PASS' if check.ok else 'FAIL'} {check.name}: {check.message}")
    return 0 if report.ok else 1


def inspect_command(args: argparse.Namespace) -> int:
    from compiler_core.qpc.inspect import inspect_qpc, render_inspect

    summary = inspect_qpc(str(qpc_path(args.file)))
    if args.json:
        print(json.dumps(summary, indent=2, sort_keys=True, default=str))
    else:
        text = render_inspect(summary)
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
    return 0


def _configure_opstats(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--qpc",
        required=True,
        metavar="QPC",
        help="programqpc.bin (compiled with -stats-level=70 or more)",
    )
    parser.add_argument(
        "--input-dir",
        required=True,
        metavar="DIR",
        help="raw stats written by `qpcfarm run --profiling-out-dir`",
    )
    parser.add_argument("--output-dir", required=True, metavar="DIR", help="where to write")
    parser.add_argument(
        "--summary", action="store_true", help="per-operator summary: opstats-summary.txt and .csv"
    )
    parser.add_argument("--trace", action="store_true", help="Chrome/Perfetto timeline: trace.json")


def opstats_command(args: argparse.Namespace) -> int:
    from compiler_core.profiling.opstats import write_opstats

    summary, trace = args.summary, args.trace
    if not summary and not trace:
        summary = trace = True
    qpc = qpc_path(args.qpc)
    check_stats_belong(qpc, args.input_dir)
    for path in write_opstats(qpc, args.input_dir, args.output_dir, summary=summary, trace=trace):
        print(path)
    return 0


def check_stats_belong(qpc: Path, input_dir: str) -> None:
    """Raw stats are laid out by the QPC that ran: buffers of another QPC's size are that
    QPC's stats, and are named so (rather than as a size mismatch)."""
    from compiler_core.file_kinds import STATS, sniff
    from compiler_core.profiling.opstats import load_layout, read_stats_dir

    layout, network = load_layout(qpc)
    for raw in read_stats_dir(input_dir):
        if sniff(raw[:8]) == STATS and len(raw) != layout.size:
            raise CompileError(
                "stats_mismatch",
                f"the stats in {input_dir} belong to another QPC: their buffers have "
                f"{len(raw):,} bytes, {qpc} (network {network!r}) lays out {layout.size:,}. "
                f"Run this QPC with `{PROG} run {qpc} --inputs IN.npz --profiling-out-dir DIR` "
                "and give that DIR",
            )


def _qpc_dispatch(args: argparse.Namespace) -> int:
    handler: Callable[[argparse.Namespace], int] = args.run
    return handler(args)


SUBCOMMANDS: tuple[Subcommand, ...] = (
    Subcommand("run", "run a QPC on the functional runtime", _configure_run, run_command),
    Subcommand("qpc", "validate or inspect a QPC", _configure_qpc, _qpc_dispatch),
    Subcommand(
        "opstats",
        "per-operator summary and trace from a QPC's raw stats",
        _configure_opstats,
        opstats_command,
    ),
)
"""argparse subcommands, in `-h` order. Service commands add entries here whose `run`
imports `app`/`worker` inside the handler."""

RAW_COMMANDS: dict[str, tuple[str, Callable[[Sequence[str]], int]]] = {
    "compile": (
        "compile an ONNX model: qaic-compile flags (compile -h lists them)",
        compile_command,
    ),
}
"""Commands that parse their own arguments (qaic-compile's single-dash flags)."""


# ---------------------------------------------------------------------------------------------
# Dispatch


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="ONNX -> QPC compile farm and tools.")
    parser.add_argument("--version", action="version", version=f"{PROG} {COMPILER_VERSION}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_text, _) in RAW_COMMANDS.items():
        commands.add_parser(name, help=help_text, add_help=False)
    for sub in SUBCOMMANDS:
        sub_parser = commands.add_parser(sub.name, help=sub.help)
        sub.configure(sub_parser)
        sub_parser.set_defaults(command_run=sub.run)
    return parser


def _dispatch(argv: Sequence[str]) -> int:
    if argv and argv[0] in RAW_COMMANDS:
        return RAW_COMMANDS[argv[0]][1](argv[1:])
    parser = build_parser()
    if not argv:
        sys.stderr.write(parser.format_help())
        return 1
    args = parser.parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.command_run
    return handler(args)


def _error_line(message: str) -> None:
    print(f"{PROG}: error: {' '.join(message.split())}", file=sys.stderr)


def _silence_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def main(argv: Sequence[str] | None = None) -> int:
    set_openblas_core()  # before numpy is imported (`python -m compiler_core.cli`)
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        return _dispatch(args)
    except CompileError as exc:
        _error_line(exc.message)
        return 1
    except SystemExit as exc:  # argparse's -h and --version
        return exc.code if isinstance(exc.code, int) else 0
    except KeyboardInterrupt:
        _error_line("interrupted")
        return 130
    except BrokenPipeError:  # `qpcfarm ... | head`: the reader left; say nothing more
        _silence_stdout()
        return 1
    except Exception as exc:
        if os.environ.get("QPCFARM_DEBUG") == "1":
            traceback.print_exc()
        _error_line(f"internal error: {type(exc).__name__}: {exc} (QPCFARM_DEBUG=1 for details)")
        return 2


if __name__ == "__main__":
    sys.exit(main())
