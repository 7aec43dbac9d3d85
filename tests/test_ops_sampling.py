"""Sampling and unpooling ops (GridSample, AffineGrid, RoiAlign, DeformConv, Col2Im,
MaxUnpool) through the whole path, against ONNX Runtime or the ONNX reference."""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import onnx
import onnx.helper as oh
import pytest

from compiler_core.compile import compile_model
from compiler_core.errors import CompileError
from tests.op_checks import assert_matches, one_node_model, rand, run_compiled, run_onnxruntime

F32 = np.float32


def _grid_sample_model(
    x: np.ndarray, grid: np.ndarray, opset: int = 20, **attrs: Any
) -> onnx.ModelProto:
    node = oh.make_node("GridSample", ["x", "grid"], ["y"], **attrs)
    out = (x.shape[0], x.shape[1], *grid.shape[1:-1])
    return one_node_model(node, {"x": x, "grid": grid}, {"y": (F32, out)}, opset=opset)


def _grid(*shape: int) -> np.ndarray:
    """Normalised positions reaching a little outside [-1, 1], to exercise padding."""
    return np.random.default_rng(7).uniform(-1.3, 1.3, shape).astype(F32)


@pytest.mark.parametrize("padding", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("align", [0, 1])
def test_gridsample_bilinear_each_padding_matches_onnxruntime(padding: str, align: int) -> None:
    x, grid = rand(2, 3, 4, 5), _grid(2, 3, 6, 2)
    model = _grid_sample_model(x, grid, padding_mode=padding, align_corners=align)
    assert_matches(model, {"x": x, "grid": grid}, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("padding", ["zeros", "border", "reflection"])
def test_gridsample_nearest_rounds_half_to_even_matches_onnxruntime(padding: str) -> None:
    x = rand(1, 2, 4, 4)
    # Positions exactly halfway between pixels (x = 0.5, 1.5...) plus out-of-range ones.
    grid = np.array([-1.5, -1.0, -0.5, -0.25, 0.0, 0.25, 0.5, 1.0, 1.5], dtype=F32)
    grid = np.stack(np.meshgrid(grid, grid[::-1]), axis=-1)[None].astype(F32)
    model = _grid_sample_model(x, grid, mode="nearest", padding_mode=padding)
    assert_matches(model, {"x": x, "grid": grid})


@pytest.mark.parametrize("padding", ["zeros", "border", "reflection"])
def test_gridsample_bicubic_pads_each_tap_like_onnxruntime(padding: str) -> None:
    x, grid = rand(1, 2, 5, 4), _grid(1, 4, 3, 2)
    model = _grid_sample_model(x, grid, mode="cubic", padding_mode=padding)
    assert_matches(model, {"x": x, "grid": grid}, rtol=1e-4, atol=1e-5)


def test_gridsample_opset16_bilinear_and_bicubic_names_match_onnxruntime() -> None:
    x, grid = rand(1, 2, 4, 4), _grid(1, 3, 3, 2)
    for mode in ("bilinear", "bicubic"):
        model = _grid_sample_model(x, grid, opset=16, mode=mode, align_corners=1)
        assert_matches(model, {"x": x, "grid": grid}, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("padding", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_gridsample_volumetric_matches_onnxruntime(mode: str, padding: str) -> None:
    x, grid = rand(1, 2, 3, 4, 3), _grid(1, 2, 3, 2, 3)
    model = _grid_sample_model(x, grid, mode=mode, padding_mode=padding)
    assert_matches(model, {"x": x, "grid": grid}, rtol=1e-4, atol=1e-5)


def test_gridsample_volumetric_tricubic_zero_padding_matches_reference() -> None:
    """ONNX Runtime has cubic for 4-D inputs only; the reference pads like us for zeros."""
    x, grid = rand(1, 2, 3, 4, 3), _grid(1, 2, 3, 2, 3)
    model = _grid_sample_model(x, grid, mode="cubic", align_corners=1)
    assert_matches(model, {"x": x, "grid": grid}, oracle="reference", rtol=1e-4, atol=1e-5)


def test_gridsample_rejects_unknown_mode() -> None:
    x, grid = rand(1, 1, 3, 3), _grid(1, 2, 2, 2)
    model = _grid_sample_model(x, grid, mode="area")
    with pytest.raises(CompileError, match="mode 'area'"):
        compile_model(model.SerializeToString(), []).cleanup()


def _affine_grid_model(theta: np.ndarray, size: list[int], align: int) -> onnx.ModelProto:
    node = oh.make_node("AffineGrid", ["theta", "size"], ["grid"], align_corners=align)
    rank = len(size) - 2
    out = (size[0], *size[2:], rank)
    sizes = np.array(size, dtype=np.int64)
    return one_node_model(
        node,
        {"theta": theta, "size": sizes},
        {"grid": (F32, out)},
        opset=20,
        initializers={"size": sizes},
    )


@pytest.mark.parametrize("align", [0, 1])
def test_affine_grid_2d_matches_onnxruntime(align: int) -> None:
    theta = rand(2, 2, 3)
    assert_matches(_affine_grid_model(theta, [2, 3, 4, 5], align), {"theta": theta})


@pytest.mark.parametrize("align", [0, 1])
def test_affine_grid_3d_matches_onnxruntime(align: int) -> None:
    theta = rand(2, 3, 4)
    assert_matches(_affine_grid_model(theta, [2, 1, 3, 4, 5], align), {"theta": theta})


def _col2im_model(
    cols: np.ndarray, image: list[int], block: list[int], **attrs: Any
) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    node = oh.make_node("Col2Im", ["cols", "image", "block"], ["y"], **attrs)
    channels = cols.shape[1] // int(np.prod(block))
    consts = {"image": np.array(image, np.int64), "block": np.array(block, np.int64)}
    out = (cols.shape[0], channels, *image)
    model = one_node_model(
        node, {"cols": cols, **consts}, {"y": (cols.dtype, out)}, opset=18, initializers=consts
    )
    return model, {"cols": cols}


def test_col2im_strides_dilations_pads_2d_match_onnxruntime() -> None:
    # image 7x6, block 2x3, dilations (2, 1), strides (2, 1), pads 1,0 / 2,1:
    # padded 10x7 -> (10 - 3) // 2 + 1 = 4 by (7 - 3) // 1 + 1 = 5 positions.
    cols = rand(2, 3 * 6, 20)
    model, feeds = _col2im_model(
        cols, [7, 6], [2, 3], strides=[2, 1], dilations=[2, 1], pads=[1, 0, 2, 1]
    )
    assert_matches(model, feeds)


def test_col2im_3d_overlapping_blocks_match_onnxruntime() -> None:
    cols = rand(1, 2 * 8, 2 * 3 * 2)
    model, feeds = _col2im_model(cols, [3, 4, 3], [2, 2, 2])
    assert_matches(model, feeds)


def test_col2im_int32_sums_exactly_like_reference() -> None:
    cols = np.arange(1 * 4 * 9, dtype=np.int32).reshape(1, 4, 9)
    model, feeds = _col2im_model(cols, [4, 4], [2, 2])
    assert_matches(model, feeds, oracle="reference")


def test_col2im_rejects_column_count_that_does_not_fit() -> None:
    cols = rand(1, 4, 8)  # a 4x4 image with 2x2 blocks has 9 positions
    model, feeds = _col2im_model(cols, [4, 4], [2, 2])
    with pytest.raises(CompileError, match=r"should end in \(4, 9\)"):
        compile_model(model.SerializeToString(), []).cleanup()


def _max_pool_then_unpool(x: np.ndarray, output_shape: list[int] | None, **attrs: Any) -> Any:
    """MaxPool's values and indices, then a MaxUnpool model with the same attributes."""
    pool = oh.make_node("MaxPool", ["x"], ["v", "i"], **attrs)
    rank = x.ndim - 2
    unknown = cast(list[int], [None] * x.ndim)
    pooled = run_onnxruntime(
        one_node_model(
            pool,
            {"x": x},
            {"v": (F32, unknown), "i": (np.int64, unknown)},
            opset=22,
        ),
        {"x": x},
    )
    values, indices = pooled
    names = ["x", "i"] + (["shape"] if output_shape is not None else [])
    node = oh.make_node("MaxUnpool", names, ["y"], **attrs)
    feeds: dict[str, np.ndarray] = {"x": values, "i": indices}
    consts = {}
    if output_shape is not None:
        consts = {"shape": np.array(output_shape, np.int64)}
        out = output_shape
    else:
        out = list(x.shape[:2]) + [
            (values.shape[2 + k] - 1) * attrs.get("strides", [1] * rank)[k]
            - attrs.get("pads", [0] * 2 * rank)[k]
            - attrs.get("pads", [0] * 2 * rank)[rank + k]
            + attrs["kernel_shape"][k]
            for k in range(rank)
        ]
    model = one_node_model(
        node, {**feeds, **consts}, {"y": (F32, out)}, opset=22, initializers=consts
    )
    return model, feeds


def test_maxunpool_inverts_maxpool_with_pads_matches_onnxruntime() -> None:
    x = rand(2, 3, 5, 6)
    model, feeds = _max_pool_then_unpool(
        x, None, kernel_shape=[2, 3], strides=[2, 2], pads=[1, 0, 0, 1]
    )
    assert_matches(model, feeds)


def test_maxunpool_1d_and_3d_match_onnxruntime() -> None:
    for x, kernel in ((rand(1, 2, 9), [3]), (rand(1, 1, 4, 4, 4), [2, 2, 2])):
        model, feeds = _max_pool_then_unpool(x, None, kernel_shape=kernel, strides=kernel)
        assert_matches(model, feeds)


def test_maxunpool_larger_output_shape_pads_at_the_end_like_reference() -> None:
    x = rand(1, 2, 4, 4)
    model, feeds = _max_pool_then_unpool(x, [1, 2, 5, 5], kernel_shape=[2, 2], strides=[2, 2])
    assert_matches(model, feeds, oracle="reference")


def test_maxunpool_rejects_kernel_shape_of_wrong_rank() -> None:
    x = rand(1, 1, 4, 4)
    model, feeds = _max_pool_then_unpool(x, [1, 1, 4, 4], kernel_shape=[2, 2], strides=[2, 2])
    bad = [a for a in model.graph.node[0].attribute if a.name == "kernel_shape"][0]
    bad.ints[:] = [2]
    with pytest.raises(CompileError, match="kernel_shape"):
        compile_model(model.SerializeToString(), []).cleanup()


def _roi_align_model(
    x: np.ndarray, rois: np.ndarray, batch: np.ndarray, opset: int = 16, **attrs: Any
) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    node = oh.make_node("RoiAlign", ["x", "rois", "batch"], ["y"], **attrs)
    out = (rois.shape[0], x.shape[1], attrs.get("output_height", 1), attrs.get("output_width", 1))
    feeds = {"x": x, "rois": rois, "batch": batch}
    return one_node_model(node, feeds, {"y": (F32, out)}, opset=opset), feeds


ROIS = np.array(
    [[0.5, 0.5, 6.0, 4.5], [-1.5, 2.0, 3.0, 9.5], [2.2, 1.1, 2.4, 1.3], [5.0, 0.0, 9.5, 7.8]],
    dtype=F32,
)
"""Boxes inside, crossing and beyond the edge of an 8x7 image, and one smaller than a pixel."""


@pytest.mark.parametrize("ctm", ["half_pixel", "output_half_pixel"])
@pytest.mark.parametrize("mode", ["avg", "max"])
def test_roialign_modes_and_coordinates_match_onnxruntime(ctm: str, mode: str) -> None:
    x, batch = rand(2, 3, 8, 7), np.array([0, 1, 1, 0], np.int64)
    model, feeds = _roi_align_model(
        x,
        ROIS,
        batch,
        coordinate_transformation_mode=ctm,
        mode=mode,
        output_height=3,
        output_width=2,
        sampling_ratio=2,
        spatial_scale=0.9,
    )
    assert_matches(model, feeds, rtol=1e-4, atol=1e-5)


def test_roialign_adaptive_sampling_ratio_matches_onnxruntime() -> None:
    x, batch = rand(1, 2, 8, 7), np.zeros(4, np.int64)
    model, feeds = _roi_align_model(x, ROIS * 0.8, batch, output_height=2, output_width=3)
    assert_matches(model, feeds, rtol=1e-4, atol=1e-5)


def test_roialign_opset10_defaults_to_output_half_pixel_like_onnxruntime() -> None:
    x, batch = rand(1, 2, 8, 7), np.zeros(4, np.int64)
    model, feeds = _roi_align_model(x, ROIS, batch, opset=10, output_height=2, output_width=2)
    assert_matches(model, feeds, rtol=1e-4, atol=1e-5)


def test_roialign_rejects_unknown_mode() -> None:
    x, batch = rand(1, 1, 4, 4), np.zeros(4, np.int64)
    model, _ = _roi_align_model(x, ROIS, batch, mode="median")
    with pytest.raises(CompileError, match="mode 'median'"):
        compile_model(model.SerializeToString(), []).cleanup()


def _deform_conv_model(
    feeds: dict[str, np.ndarray], out: tuple[int, ...], **attrs: Any
) -> onnx.ModelProto:
    names = ["x", "w", "offset"] + [k for k in ("b", "mask") if k in feeds]
    if "mask" in feeds and "b" not in feeds:
        names.insert(3, "")
    node = oh.make_node("DeformConv", names, ["y"], **attrs)
    return one_node_model(node, feeds, {"y": (F32, out)}, opset=22)


def test_deform_conv_offsets_mask_bias_padding_stride_dilation_match_onnxruntime() -> None:
    # 6x5 input, kernel 2x3, dilation (2, 1), stride (1, 2), pads 1,0 / 0,1 -> 5x2 output.
    feeds = {
        "x": rand(2, 4, 6, 5),
        "w": rand(6, 2, 2, 3),
        "offset": rand(2, 2 * 6 * 2, 5, 2) * 1.5,
        "b": rand(6),
        "mask": np.abs(rand(2, 2 * 6, 5, 2)),
    }
    attrs = dict(strides=[1, 2], dilations=[2, 1], pads=[1, 0, 0, 1], group=2, offset_group=2)
    model = _deform_conv_model(feeds, (2, 6, 5, 2), kernel_shape=[2, 3], **attrs)
    assert_matches(model, feeds, oracle="onnxruntime", rtol=1e-4, atol=1e-5)


def test_deform_conv_without_mask_or_bias_matches_reference() -> None:
    feeds = {"x": rand(1, 2, 4, 5), "w": rand(3, 2, 2, 2), "offset": rand(1, 8, 3, 4) * 2}
    model = _deform_conv_model(feeds, (1, 3, 3, 4))
    assert_matches(model, feeds, oracle="reference", rtol=1e-4, atol=1e-5)


def test_deform_conv_volumetric_zero_offsets_equal_conv() -> None:
    x, w = rand(1, 2, 3, 4, 4), rand(2, 2, 2, 2, 3)
    feeds = {"x": x, "w": w, "offset": np.zeros((1, 36, 2, 3, 2), F32)}
    got = run_compiled(_deform_conv_model(feeds, (1, 2, 2, 3, 2)), feeds)[0]
    conv = oh.make_node("Conv", ["x", "w"], ["y"])
    conv_model = one_node_model(conv, {"x": x, "w": w}, {"y": (F32, (1, 2, 2, 3, 2))}, opset=22)
    want = run_onnxruntime(conv_model, {"x": x, "w": w})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_deform_conv_zero_offsets_equal_conv() -> None:
    x, w = rand(1, 3, 5, 5), rand(4, 3, 3, 3)
    feeds = {"x": x, "w": w, "offset": np.zeros((1, 18, 3, 3), F32)}
    got = run_compiled(_deform_conv_model(feeds, (1, 4, 3, 3)), feeds)[0]
    conv = oh.make_node("Conv", ["x", "w"], ["y"])
    conv_model = one_node_model(conv, {"x": x, "w": w}, {"y": (F32, (1, 4, 3, 3))}, opset=22)
    from tests.op_checks import run_onnxruntime

    np.testing.assert_allclose(
        got, run_onnxruntime(conv_model, {"x": x, "w": w})[0], rtol=1e-5, atol=1e-5
    )


def test_deform_conv_rejects_offset_group_that_does_not_divide_channels() -> None:
    feeds = {"x": rand(1, 3, 4, 4), "w": rand(1, 3, 2, 2), "offset": rand(1, 16, 3, 3)}
    model = _deform_conv_model(feeds, (1, 1, 3, 3), offset_group=2)
    with pytest.raises(CompileError, match="offset_group 2"):
        compile_model(model.SerializeToString(), []).cleanup()
