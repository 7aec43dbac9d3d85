"""Attention, quantisation, signal, GroupNormalization and CenterCropPad kernels against ONNX
Runtime: one-node models, checked whole and (where the op tiles) reassembled from tiles."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from onnx import TensorProto, helper

from compiler_core.errors import CompileError
from compiler_core.ops import REGISTRY, TileCtx
from tests.op_checks import (
    assert_matches,
    one_node_model,
    run_compiled,
    run_onnxruntime,
    run_reference,
)
from tests.test_ops_heavy import check, node_info, rand, run_ort

# ---------------------------------------------------------------------------------------------
# Attention


def test_attention_4d_matches_onnxruntime():
    check(
        "Attention",
        [rand(2, 3, 4, 8), rand(2, 3, 6, 8), rand(2, 3, 6, 5)],
        opset=23,
        expect_split=False,
    )


def test_attention_3d_grouped_query_with_cache_returns_present_key_and_value():
    q, k, v = rand(2, 3, 4 * 6), rand(2, 3, 2 * 6), rand(2, 3, 2 * 6)
    past_k, past_v = rand(2, 2, 5, 6), rand(2, 2, 5, 6)
    mask = rand(3, 8)
    check(
        "Attention",
        [q, k, v, mask, past_k, past_v],
        opset=23,
        outputs=3,
        expect_split=False,
        q_num_heads=4,
        kv_num_heads=2,
    )


def test_attention_causal_with_bool_mask_and_explicit_scale():
    mask = np.random.default_rng(3).random((1, 1, 5, 5)) > 0.3
    mask[..., 0] = True
    check(
        "Attention",
        [rand(1, 2, 5, 4), rand(1, 2, 5, 4), rand(1, 2, 5, 4), mask],
        opset=23,
        expect_split=False,
        is_causal=1,
        scale=0.3,
    )


def test_attention_causal_with_past_is_bottom_right_aligned():
    check(
        "Attention",
        [
            rand(1, 2, 3, 4),
            rand(1, 2, 3, 4),
            rand(1, 2, 3, 4),
            None,
            rand(1, 2, 4, 4),
            rand(1, 2, 4, 4),
        ],
        opset=23,
        outputs=3,
        expect_split=False,
        is_causal=1,
    )


@pytest.mark.parametrize("mode", [0, 1, 2, 3])
def test_attention_qk_matmul_output_modes_with_softcap(mode):
    check(
        "Attention",
        [rand(1, 2, 3, 4), rand(1, 2, 5, 4), rand(1, 2, 5, 4), rand(3, 5)],
        opset=23,
        outputs=4,
        expect_split=False,
        softcap=2.0,
        qk_matmul_output_mode=mode,
    )


def test_attention_fully_masked_row_gives_zeros():
    mask = np.ones((3, 4), bool)
    mask[1] = False
    inputs = [rand(1, 1, 3, 4), rand(1, 1, 4, 4), rand(1, 1, 4, 4), mask]
    info = check("Attention", inputs, opset=23, expect_split=False)
    y = REGISTRY.lookup("Attention", opset=23).compute(info, inputs, TileCtx.whole(info))[0]
    assert (y[0, 0, 1] == 0).all()


# ---------------------------------------------------------------------------------------------
# Quantisation


@pytest.mark.parametrize("cores", [1, 4])
def test_attention_unnamed_outputs_before_a_named_one_are_computed_and_dropped(cores):
    """present_key/present_value left unnamed in the middle, qk_matmul_output named after
    them: the kernel still runs, only the named outputs reach memory."""
    q, k, v = rand(1, 2, 3, 4), rand(1, 2, 5, 4), rand(1, 2, 5, 4)
    node = helper.make_node(
        "Attention", ["q", "k", "v"], ["y", "", "", "qk"], qk_matmul_output_mode=1
    )
    feeds = {"q": q, "k": k, "v": v}
    model = one_node_model(
        node,
        feeds,
        {"y": (np.float32, [1, 2, 3, 4]), "qk": (np.float32, [1, 2, 3, 5])},
        opset=23,
    )
    expected = run_onnxruntime(model, feeds)
    got = run_compiled(model, feeds, cores)
    for want, have in zip(expected, got, strict=True):
        np.testing.assert_allclose(have, want, rtol=1e-5, atol=1e-6)


def test_quantize_per_tensor_uint8_without_zero_point_rounds_half_to_even():
    x = np.array([[-1.0, 0.5, 1.5, 2.5], [300.0, 254.6, 3.49, 7.0]], np.float32)
    check("QuantizeLinear", [x, np.array(1.0, np.float32)], opset=21)


def test_quantize_per_axis_int8_tiles_like_whole():
    check(
        "QuantizeLinear",
        [rand(2, 3, 5) * 50, np.array([0.5, 1.0, 2.0], np.float32), np.array([-3, 0, 7], np.int8)],
        opset=21,
        axis=1,
    )


def test_quantize_blocked_int16_tiles_like_whole():
    scale = np.abs(rand(3, 3)) * 0.01 + 0.001
    check(
        "QuantizeLinear",
        [rand(3, 7) * 10, scale, np.zeros((3, 3), np.int16)],
        opset=21,
        axis=1,
        block_size=3,
    )


def test_dequantize_per_axis_and_blocked_tile_like_whole():
    x = np.random.default_rng(5).integers(0, 255, (2, 4, 3)).astype(np.uint8)
    check(
        "DequantizeLinear",
        [x, np.array([0.1, 0.2, 0.3, 0.4], np.float32), np.array([1, 2, 3, 128], np.uint8)],
        opset=21,
        axis=1,
    )
    xb = np.random.default_rng(6).integers(-128, 127, (4, 6)).astype(np.int8)
    check(
        "DequantizeLinear",
        [xb, np.abs(rand(4, 3)), np.ones((4, 3), np.int8)],
        opset=21,
        axis=1,
        block_size=2,
    )


def test_dequantize_int32_per_tensor():
    x = np.arange(-6, 6, dtype=np.int32).reshape(3, 4) * 1000
    check("DequantizeLinear", [x, np.array(0.25, np.float32)], opset=13)


def test_quantize_to_float8_is_rejected_at_compile_time():
    node = helper.make_node("QuantizeLinear", ["x", "s", "z"], ["y"])
    x = rand(2, 3)
    info = node_info(
        node, [x, np.array(1, np.float32), np.array(0, np.uint8)], [np.zeros((2, 3), np.uint8)], 21
    )
    bad = dataclasses.replace(info, out_dtypes=("float8_e4m3fn",))
    with pytest.raises(CompileError) as err:
        REGISTRY.lookup("QuantizeLinear", opset=21).split_axes(bad)
    assert err.value.code == "unsupported_dtype"


def test_dynamic_quantize_linear_matches_onnxruntime():
    check("DynamicQuantizeLinear", [rand(3, 4) * 5], opset=11, outputs=3, expect_split=False)
    check("DynamicQuantizeLinear", [np.abs(rand(6)) + 1], opset=11, outputs=3, expect_split=False)


# ---------------------------------------------------------------------------------------------
# Signal


@pytest.mark.parametrize("op", ["HannWindow", "HammingWindow", "BlackmanWindow"])
@pytest.mark.parametrize("periodic", [0, 1])
def test_windows_periodic_and_symmetric(op, periodic):
    check(op, [np.array(10, np.int64)], opset=17, expect_split=False, periodic=periodic, atol=1e-6)


def test_window_output_datatype_double():
    check(
        "HannWindow",
        [np.array(7, np.int32)],
        opset=17,
        expect_split=False,
        output_datatype=TensorProto.DOUBLE,
        atol=1e-12,
    )


def test_dft_forward_complex_and_inverse():
    check("DFT", [rand(2, 8, 3, 2)], opset=17, expect_split=False, axis=1, atol=1e-4)
    check("DFT", [rand(2, 8, 3, 2)], opset=17, expect_split=False, axis=2, inverse=1, atol=1e-5)


def test_dft_onesided_real_with_length_and_axis_input():
    check(
        "DFT",
        [rand(1, 9, 4, 1), np.array(12, np.int64), np.array(1, np.int64)],
        opset=20,
        consts=(1, 2),
        expect_split=False,
        onesided=1,
        atol=1e-4,
    )


# ---------------------------------------------------------------------------------------------
# GroupNormalization and CenterCropPad


def test_group_normalization_per_channel_scale_tiles_along_batch():
    check(
        "GroupNormalization",
        [rand(3, 6, 4, 5), rand(6), rand(6)],
        opset=21,
        num_groups=3,
        epsilon=1e-3,
    )


def test_group_normalization_opset18_per_group_scale():
    check("GroupNormalization", [rand(2, 4, 7), rand(2), rand(2)], opset=18, num_groups=2)


def test_center_crop_pad_crops_and_pads_listed_axes():
    x = rand(5, 6, 3)
    check(
        "CenterCropPad",
        [x, np.array([3, 9], np.int64)],
        opset=18,
        consts=(1,),
        expect_split=False,
        axes=[0, -2],
    )
    check(
        "CenterCropPad",
        [x, np.array([4, 4, 3], np.int64)],
        opset=18,
        consts=(1,),
        expect_split=False,
    )


def test_center_crop_pad_keeps_integer_types():
    x = np.arange(20, dtype=np.int32).reshape(4, 5)
    node = helper.make_node("CenterCropPad", ["x", "s"], ["y"])
    shape = np.array([3, 8], np.int64)
    expected = run_ort(node, [x, shape], 18)
    info = node_info(node, [x, shape], expected, 18, consts=(1,))
    got = REGISTRY.lookup("CenterCropPad", opset=18).compute(info, [x, shape], TileCtx.whole(info))
    np.testing.assert_array_equal(got[0], expected[0])


def test_attention_opset25_sliding_window_with_causal():
    check(
        "Attention",
        [rand(1, 2, 6, 4), rand(1, 2, 6, 4), rand(1, 2, 6, 4)],
        opset=25,
        expect_split=False,
        is_causal=1,
        left_window_size=2,
    )


# ---------------------------------------------------------------------------------------------
# Dropout in training mode


@pytest.mark.parametrize("cores", [1, 4])
def test_training_dropout_with_a_seed_matches_the_onnx_reference_draw(cores):
    x = rand(3, 4, 5)
    ratio, training = np.array(0.75, np.float32), np.array(True)
    node = helper.make_node("Dropout", ["x", "r", "t"], ["y", "mask"], seed=7)
    feeds = {"x": x, "r": ratio, "t": training}
    model = one_node_model(
        node, feeds, {"y": (np.float32, [3, 4, 5]), "mask": (np.bool_, [3, 4, 5])}, opset=13
    )
    want = run_reference(model, feeds)
    got = run_compiled(model, feeds, cores)
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    assert 0 < got[1].sum() < got[1].size  # some dropped, some kept


def test_dropout_with_training_off_at_run_time_passes_the_data_through():
    x = rand(2, 6)
    node = helper.make_node("Dropout", ["x", "r", "t"], ["y", "mask"], seed=1)
    feeds = {"x": x, "r": np.array(0.5, np.float32), "t": np.array(False)}
    model = one_node_model(
        node, feeds, {"y": (np.float32, [2, 6]), "mask": (np.bool_, [2, 6])}, opset=13
    )
    y, mask = run_compiled(model, feeds)
    np.testing.assert_array_equal(y, x)
    assert mask.all()


# ---------------------------------------------------------------------------------------------
# Optional values


@pytest.mark.parametrize("wired", [True, False])
def test_optional_has_element_is_true_for_a_tensor_and_false_for_a_missing_input(wired):
    x = rand(4)
    node = helper.make_node("OptionalHasElement", ["x"] if wired else [""], ["has"])
    feeds = {"x": x} if wired else {}
    model = one_node_model(node, feeds, {"has": (np.bool_, [])}, opset=18)
    assert_matches(model, feeds, oracle="reference")
    assert bool(run_compiled(model, feeds)[0]) is wired


def test_optional_get_element_of_a_tensor_is_the_tensor():
    x = rand(4)
    node = helper.make_node("OptionalGetElement", ["x"], ["y"])
    model = one_node_model(node, {"x": x}, {"y": (np.float32, [4])}, opset=18)
    assert_matches(model, {"x": x}, oracle="reference")
