"""RotaryEmbedding (opset 23) and BitCast (opset 26) through the whole path (compile -> QPC ->
run on 1 and 4 cores) against ONNX Runtime, tile-by-tile reassembly of their tiling rules, and
the checks that reject bad attributes at compile time. ONNX Runtime 1.32 lacks BitCast for most
type pairs, so BitCast's oracle is onnx.reference (ORT serves the float32 -> int32 tiling check)."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnx.helper as oh
import pytest

from compiler_core.compile import compile_model
from compiler_core.errors import CompileError
from compiler_core.ops import REGISTRY
from tests.op_checks import assert_matches, one_node_model, rand, run_compiled, run_reference
from tests.test_ops_heavy import check, node_info

# ---------------------------------------------------------------------------------------------
# RotaryEmbedding


def rotary_model(feeds: dict[str, np.ndarray], **attrs: Any) -> onnx.ModelProto:
    node = oh.make_node("RotaryEmbedding", list(feeds), ["y"], **attrs)
    x = feeds["x"]
    return one_node_model(node, feeds, {"y": (x.dtype, x.shape)}, opset=23)


def angles(rows: tuple[int, ...], half: int, dtype: Any = np.float32) -> tuple[np.ndarray, ...]:
    theta = np.random.default_rng(5).uniform(0, 2 * np.pi, size=(*rows, half))
    return np.cos(theta).astype(dtype), np.sin(theta).astype(dtype)


def test_rotary_embedding_4d_with_int64_position_ids_matches_onnxruntime():
    cos, sin = angles((20,), 4)
    ids = np.array([[0, 5, 19, 3], [7, 7, 1, 12]], np.int64)
    feeds = {"x": rand(2, 3, 4, 8), "cos": cos, "sin": sin, "ids": ids}
    assert_matches(rotary_model(feeds), feeds)


def test_rotary_embedding_3d_interleaved_partial_rotation_matches_onnxruntime():
    cos, sin = angles((10,), 2)
    ids = np.array([[1, 2, 3], [9, 0, 4]], np.int64)
    feeds = {"x": rand(2, 3, 3 * 6), "cos": cos, "sin": sin, "ids": ids}
    model = rotary_model(feeds, num_heads=3, interleaved=1, rotary_embedding_dim=4)
    assert_matches(model, feeds)


def test_rotary_embedding_per_position_caches_without_ids_match_onnxruntime():
    cos, sin = angles((2, 5), 3)
    feeds = {"x": rand(2, 4, 5, 6), "cos": cos, "sin": sin}
    assert_matches(rotary_model(feeds), feeds)


def test_rotary_embedding_float16_matches_onnxruntime():
    cos, sin = angles((8,), 4, np.float16)
    ids = np.array([[0, 1, 2], [7, 6, 5]], np.int64)
    feeds = {"x": rand(2, 2, 3, 8, dtype=np.float16), "cos": cos, "sin": sin, "ids": ids}
    assert_matches(rotary_model(feeds), feeds, rtol=2e-3, atol=2e-3)


def test_rotary_embedding_tiles_along_batch_heads_and_sequence():
    cos, sin = angles((9,), 4)
    ids = np.array([[0, 8, 2, 3, 1], [4, 4, 5, 6, 7], [1, 1, 1, 1, 1]], np.int64)
    check("RotaryEmbedding", [rand(3, 4, 5, 8), cos, sin, ids], opset=23, interleaved=1)
    cos3, sin3 = angles((3, 5), 2)
    check(
        "RotaryEmbedding",
        [rand(3, 5, 12), cos3, sin3],
        opset=23,
        num_heads=2,
        rotary_embedding_dim=4,
    )


@pytest.mark.parametrize(
    ("attrs", "message"),
    [
        ({"rotary_embedding_dim": 3}, "rotary_embedding_dim 3 must be even"),
        ({"rotary_embedding_dim": 10}, "at most 8"),
        ({}, "cos_cache has shape [6, 3], expected (positions, 4)"),
    ],
)
def test_rotary_embedding_bad_attributes_or_cache_are_rejected(attrs, message):
    half = 3 if not attrs else (attrs["rotary_embedding_dim"] // 2)
    cos, sin = angles((6,), max(half, 1))
    feeds = {"x": rand(1, 2, 3, 8), "cos": cos, "sin": sin, "ids": np.zeros((1, 3), np.int64)}
    with pytest.raises(CompileError) as err:
        compile_model(rotary_model(feeds, **attrs).SerializeToString(), ["-aic-num-cores=1"])
    assert err.value.code == "invalid_model" and message in err.value.message


def test_rotary_embedding_3d_without_num_heads_is_rejected():
    cos, sin = angles((6,), 4)
    feeds = {"x": rand(1, 3, 16), "cos": cos, "sin": sin, "ids": np.zeros((1, 3), np.int64)}
    with pytest.raises(CompileError) as err:
        compile_model(rotary_model(feeds).SerializeToString(), ["-aic-num-cores=1"])
    # ONNX shape inference (run by the importer) refuses it first; our lowering check backs it.
    assert "num_heads" in err.value.message
    info = node_info(rotary_model(feeds).graph.node[0], list(feeds.values()), [feeds["x"]], 23)
    with pytest.raises(CompileError) as err:
        REGISTRY.lookup("RotaryEmbedding", opset=23).split_axes(info)
    assert err.value.code == "invalid_model" and "needs num_heads" in err.value.message


# ---------------------------------------------------------------------------------------------
# BitCast


def bitcast_model(x: np.ndarray, to: Any) -> onnx.ModelProto:
    node = oh.make_node("BitCast", ["x"], ["y"], to=oh.np_dtype_to_tensor_dtype(np.dtype(to)))
    return one_node_model(node, {"x": x}, {"y": (to, x.shape)}, opset=26)


@pytest.mark.parametrize(
    ("x", "to"),
    [
        (np.array([1.5, -0.0, np.inf, -3e38], np.float32), np.int32),
        (np.array([[1, -1], [2**62, -(2**63)]], np.int64), np.float64),
        (np.array([1.0, -2.5, 65504.0], np.float16), np.int16),
        (np.array([0, 1, 127, 128, 255], np.uint8), np.int8),
        (np.array([True, False, True]), np.uint8),
        (np.array(3.25, np.float64), np.uint64),
    ],
    ids=["f32-i32", "i64-f64", "f16-i16", "u8-i8", "bool-u8", "scalar-f64-u64"],
)
def test_bitcast_reinterprets_bytes_like_the_reference(x, to):
    assert_matches(bitcast_model(x, to), {"x": x}, oracle="reference", rtol=0, atol=0)


def test_bitcast_keeps_nan_payloads_and_negative_zero_bit_exact():
    bits = np.array([0x7FC00001, 0xFFFFFFFF, 0x80000000, 0x7F800000], np.uint32)
    model = bitcast_model(bits, np.float32)
    (want,) = run_reference(model, {"x": bits})
    for cores in (1, 4):
        (got,) = run_compiled(model, {"x": bits}, cores)
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_bitcast_tiles_along_every_axis():
    check("BitCast", [rand(3, 4, 5)], opset=26, rtol=0, atol=0, to=onnx.TensorProto.INT32)


def test_bitcast_to_a_different_width_is_rejected():
    node = oh.make_node("BitCast", ["x"], ["y"], to=onnx.TensorProto.INT64)
    model = one_node_model(node, {"x": rand(4)}, {"y": (np.int64, (4,))}, opset=26)
    with pytest.raises(CompileError) as err:
        compile_model(model.SerializeToString(), ["-aic-num-cores=1"])
    # ONNX shape inference (run by the importer) refuses it first; our lowering check backs it.
    assert "bit-width" in err.value.message
    info = node_info(node, [rand(4)], [np.zeros(4, np.int64)], 26)
    with pytest.raises(CompileError) as err:
        REGISTRY.lookup("BitCast", opset=26).split_axes(info)
    assert err.value.code == "invalid_model" and "same bit width" in err.value.message
