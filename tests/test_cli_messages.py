"""What the command line says, as a new user meets it: a busy port, a precision warning, the
quantization loss of an all-zero output, a QPC given where a model goes, inputs of a wider
dtype than the QPC takes. Each message names what is wrong and what to do."""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from app.console.cli import main
from compiler_core import CompileError, compile_model
from compiler_core.cli import main as core_main
from compiler_core.passes.quantize import format_sqnr, sqnr_db
from tests.conftest import tiny_model

REPO = Path(__file__).resolve().parents[1]


def error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qpcfarm: error: "), err
    return lines[0]


# ------------------------------------------------------------------------------- serve


def test_serve_on_a_busy_port_refuses_before_creating_a_farm_or_a_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("QPCFARM_DATA_DIR", raising=False)
    monkeypatch.delenv("QPCFARM_DATABASE_URL", raising=False)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code = main(["serve", "--port", str(port)])
    err = capsys.readouterr().err
    line = error_line(err)
    assert code == 1
    assert f"port {port} on 127.0.0.1 is in use" in line and "--port" in line
    assert not (tmp_path / "qpcfarm-data").exists()  # no farm, no key printed
    assert "API key" not in err


# ---------------------------------------------------------------------- compile warnings


def clipping_model(path: Path) -> Path:
    """x @ W with W = 1e6: past float16's range, so -convert-to-fp16 clips it."""
    weight = numpy_helper.from_array(np.full((8, 8), 1e6, np.float32), "W")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")],
        "clip",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])],
        [weight],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def test_the_fp16_clipping_warning_is_printed_once(tmp_path: Path) -> None:
    """A whole process: Python's logging would print a library's warning a second time on
    stderr when no handler is configured (pytest's own handler would hide that)."""
    model = clipping_model(tmp_path / "clip.onnx")
    env = {k: v for k, v in os.environ.items() if not k.startswith("QPCFARM_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-m", "compiler_core.cli", "compile", f"-m={model}",
         f"-aic-binary-dir={tmp_path / 'out'}", "-convert-to-fp16"],
        capture_output=True, text=True, env=env, check=False, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("clipped values outside the float16 range") == 1, done.stderr
    assert done.stderr.startswith("warning: [fp16_clipped]")


def test_sqnr_is_exact_without_noise_and_minus_infinite_without_signal() -> None:
    assert sqnr_db(0.0, 0.0) == math.inf and format_sqnr(sqnr_db(0.0, 0.0)) == "exact"
    assert sqnr_db(5.0, 0.0) == math.inf
    assert sqnr_db(0.0, 1.0) == -math.inf and "no signal" in format_sqnr(-math.inf)
    assert sqnr_db(100.0, 1.0) == pytest.approx(20.0)
    assert format_sqnr(sqnr_db(100.0, 1.0)) == "20 dB"


def test_an_all_zero_output_is_never_named_as_losing_most_to_int8(tmp_path: Path) -> None:
    """x @ 0 is all zero: its int8 form is exact (zero is the zero point), not -315 dB."""
    rng = np.random.default_rng(0)
    weights = {
        "wz": np.zeros((16, 16), np.float32),
        "wr": rng.normal(0, 0.3, (16, 16)).astype(np.float32),
    }
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "wz"], ["zero"], name="/zero/MatMul"),
         helper.make_node("MatMul", ["x", "wr"], ["real"], name="/real/MatMul")],
        "zeros",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [4, 16]) for n in ("zero", "real")],
        [numpy_helper.from_array(v, k) for k, v in weights.items()],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.save(model, tmp_path / "zeros.onnx")
    np.savez(tmp_path / "calib.npz", x=rng.normal(0, 1, (8, 4, 16)).astype(np.float32))
    result = compile_model(
        tmp_path / "zeros.onnx",
        [f"-dump-profile={tmp_path / 'p.json'}", f"-input-list-file={tmp_path / 'calib.npz'}"],
    )
    loss = next(w for w in result.warnings if w["code"] == "quantization_loss")
    assert loss["nodes"] == ["/real/MatMul"]
    assert "/zero/MatMul" not in loss["message"] and "-3" not in loss["message"]
    assert " dB)" in loss["message"]


# -------------------------------------------------------------------------- wrong files


@pytest.fixture
def qpc(tmp_path: Path) -> Path:
    model = tmp_path / "tiny.onnx"
    onnx.save(tiny_model(), model)
    assert core_main(["compile", f"-m={model}", f"-aic-binary-dir={tmp_path / 'out'}"]) == 0
    return tmp_path / "out" / "programqpc.bin"


def test_a_qpc_given_as_the_model_is_named_a_qpc_with_the_commands_that_take_it(
    qpc: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    code = core_main(["compile", f"-m={qpc}", f"-aic-binary-dir={tmp_path / 'again'}"])
    line = error_line(capsys.readouterr().err)
    assert code == 1 and f"{qpc} is a QPC" in line and "not an ONNX model" in line
    assert f"qpcfarm run {qpc}" in line and f"qpcfarm qpc inspect {qpc}" in line
    assert "truncated" not in line
    # The compiler's own import (the farm's path) names it the same way.
    with pytest.raises(CompileError) as raised:
        compile_model(qpc, [f"-aic-binary-dir={tmp_path / 'again'}"])
    assert raised.value.code == "invalid_model" and "is a QPC" in raised.value.message


def test_run_warns_when_it_casts_float64_inputs_to_the_qpcs_float32(
    qpc: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wide = np.random.default_rng(0).random((2, 4))  # numpy's default: float64
    np.savez(tmp_path / "wide.npz", x=wide)
    np.savez(tmp_path / "exact.npz", x=wide.astype(np.float32))
    capsys.readouterr()
    assert core_main(["run", str(qpc), "--inputs", str(tmp_path / "wide.npz")]) == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warned) == 1
    assert "input 'x' is float64, the QPC takes float32" in warned[0]
    assert core_main(["run", str(qpc), "--inputs", str(tmp_path / "exact.npz")]) == 0
    assert "warning" not in capsys.readouterr().err


def test_run_refuses_inputs_of_another_kind_naming_input_and_dtypes(
    qpc: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    np.savez(tmp_path / "ints.npz", x=np.ones((2, 4), np.complex64))
    capsys.readouterr()
    code = core_main(["run", str(qpc), "--inputs", str(tmp_path / "ints.npz")])
    line = error_line(capsys.readouterr().err)
    assert code == 1 and "input 'x' has dtype complex64, the QPC expects float32" in line
