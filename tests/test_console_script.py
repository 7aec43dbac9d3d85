"""The `qpcfarm` console script (`app.console.cli:entry`): after a compile it leaves without
tearing the interpreter down, yet prints everything, runs atexit handlers and keeps the exit
code; other commands exit the ordinary way."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from app.console.cli import entry

ROOT = Path(__file__).resolve().parents[1]


def _relu_model(path: Path) -> Path:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu", [x], [y])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def _run_entry(args: list[str]) -> subprocess.CompletedProcess[str]:
    """`qpcfarm <args>` through `entry`, with an atexit handler of the caller's own."""
    script = (
        "import atexit, sys\n"
        "atexit.register(lambda: print('atexit handler ran', file=sys.stderr, flush=True))\n"
        f"sys.argv = ['qpcfarm', *{args!r}]\n"
        "from app.console.cli import entry\n"
        "entry()\n"
    )
    return subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def test_a_compile_prints_its_qpc_path_and_runs_atexit_handlers(tmp_path: Path) -> None:
    model = _relu_model(tmp_path / "relu.onnx")
    out_dir = tmp_path / "qpc"
    done = _run_entry(["compile", f"-m={model}", f"-aic-binary-dir={out_dir}"])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == str(out_dir / "programqpc.bin")
    assert (out_dir / "programqpc.bin").stat().st_size > 0
    assert "atexit handler ran" in done.stderr


def test_a_failed_compile_keeps_its_message_and_exit_code(tmp_path: Path) -> None:
    done = _run_entry(["compile", f"-m={tmp_path / 'missing.onnx'}", f"-aic-binary-dir={tmp_path}"])
    assert done.returncode == 1
    assert "model file not found" in done.stderr
    assert "atexit handler ran" in done.stderr


def test_other_commands_exit_the_ordinary_way(monkeypatch: pytest.MonkeyPatch) -> None:
    # In this very process: an immediate exit would end the test run, SystemExit does not.
    monkeypatch.setattr(sys, "argv", ["qpcfarm", "--help"])
    with pytest.raises(SystemExit) as exited:
        entry()
    assert exited.value.code == 0
