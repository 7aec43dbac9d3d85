"""Ops with graph attributes: If, Loop, Scan and FlexAttention's score/prob modifiers.

Bodies run on our own kernels; they travel inside the QPC as serialized graphs and may read
values of the enclosing graph. Oracles: ONNX Runtime (If, Loop, Scan) and onnx.reference
(FlexAttention, which ONNX Runtime does not implement).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnx.helper as oh
import pytest
from onnx import TensorProto

from compiler_core.compile import compile_model
from compiler_core.errors import CompileError
from compiler_core.lowering.program import decode_program, encode_program
from compiler_core.runtime import run_qpc
from tests.op_checks import assert_matches, rand

F = TensorProto.FLOAT


def _vi(name: str, elem: int, dims: list[int] | None) -> onnx.ValueInfoProto:
    return oh.make_tensor_value_info(name, elem, dims)


def _model(
    nodes: list[onnx.NodeProto],
    inputs: list[onnx.ValueInfoProto],
    outputs: list[onnx.ValueInfoProto],
    *,
    opset: int = 17,
    extra_opsets: dict[str, int] | None = None,
) -> onnx.ModelProto:
    graph = oh.make_graph(nodes, "g", inputs, outputs)
    opsets = [oh.make_opsetid("", opset)]
    opsets += [oh.make_opsetid(d, v) for d, v in (extra_opsets or {}).items()]
    model = oh.make_model(graph, opset_imports=opsets)
    model.ir_version = 10
    return model


def _if_reading_outer_values() -> onnx.ModelProto:
    """then: relu(a) + b, else: relu(a) * b, where relu(a) is computed outside the If."""
    then = oh.make_graph(
        [oh.make_node("Add", ["r", "b"], ["t"])], "then", [], [_vi("t", F, [2, 3])]
    )
    other = oh.make_graph(
        [oh.make_node("Mul", ["r", "b"], ["e"])], "else", [], [_vi("e", F, [2, 3])]
    )
    return _model(
        [
            oh.make_node("Relu", ["a"], ["r"]),
            oh.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other),
        ],
        [_vi("a", F, [2, 3]), _vi("b", F, [2, 3]), _vi("c", TensorProto.BOOL, [])],
        [_vi("y", F, [2, 3])],
    )


@pytest.mark.parametrize("cond", [True, False])
def test_if_branches_reading_outer_values_match_onnxruntime(cond: bool) -> None:
    feeds = {"a": rand(2, 3), "b": rand(2, 3), "c": np.array(cond)}
    assert_matches(_if_reading_outer_values(), feeds)


def test_if_inside_a_qpc_round_trips_through_program_encoding_and_runs(tmp_path) -> None:  # type: ignore[no-untyped-def]
    model = _if_reading_outer_values()
    result = compile_model(model, ["-aic-num-cores=2", f"-aic-binary-dir={tmp_path}"])
    program = result.program
    assert encode_program(decode_program(encode_program(program))) == encode_program(program)
    kernel = next(k for k in program.kernels if k.info.op_type == "If")
    assert isinstance(kernel.info.attrs["then_branch"], bytes)
    a, b = rand(2, 3), rand(2, 3)
    got = run_qpc(result.qpc_path, {"a": a, "b": b, "c": np.array(False)})
    np.testing.assert_allclose(got["y"], np.maximum(a, 0) * b, rtol=1e-6)


def _scan_body_two_states() -> onnx.GraphProto:
    return oh.make_graph(
        [
            oh.make_node("Add", ["s_in", "x"], ["s_out"]),
            oh.make_node("Mul", ["p_in", "x"], ["p_out"]),
            oh.make_node("Sub", ["s_out", "p_out"], ["z"]),
        ],
        "body",
        [_vi("s_in", F, [2]), _vi("p_in", F, [2]), _vi("x", F, [2])],
        [_vi("s_out", F, [2]), _vi("p_out", F, [2]), _vi("z", F, [2])],
    )


def test_scan_with_two_states_matches_onnxruntime() -> None:
    node = oh.make_node(
        "Scan",
        ["s0", "p0", "xs"],
        ["s", "p", "zs"],
        num_scan_inputs=1,
        body=_scan_body_two_states(),
    )
    model = _model(
        [node],
        [_vi("s0", F, [2]), _vi("p0", F, [2]), _vi("xs", F, [4, 2])],
        [_vi("s", F, [2]), _vi("p", F, [2]), _vi("zs", F, [4, 2])],
    )
    assert_matches(model, {"s0": rand(2), "p0": rand(2), "xs": rand(4, 2)})


def test_scan_reverse_input_along_axis_1_and_output_along_axis_1_matches_onnxruntime() -> None:
    body = oh.make_graph(
        [oh.make_node("Add", ["s_in", "x"], ["s_out"]), oh.make_node("Identity", ["s_out"], ["z"])],
        "body",
        [_vi("s_in", F, [3]), _vi("x", F, [3])],
        [_vi("s_out", F, [3]), _vi("z", F, [3])],
    )
    node = oh.make_node(
        "Scan",
        ["s0", "xs"],
        ["s", "zs"],
        num_scan_inputs=1,
        body=body,
        scan_input_axes=[1],
        scan_input_directions=[1],
        scan_output_axes=[1],
    )
    model = _model(
        [node], [_vi("s0", F, [3]), _vi("xs", F, [3, 5])], [_vi("s", F, [3]), _vi("zs", F, [3, 5])]
    )
    assert_matches(model, {"s0": rand(3), "xs": rand(3, 5)})


def test_loop_with_runtime_trip_count_takes_declared_shapes_and_reads_outer_value() -> None:
    """y = y + w each iteration (w from outside the loop); the scan output stacks every y."""
    body = oh.make_graph(
        [
            oh.make_node("Identity", ["cond_in"], ["cond_out"]),
            oh.make_node("Add", ["y_in", "w"], ["y_out"]),
            oh.make_node("Identity", ["y_out"], ["scan"]),
        ],
        "body",
        [
            _vi("i", TensorProto.INT64, []),
            _vi("cond_in", TensorProto.BOOL, []),
            _vi("y_in", F, [2]),
        ],
        [_vi("cond_out", TensorProto.BOOL, []), _vi("y_out", F, [2]), _vi("scan", F, [2])],
    )
    model = _model(
        [
            oh.make_node("Neg", ["v"], ["w"]),
            oh.make_node("Loop", ["n", "", "y0"], ["y", "ys"], body=body),
        ],
        [_vi("n", TensorProto.INT64, []), _vi("y0", F, [2]), _vi("v", F, [2])],
        [_vi("y", F, [2]), _vi("ys", F, [3, 2])],
    )
    assert_matches(model, {"n": np.array(3, np.int64), "y0": rand(2), "v": rand(2)})


def test_an_unsupported_op_inside_a_body_is_an_unsupported_operator_error_naming_it() -> None:
    then = oh.make_graph(
        [oh.make_node("Frobnicate", ["a"], ["t"], domain="com.example")],
        "then",
        [],
        [_vi("t", F, [2])],
    )
    other = oh.make_graph([oh.make_node("Identity", ["a"], ["e"])], "else", [], [_vi("e", F, [2])])
    model = _model(
        [oh.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)],
        [_vi("a", F, [2]), _vi("c", TensorProto.BOOL, [])],
        [_vi("y", F, [2])],
        extra_opsets={"com.example": 1},
    )
    with pytest.raises(CompileError) as info:
        compile_model(model, ["-aic-num-cores=1"])
    assert info.value.code == "unsupported_operator"
    assert "Frobnicate" in info.value.message


def _flex(**attrs: Any) -> onnx.NodeProto:
    return oh.make_node("FlexAttention", ["Q", "K", "V"], ["Y"], domain="ai.onnx.preview", **attrs)


def _flex_model(node: onnx.NodeProto, hq: int = 4, hkv: int = 2) -> onnx.ModelProto:
    return _model(
        [node],
        [_vi("Q", F, [1, hq, 3, 8]), _vi("K", F, [1, hkv, 5, 8]), _vi("V", F, [1, hkv, 5, 6])],
        [_vi("Y", F, [1, hq, 3, 6])],
        opset=26,
        extra_opsets={"ai.onnx.preview": 1},
    )


def _modifier(name: str, op: str, constant: float) -> onnx.GraphProto:
    dims = ["B", "H", "L", "S"]
    return oh.make_graph(
        [oh.make_node(op, ["x", "c"], ["y"])],
        name,
        [oh.make_tensor_value_info("x", F, dims)],
        [oh.make_tensor_value_info("y", F, dims)],
        initializer=[onnx.numpy_helper.from_array(np.array(constant, np.float32), "c")],
    )


def test_flexattention_gqa_with_score_mod_and_prob_mod_matches_reference() -> None:
    node = _flex(
        scale=0.3,
        score_mod=_modifier("score_mod", "Mul", 0.5),
        prob_mod=_modifier("prob_mod", "Add", 0.25),
    )
    feeds = {"Q": rand(1, 4, 3, 8), "K": rand(1, 2, 5, 8), "V": rand(1, 2, 5, 6)}
    assert_matches(_flex_model(node), feeds, oracle="reference", rtol=1e-5, atol=1e-6)


def test_flexattention_score_mod_changing_the_shape_is_rejected() -> None:
    dims = ["B", "H", "L", "S"]
    bad = oh.make_graph(
        [oh.make_node("ReduceSum", ["x"], ["y"], keepdims=1)],
        "score_mod",
        [oh.make_tensor_value_info("x", F, dims)],
        [oh.make_tensor_value_info("y", F, None)],
    )
    feeds = {"Q": rand(1, 4, 3, 8), "K": rand(1, 2, 5, 8), "V": rand(1, 2, 5, 6)}
    result = compile_model(_flex_model(_flex(score_mod=bad)), ["-aic-num-cores=1"])
    try:
        with pytest.raises(CompileError, match="score_mod turned shape"):
            run_qpc(result.qpc_path, feeds)
    finally:
        result.cleanup()


def test_loop_body_with_a_nested_if_reading_both_scopes_matches_onnxruntime() -> None:
    """The If reads y_in (the loop body's) and w, zero (the main graph's)."""
    then = oh.make_graph(
        [oh.make_node("Add", ["y_in", "w"], ["t"])], "then", [], [_vi("t", F, [2])]
    )
    other = oh.make_graph(
        [oh.make_node("Sub", ["y_in", "w"], ["e"])], "else", [], [_vi("e", F, [2])]
    )
    two = oh.make_tensor("two", TensorProto.INT64, [], [2])
    body = oh.make_graph(
        [
            oh.make_node("Identity", ["cond_in"], ["cond_out"]),
            oh.make_node("Constant", [], ["two"], value=two),
            oh.make_node("Mod", ["i", "two"], ["m"]),
            oh.make_node("Equal", ["m", "zero"], ["even"]),
            oh.make_node("If", ["even"], ["y_out"], then_branch=then, else_branch=other),
            oh.make_node("Mul", ["y_out", "y_out"], ["sq"]),
        ],
        "body",
        [
            _vi("i", TensorProto.INT64, []),
            _vi("cond_in", TensorProto.BOOL, []),
            _vi("y_in", F, [2]),
        ],
        [_vi("cond_out", TensorProto.BOOL, []), _vi("y_out", F, [2]), _vi("sq", F, [2])],
    )
    zero = oh.make_tensor("zero", TensorProto.INT64, [], [0])
    model = _model(
        [
            oh.make_node("Relu", ["v"], ["w"]),
            oh.make_node("Constant", [], ["zero"], value=zero),
            oh.make_node("Loop", ["n", "", "y0"], ["y", "ys"], body=body),
        ],
        [_vi("n", TensorProto.INT64, []), _vi("y0", F, [2]), _vi("v", F, [2])],
        [_vi("y", F, [2]), _vi("ys", F, [5, 2])],
    )
    assert_matches(model, {"n": np.array(5, np.int64), "y0": rand(2), "v": rand(2)})
