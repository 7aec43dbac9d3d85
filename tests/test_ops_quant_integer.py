"""MatMulInteger, ConvInteger, QLinearMatMul and QLinearConv through the whole path (compile ->
QPC -> run on 1 and 4 cores) against ONNX Runtime, or onnx.reference where ORT lacks a form
(per-row A parameters, float16 scales, per-channel ConvInteger zero points); plus tile-by-tile
reassembly for the tiling rules and the checks that reject bad parameter shapes."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnx.helper as oh
import pytest

from compiler_core.compile import compile_model
from compiler_core.errors import CompileError
from compiler_core.ops import REGISTRY
from tests.op_checks import assert_matches, one_node_model, run_compiled, run_reference
from tests.ort_int8 import ort_int8_saturates
from tests.test_ops_heavy import assemble, check, node_info

RNG = np.random.default_rng(7)


def q(*shape: int, dtype: Any = np.uint8) -> np.ndarray:
    info = np.iinfo(dtype)
    return RNG.integers(info.min, int(info.max) + 1, size=shape).astype(dtype)


def f(*values: float, dtype: Any = np.float32) -> np.ndarray:
    return np.array(values, dtype=dtype)


def qlinear_matmul_model(feeds: dict[str, np.ndarray], out_shape: tuple[int, ...], opset: int):
    names = ["a", "a_scale", "a_zp", "b", "b_scale", "b_zp", "y_scale", "y_zp"]
    node = oh.make_node("QLinearMatMul", names, ["y"])
    return one_node_model(node, feeds, {"y": (feeds["y_zp"].dtype, out_shape)}, opset=opset)


def qlinear_matmul_feeds(a, b, scales, zeros, y_zp) -> dict[str, np.ndarray]:
    a_scale, b_scale, y_scale = scales
    a_zp, b_zp = zeros
    return dict(
        a=a, a_scale=a_scale, a_zp=a_zp, b=b, b_scale=b_scale, b_zp=b_zp, y_scale=y_scale, y_zp=y_zp
    )


# ---------------------------------------------------------------------------------------------
# QLinearMatMul


def test_qlinearmatmul_uint8_per_tensor_matches_onnxruntime():
    feeds = qlinear_matmul_feeds(
        q(6, 5),
        q(5, 7),
        (f(0.02), f(0.03), f(0.05)),
        (np.array(120, np.uint8), np.array(130, np.uint8)),
        np.array(128, np.uint8),
    )
    assert_matches(qlinear_matmul_model(feeds, (6, 7), 10), feeds)


def test_qlinearmatmul_int8_batched_a_with_2d_b_matches_onnxruntime():
    feeds = qlinear_matmul_feeds(
        q(2, 3, 4, dtype=np.int8),
        q(4, 5, dtype=np.int8),
        (f(0.05), f(0.04), f(0.1)),
        (np.array(-3, np.int8), np.array(2, np.int8)),
        np.array(-5, np.int8),
    )
    assert_matches(qlinear_matmul_model(feeds, (2, 3, 5), 10), feeds)


def test_qlinearmatmul_saturates_to_the_output_type():
    # A tiny y_scale drives most results past [0, 255]: they must clip, not wrap.
    feeds = qlinear_matmul_feeds(
        q(4, 6),
        q(6, 3),
        (f(0.5), f(0.5), f(0.01)),
        (np.array(128, np.uint8), np.array(128, np.uint8)),
        np.array(100, np.uint8),
    )
    model = qlinear_matmul_model(feeds, (4, 3), 10)
    assert_matches(model, feeds)
    (want,) = run_reference(model, feeds)
    assert (want == 0).any() and (want == 255).any()


def test_qlinearmatmul_per_row_a_and_per_column_b_parameters_match_reference():
    feeds = qlinear_matmul_feeds(
        q(4, 5),
        q(5, 3),
        (f(0.01, 0.02, 0.03, 0.04).reshape(4, 1), f(0.05, 0.06, 0.07), f(0.02)),
        (q(4, 1), q(3)),
        np.array(10, np.uint8),
    )
    model = qlinear_matmul_model(feeds, (4, 3), 21)
    assert_matches(model, feeds, oracle="reference")
    # The spec's 1-D [M] form of A's parameters means the same (the reference only takes
    # [M, 1], so its answer on that form is the oracle).
    (want,) = run_reference(model, feeds)
    flat = {**feeds, "a_scale": feeds["a_scale"].ravel(), "a_zp": feeds["a_zp"].ravel()}
    for cores in (1, 4):
        (got,) = run_compiled(qlinear_matmul_model(flat, (4, 3), 21), flat, cores)
        np.testing.assert_array_equal(got, want)


def test_qlinearmatmul_float16_scales_match_reference():
    feeds = qlinear_matmul_feeds(
        q(2, 3, 4, dtype=np.int8),
        q(2, 4, 3, dtype=np.int8),
        (f(0.07, dtype=np.float16), f(0.03, dtype=np.float16), f(0.09, dtype=np.float16)),
        (np.array([1], np.int8), np.array([-1], np.int8)),
        np.array([0], np.int8),
    )
    assert_matches(qlinear_matmul_model(feeds, (2, 3, 3), 21), feeds, oracle="reference")


def test_qlinearmatmul_tiles_with_per_row_and_per_column_parameters_reassemble():
    feeds = qlinear_matmul_feeds(
        q(2, 5, 4),
        q(2, 4, 6),
        (np.abs(RNG.standard_normal((2, 5, 1))).astype(np.float32) * 0.1 + 0.01, f(0.03), f(0.05)),
        (q(2, 5, 1), q(2, 1, 6)),
        np.array(128, np.uint8),
    )
    feeds["b_scale"] = np.linspace(0.01, 0.06, 12, dtype=np.float32).reshape(2, 1, 6)
    model = qlinear_matmul_model(feeds, (2, 5, 6), 21)
    (want,) = run_reference(model, feeds)
    inputs = list(feeds.values())
    info = node_info(model.graph.node[0], inputs, [want], 21)
    axes = REGISTRY.lookup("QLinearMatMul", opset=21).split_axes(info)
    assert axes == [1, 2, 0]
    for axis_set in [[1], [2], [0], axes]:
        np.testing.assert_array_equal(assemble(info, inputs, axis_set), want, str(axis_set))


def test_qlinearmatmul_per_row_b_scale_is_rejected_naming_the_input():
    feeds = qlinear_matmul_feeds(
        q(4, 5),
        q(5, 3),
        (f(0.01), f(0.1, 0.2, 0.3, 0.4, 0.5), f(0.02)),
        (np.array(0, np.uint8), np.zeros(5, np.uint8)),
        np.array(10, np.uint8),
    )
    model = qlinear_matmul_model(feeds, (4, 3), 21)
    with pytest.raises(CompileError) as err:
        compile_model(model.SerializeToString(), ["-aic-num-cores=1"])
    assert err.value.code == "invalid_model"
    assert "input 4" in err.value.message and "[N] or [..., 1, N]" in err.value.message


# ---------------------------------------------------------------------------------------------
# MatMulInteger


def test_matmulinteger_per_column_b_zero_point_matches_onnxruntime():
    node = oh.make_node("MatMulInteger", ["A", "B", "a_zp", "b_zp"], ["Y"])
    feeds = {"A": q(5, 6), "B": q(6, 4, dtype=np.int8), "a_zp": np.array(7, np.uint8)}
    feeds["b_zp"] = q(4, dtype=np.int8)
    model = one_node_model(node, feeds, {"Y": (np.int32, (5, 4))}, opset=10)
    assert_matches(model, feeds)


def test_matmulinteger_without_zero_points_batched_matches_onnxruntime():
    node = oh.make_node("MatMulInteger", ["A", "B"], ["Y"])
    feeds = {"A": q(3, 2, 4, dtype=np.int8), "B": q(3, 4, 5, dtype=np.int8)}
    model = one_node_model(node, feeds, {"Y": (np.int32, (3, 2, 5))}, opset=10)
    assert_matches(model, feeds)


def test_matmulinteger_overflowing_sum_wraps_like_int32_accumulation():
    k = 40_000  # 40,000 * 255 * 255 > 2**31
    node = oh.make_node("MatMulInteger", ["A", "B"], ["Y"])
    feeds = {"A": np.full((1, k), 255, np.uint8), "B": np.full((k, 2), 255, np.uint8)}
    model = one_node_model(node, feeds, {"Y": (np.int32, (1, 2))}, opset=10)
    assert_matches(model, feeds, oracle="reference", cores=(1,))
    (want,) = run_reference(model, feeds)
    assert want[0, 0] == np.int64(k * 255 * 255) - 2**32


# ---------------------------------------------------------------------------------------------
# ConvInteger


def conv_integer_model(feeds: dict[str, np.ndarray], out_shape, **attrs: Any) -> onnx.ModelProto:
    node = oh.make_node("ConvInteger", list(feeds), ["y"], **attrs)
    return one_node_model(node, feeds, {"y": (np.int32, out_shape)}, opset=10)


def test_convinteger_padding_reads_as_the_zero_point_matches_onnxruntime():
    feeds = {"x": q(1, 3, 5, 5), "w": q(4, 3, 3, 3), "x_zp": np.array(100, np.uint8)}
    model = conv_integer_model(feeds, (1, 4, 3, 3), pads=[1, 1, 1, 1], strides=[2, 2])
    assert_matches(model, feeds)


def test_convinteger_grouped_with_per_channel_w_zero_point_matches_reference():
    feeds = {
        "x": q(2, 4, 6, 5, dtype=np.int8),
        "w": q(6, 2, 2, 3, dtype=np.int8),
        "x_zp": np.array(-4, np.int8),
        "w_zp": q(6, dtype=np.int8),
    }
    model = conv_integer_model(feeds, (2, 6, 5, 5), group=2, pads=[0, 1, 0, 1])
    assert_matches(model, feeds, oracle="reference")


# ---------------------------------------------------------------------------------------------
# QLinearConv


def qlinear_conv_inputs(bias: bool) -> list[np.ndarray]:
    inputs = [
        q(2, 3, 7, 6),
        f(0.02),
        np.array(128, np.uint8),
        q(5, 3, 3, 2, dtype=np.int8),
        f(0.01, 0.02, 0.03, 0.015, 0.025),
        np.zeros(5, np.int8),
        f(0.04),
        np.array(120, np.uint8),
    ]
    if bias:
        inputs.append(RNG.integers(-3000, 3000, size=5).astype(np.int32))
    return inputs


# ORT's QLinearConv saturates uint8 x int8 pair sums on x86 CPUs without VNNI
# (tests/ort_int8.py): there the oracle is onnx.reference, the spec's exact arithmetic. It
# rescales the int32 sums in float64 where ORT and we use float32, so a sum on a rounding edge
# may land one step apart: one step is allowed against it, none against ORT.
QLINEARCONV_ORACLE = "reference" if ort_int8_saturates() else "onnxruntime"
QLINEARCONV_STEPS = 1 if ort_int8_saturates() else 0


def test_qlinearconv_per_channel_scales_with_bias_matches_onnxruntime_and_tiles():
    check(
        "QLinearConv",
        qlinear_conv_inputs(bias=True),
        opset=10,
        rtol=0,
        atol=QLINEARCONV_STEPS,
        pads=[1, 0, 1, 1],
        strides=[2, 1],
        oracle=QLINEARCONV_ORACLE,
    )


def test_qlinearconv_whole_path_matches_onnxruntime():
    inputs = qlinear_conv_inputs(bias=False)
    names = ["x", "x_scale", "x_zp", "w", "w_scale", "w_zp", "y_scale", "y_zp"]
    feeds = dict(zip(names, inputs, strict=True))
    node = oh.make_node("QLinearConv", names, ["y"], auto_pad="SAME_UPPER")
    model = one_node_model(node, feeds, {"y": (np.uint8, (2, 5, 7, 6))}, opset=10)
    assert_matches(model, feeds, oracle=QLINEARCONV_ORACLE)


def test_qlinearconv_per_channel_x_scale_is_rejected():
    inputs = qlinear_conv_inputs(bias=False)
    inputs[1] = f(0.1, 0.2, 0.3)
    names = ["x", "x_scale", "x_zp", "w", "w_scale", "w_zp", "y_scale", "y_zp"]
    node = oh.make_node("QLinearConv", names, ["y"])
    feeds = dict(zip(names, inputs, strict=True))
    model = one_node_model(node, feeds, {"y": (np.uint8, (2, 5, 5, 5))}, opset=10)
    with pytest.raises(CompileError) as err:
        compile_model(model.SerializeToString(), ["-aic-num-cores=1"])
    assert err.value.code == "invalid_model" and "input 1" in err.value.message


def test_convinteger_tiles_with_per_channel_w_zero_point_reassemble():
    feeds = {"x": q(2, 3, 5, 6), "w": q(4, 3, 2, 2), "x_zp": q(), "w_zp": q(4)}
    model = conv_integer_model(feeds, (2, 4, 5, 6), pads=[1, 1, 0, 0])
    (want,) = run_reference(model, feeds)
    inputs = list(feeds.values())
    info = node_info(model.graph.node[0], inputs, [want], 10)
    axes = REGISTRY.lookup("ConvInteger", opset=10).split_axes(info)
    assert axes == [0, 1, 2, 3]
    for axis_set in [[1], [2], [3], axes]:
        np.testing.assert_array_equal(assemble(info, inputs, axis_set), want, str(axis_set))
