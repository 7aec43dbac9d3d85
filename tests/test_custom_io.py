"""`-custom-IO-list-file`: listed graph inputs and outputs cross the boundary in the listed
precision; the network computes as before (or as -convert-to-fp16 says)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import pytest

from compiler_core import compile_model, run_qpc
from compiler_core.errors import CompileError
from tests.op_checks import rand, run_onnxruntime

F = onnx.TensorProto.FLOAT
X_AND_Y_FP16 = "- IOName: x\n  Precision: float16\n- IOName: y\n  Precision: float16\n"


def _model() -> onnx.ModelProto:
    """y = tanh(x @ w), z = x + 1: two outputs, one input read twice."""
    w = onnx.numpy_helper.from_array(rand(8, 4), "w")
    one = onnx.numpy_helper.from_array(np.array(1.0, np.float32), "one")
    graph = oh.make_graph(
        [
            oh.make_node("MatMul", ["x", "w"], ["xw"]),
            oh.make_node("Tanh", ["xw"], ["y"]),
            oh.make_node("Add", ["x", "one"], ["z"]),
        ],
        "g",
        [oh.make_tensor_value_info("x", F, [3, 8])],
        [oh.make_tensor_value_info("y", F, [3, 4]), oh.make_tensor_value_info("z", F, [3, 8])],
        initializer=[w, one],
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)])


def _io_list(tmp_path: Path, text: str) -> str:
    path = tmp_path / "custom_io.yaml"
    path.write_text(text)
    return str(path)


def _io_dtypes(result) -> dict[str, str]:
    program = result.program
    return {
        program.tensors[t].name: program.tensors[t].dtype
        for t in (*program.inputs, *program.outputs)
    }


@pytest.mark.parametrize("fp16", [False, True])
def test_listed_inputs_and_outputs_cross_the_boundary_in_float16(tmp_path: Path, fp16: bool):
    io = _io_list(
        tmp_path, "- IOName: x\n  Precision: float16\n- IOName: y\n  Precision: float16\n"
    )
    flags = [f"-custom-IO-list-file={io}", "-aic-num-cores=2"] + (["-convert-to-fp16"] * fp16)
    model = _model()
    result = compile_model(model.SerializeToString(), flags)
    try:
        assert _io_dtypes(result) == {"x": "float16", "y": "float16", "z": "float32"}
        x = rand(3, 8).astype(np.float16)
        got = run_qpc(result.qpc_path, {"x": x})
    finally:
        result.cleanup()
    assert got["y"].dtype == np.float16 and got["z"].dtype == np.float32
    want_y, want_z = run_onnxruntime(model, {"x": x.astype(np.float32)})
    tol = 1e-2 if fp16 else 1e-3
    np.testing.assert_allclose(got["y"], want_y, rtol=tol, atol=tol)
    np.testing.assert_allclose(got["z"], want_z, rtol=tol, atol=tol)


def test_with_convert_to_fp16_a_listed_input_feeds_the_network_without_casts(tmp_path: Path):
    io = _io_list(
        tmp_path, "- IOName: x\n  Precision: float16\n- IOName: y\n  Precision: float16\n"
    )
    result = compile_model(
        _model().SerializeToString(), [f"-custom-IO-list-file={io}", "-convert-to-fp16"]
    )
    try:
        kernels = [k.info.op_type for k in result.program.kernels]
    finally:
        result.cleanup()
    # Only z keeps a boundary Cast (back to float32); x and y need none.
    assert kernels.count("Cast") == 1, kernels


def test_a_bfloat16_input_is_converted_at_the_boundary(tmp_path: Path):
    io = _io_list(tmp_path, "- IOName: x\n  Precision: bfloat16\n")
    result = compile_model(_model().SerializeToString(), [f"-custom-IO-list-file={io}"])
    try:
        assert _io_dtypes(result)["x"] == "bfloat16"
        x = rand(3, 8).astype("bfloat16")
        got = run_qpc(result.qpc_path, {"x": x})
    finally:
        result.cleanup()
    want = run_onnxruntime(_model(), {"x": x.astype(np.float32)})
    np.testing.assert_allclose(got["z"], want[1], rtol=1e-6)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("- IOName: nope\n  Precision: float16\n", "'nope' is neither a graph input"),
        ("- IOName: x\n  Precision: float8\n", "Precision 'float8' is not one of"),
        ("- IOName: x\n", "exactly the keys IOName and Precision"),
        ("x: float16\n", "non-empty YAML list"),
        ("- IOName: x\n  Precision: float16\n- IOName: x\n  Precision: float16\n", "twice"),
        ("- [unclosed\n", "not valid YAML"),
    ],
)
def test_a_bad_list_is_an_invalid_option_naming_the_flag(tmp_path: Path, text: str, message):
    io = _io_list(tmp_path, text)
    with pytest.raises(CompileError, match=message) as info:
        compile_model(_model().SerializeToString(), [f"-custom-IO-list-file={io}"])
    assert info.value.code == "invalid_option"
    assert info.value.flag == "-custom-IO-list-file"


def test_a_missing_list_file_is_an_invalid_option(tmp_path: Path):
    with pytest.raises(CompileError, match="cannot read") as info:
        compile_model(
            _model().SerializeToString(), [f"-custom-IO-list-file={tmp_path / 'none.yaml'}"]
        )
    assert info.value.code == "invalid_option"


def test_an_integer_io_cannot_change_precision(tmp_path: Path):
    graph = oh.make_graph(
        [oh.make_node("Neg", ["i"], ["o"])],
        "g",
        [oh.make_tensor_value_info("i", onnx.TensorProto.INT32, [2])],
        [oh.make_tensor_value_info("o", onnx.TensorProto.INT32, [2])],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)])
    io = _io_list(tmp_path, "- IOName: i\n  Precision: float16\n")
    with pytest.raises(CompileError, match="'i' is int32 in the model"):
        compile_model(model.SerializeToString(), [f"-custom-IO-list-file={io}"])
