"""Data-dependent shapes: a graph output's declared static shape is the compile-time contract
when its shape hangs on the value of a runtime input (Reshape's `shape`, ReduceSum's `axes`),
and the runtime holds every run to it."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper
import onnxruntime as ort
import pytest
from onnx import TensorProto

from compiler_core.compile import compile_model
from compiler_core.errors import CompileError
from compiler_core.runtime import run_qpc

F, I64 = TensorProto.FLOAT, TensorProto.INT64


def _model(nodes: list, inputs: list, output: tuple[str, list[int | str]]) -> bytes:
    name, dims = output
    out = oh.make_tensor_value_info(name, F, dims)
    graph = oh.make_graph(nodes, "g", inputs, [out])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)])
    return model.SerializeToString()


def _reshape_model(declared: list[int | str]) -> bytes:
    return _model(
        [oh.make_node("Reshape", ["x", "shape"], ["y"])],
        [
            oh.make_tensor_value_info("x", F, [2, 3, 4]),
            oh.make_tensor_value_info("shape", I64, [2]),
        ],
        ("y", declared),
    )


def _ort(model: bytes, feeds: dict[str, np.ndarray]) -> np.ndarray:
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


@pytest.mark.parametrize("cores", [1, 4])
def test_a_runtime_shape_operand_compiles_to_the_declared_output_shape(cores: int) -> None:
    model = _reshape_model([6, 4])
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    feeds = {"x": x, "shape": np.array([6, -1], dtype=np.int64)}
    result = compile_model(model, [f"-aic-num-cores={cores}"])
    try:
        got = run_qpc(result.qpc_path, feeds)["y"]
    finally:
        result.cleanup()
    np.testing.assert_array_equal(got, _ort(model, feeds))


def test_the_declared_shape_flows_back_through_elementwise_ops() -> None:
    model = _model(
        [
            oh.make_node("ReduceSum", ["x", "axes"], ["s"], keepdims=1),
            oh.make_node("Log", ["s"], ["y"]),
        ],
        [oh.make_tensor_value_info("x", F, [3, 4, 5]), oh.make_tensor_value_info("axes", I64, [1])],
        ("y", [3, 1, 5]),
    )
    x = np.random.default_rng(0).uniform(0.5, 2.0, (3, 4, 5)).astype(np.float32)
    feeds = {"x": x, "axes": np.array([1], dtype=np.int64)}
    result = compile_model(model, ["-aic-num-cores=2"])
    try:
        got = run_qpc(result.qpc_path, feeds)["y"]
    finally:
        result.cleanup()
    np.testing.assert_allclose(got, _ort(model, feeds), rtol=1e-5, atol=1e-6)


def test_a_run_whose_operand_contradicts_the_declared_shape_is_refused() -> None:
    result = compile_model(_reshape_model([6, 4]), ["-aic-num-cores=1"])
    x = np.zeros((2, 3, 4), dtype=np.float32)
    try:
        with pytest.raises(CompileError, match=r"\(3, 8\)"):
            run_qpc(result.qpc_path, {"x": x, "shape": np.array([3, 8], dtype=np.int64)})
    finally:
        result.cleanup()


def test_an_undeclared_data_dependent_shape_is_a_dynamic_shape_error() -> None:
    with pytest.raises(CompileError) as info:
        compile_model(_reshape_model(["rows", "cols"]), ["-aic-num-cores=1"])
    assert info.value.code == "dynamic_shape"


def _range_model(other: onnx.TensorProto) -> bytes:
    """Range(0, n, 1) * other: the Range's length hangs on the runtime input n."""
    graph = oh.make_graph(
        [
            oh.make_node("Range", ["start", "n", "delta"], ["r"]),
            oh.make_node("Mul", ["r", "other"], ["y"]),
        ],
        "g",
        [oh.make_tensor_value_info("n", F, [])],
        [oh.make_tensor_value_info("y", F, [5])],
        initializer=[
            onnx.numpy_helper.from_array(np.array(0.0, np.float32), "start"),
            onnx.numpy_helper.from_array(np.array(1.0, np.float32), "delta"),
            other,
        ],
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)]).SerializeToString()


def test_the_declared_shape_flows_back_through_a_binary_op_with_a_one_element_operand() -> None:
    model = _range_model(onnx.numpy_helper.from_array(np.array([2.5], np.float32), "other"))
    feeds = {"n": np.array(5.0, dtype=np.float32)}
    result = compile_model(model, ["-aic-num-cores=2"])
    try:
        got = run_qpc(result.qpc_path, feeds)["y"]
    finally:
        result.cleanup()
    np.testing.assert_allclose(got, _ort(model, feeds))


def test_a_full_size_operand_leaves_the_other_operands_shape_open() -> None:
    """Range(..) * ones(5) could broadcast a 1-element range: no shape is guessed."""
    model = _range_model(onnx.numpy_helper.from_array(np.ones(5, np.float32), "other"))
    with pytest.raises(CompileError) as info:
        compile_model(model, ["-aic-num-cores=1"])
    assert info.value.code == "dynamic_shape"
