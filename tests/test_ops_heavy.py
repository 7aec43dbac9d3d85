"""Heavy op kernels (conv, pooling, matmul, normalisation, resize, pad) against ONNX Runtime.

Every case runs one ONNX node in ONNX Runtime and checks our kernel two ways: computing the
whole op, and reassembling the output from uneven tiles cut along each axis the op offers
(and along all of them at once), each tile fed only the input boxes its tiling rule asked for.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from compiler_core.ops import REGISTRY, NodeInfo, TileCtx
from compiler_core.ops.registry import Box, box_shape
from tests.op_checks import assert_matches, one_node_model

RNG = np.random.default_rng(1234)


def rand(*shape: int, dtype: Any = np.float32) -> np.ndarray:
    return RNG.standard_normal(shape).astype(dtype)


def attr_value(attr: onnx.AttributeProto) -> Any:
    value = helper.get_attribute_value(attr)
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, onnx.TensorProto):
        return numpy_helper.to_array(value)
    if isinstance(value, list):
        return [v.decode() if isinstance(v, bytes) else v for v in value]
    return value


def single_node_model(
    node: onnx.NodeProto, inputs: Sequence[np.ndarray | None], opset: int
) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """`node` alone as a model, its inputs as graph inputs, its outputs typed by inference."""
    graph_inputs = []
    feeds = {}
    for name, value in zip(node.input, inputs, strict=False):
        if value is None or not name:
            continue
        elem = helper.np_dtype_to_tensor_dtype(value.dtype)
        graph_inputs.append(helper.make_tensor_value_info(name, elem, value.shape))
        feeds[name] = value
    graph = helper.make_graph([node], "g", graph_inputs, [])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8 if opset < 21 else 10
    inferred = onnx.shape_inference.infer_shapes(model)
    known = {v.name: v.type.tensor_type.elem_type for v in inferred.graph.value_info}
    for name in node.output:
        out = onnx.ValueInfoProto(name=name)
        out.type.tensor_type.elem_type = known.get(name, graph_inputs[0].type.tensor_type.elem_type)
        model.graph.output.append(out)
    return model, feeds


def run_ort(
    node: onnx.NodeProto, inputs: Sequence[np.ndarray | None], opset: int
) -> list[np.ndarray]:
    model, feeds = single_node_model(node, inputs, opset)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def run_onnx_reference(
    node: onnx.NodeProto, inputs: Sequence[np.ndarray | None], opset: int
) -> list[np.ndarray]:
    from onnx.reference import ReferenceEvaluator

    model, feeds = single_node_model(node, inputs, opset)
    return [np.asarray(v) for v in ReferenceEvaluator(model).run(None, feeds)]


def node_info(
    node: onnx.NodeProto,
    inputs: Sequence[np.ndarray | None],
    outputs: Sequence[np.ndarray],
    opset: int,
    consts: Sequence[int] = (),
) -> NodeInfo:
    padded = list(inputs) + [None] * (len(node.input) - len(inputs))
    present = [v if name else None for name, v in zip(node.input, padded, strict=True)]
    return NodeInfo(
        op_type=node.op_type,
        name=node.name or node.op_type,
        attrs={a.name: attr_value(a) for a in node.attribute},
        in_shapes=tuple(None if v is None else tuple(v.shape) for v in present),
        in_dtypes=tuple(None if v is None else str(v.dtype) for v in present),
        out_shapes=tuple(tuple(o.shape) for o in outputs),
        out_dtypes=tuple(str(o.dtype) for o in outputs),
        opset=opset,
        consts={i: v for i, v in enumerate(present) if i in consts and v is not None},
    )


def cuts(size: int) -> list[tuple[int, int]]:
    """Uneven pieces of [0, size): e.g. 7 -> [0,1) [1,5) [5,7)."""
    points = sorted({0, min(1, size), (size + 1) // 2 + 1, size} - {size + 1})
    points = [p for p in points if p <= size]
    return [(a, b) for a, b in itertools.pairwise(points) if b > a]


def slice_box(value: np.ndarray, box: Box) -> np.ndarray:
    for axis, (lo, hi) in enumerate(box):
        assert 0 <= lo <= hi <= value.shape[axis], f"box {box} outside shape {value.shape}"
        assert hi > lo or value.shape[axis] == 0, f"empty box {box}"
    return value[tuple(slice(lo, hi) for lo, hi in box)]


def assemble(
    info: NodeInfo, inputs: Sequence[np.ndarray | None], axes: Sequence[int]
) -> np.ndarray:
    """Output 0 computed tile by tile, cutting each of `axes` into uneven pieces."""
    opdef = REGISTRY.lookup(info.op_type, opset=info.opset)
    assert opdef is not None
    out = np.zeros(info.out_shapes[0], dtype=info.out_dtypes[0])
    written = np.zeros(info.out_shapes[0], dtype=np.int64)
    full = [(0, d) for d in info.out_shapes[0]]
    pieces = [cuts(info.out_shapes[0][a]) if a in axes else [full[a]] for a in range(len(full))]
    for out_box in itertools.product(*pieces):
        boxes = opdef.input_boxes(info, out_box)
        assert len(boxes) == len(info.in_shapes)
        tile_inputs = [
            None if box is None or value is None else slice_box(value, box)
            for box, value in zip(boxes, inputs, strict=False)
        ]
        result = opdef.compute(info, tile_inputs, TileCtx(out_box=out_box, in_boxes=tuple(boxes)))
        assert result[0].shape == box_shape(out_box)
        out[tuple(slice(lo, hi) for lo, hi in out_box)] = result[0]
        written[tuple(slice(lo, hi) for lo, hi in out_box)] += 1
    assert (written == 1).all()
    return out


def check(
    op_type: str,
    inputs: Sequence[np.ndarray | None],
    opset: int = 17,
    consts: Sequence[int] = (),
    outputs: int = 1,
    rtol: float = 1e-4,
    atol: float = 1e-5,
    expect_split: bool = True,
    oracle: str = "onnxruntime",
    **attrs: Any,
) -> NodeInfo:
    names = ["" if v is None else f"in{i}" for i, v in enumerate(inputs)]
    node = helper.make_node(op_type, names, [f"out{i}" for i in range(outputs)], **attrs)
    expected = (run_ort if oracle == "onnxruntime" else run_onnx_reference)(node, inputs, opset)
    info = node_info(node, inputs, expected, opset, consts)
    opdef = REGISTRY.lookup(op_type, opset=opset)
    assert opdef is not None, f"{op_type}-{opset} not registered"
    got = opdef.compute(info, list(inputs), TileCtx.whole(info))
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == e.dtype and g.shape == e.shape
        np.testing.assert_allclose(g, e, rtol=rtol, atol=atol)
    axes = opdef.split_axes(info)
    assert bool(axes) == expect_split, axes
    for axis_set in [[a] for a in axes] + ([axes] if len(axes) > 1 else []):
        tiled = assemble(info, inputs, axis_set)
        np.testing.assert_allclose(
            tiled, expected[0], rtol=rtol, atol=atol, err_msg=f"split {axis_set}"
        )
    assert opdef.macs(info) > 0
    return info


# ---------------------------------------------------------------------------------------------
# Conv


def test_conv_2d_with_padding_stride_and_dilation_tiles_like_whole():
    check(
        "Conv",
        [rand(2, 3, 11, 10), rand(5, 3, 3, 3), rand(5)],
        pads=[1, 2, 0, 1],
        strides=[2, 1],
        dilations=[2, 1],
    )


def test_conv_depthwise_with_multiplier_splits_channels():
    info = check("Conv", [rand(1, 4, 9, 9), rand(8, 1, 3, 3), rand(8)], group=4, pads=[1, 1, 1, 1])
    assert 1 in REGISTRY.lookup("Conv").split_axes(info)


def test_conv_grouped_splits_channels_across_and_inside_groups():
    # `check` runs tiles cut along every split axis: 2 groups of 2 output channels, cut anywhere
    info = check("Conv", [rand(1, 6, 7, 7), rand(4, 3, 3, 3)], group=2, strides=[2, 2])
    assert 1 in REGISTRY.lookup("Conv").split_axes(info)


@pytest.mark.parametrize("auto_pad", ["SAME_UPPER", "SAME_LOWER", "VALID"])
def test_conv_auto_pad(auto_pad):
    check("Conv", [rand(1, 2, 8, 7), rand(3, 2, 4, 3)], auto_pad=auto_pad, strides=[2, 3])


def test_conv_1d_and_3d():
    check("Conv", [rand(2, 3, 15), rand(4, 3, 5), rand(4)], pads=[2, 1], strides=[2])
    check("Conv", [rand(1, 2, 5, 6, 4), rand(3, 2, 3, 2, 3)], pads=[1, 0, 1, 1, 1, 0])


def test_conv_float16_accumulates_in_float32():
    x, w = rand(1, 8, 6, 6, dtype=np.float16), rand(4, 8, 3, 3, dtype=np.float16)
    node = helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])
    expected = run_ort(node, [x.astype(np.float32), w.astype(np.float32)], 17)[0]
    info = node_info(node, [x, w], [expected.astype(np.float16)], 17)
    got = REGISTRY.lookup("Conv").compute(info, [x, w], TileCtx.whole(info))[0]
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float32), expected, rtol=2e-3, atol=2e-3)


def test_conv_transpose_with_stride_pads_and_output_padding():
    check(
        "ConvTranspose",
        [rand(2, 3, 5, 4), rand(3, 4, 3, 3), rand(4)],
        strides=[2, 3],
        pads=[1, 0, 0, 1],
        output_padding=[1, 2],
        dilations=[1, 2],
    )


def test_conv_transpose_grouped_and_output_shape():
    check(
        "ConvTranspose",
        [rand(1, 4, 4, 4), rand(4, 3, 3, 3)],
        group=2,
        strides=[2, 2],
        output_shape=[8, 9],
    )
    check(
        "ConvTranspose", [rand(1, 2, 5, 5), rand(2, 2, 2, 2)], strides=[2, 2], auto_pad="SAME_UPPER"
    )


def test_conv_transpose_same_lower_puts_odd_padding_first():
    check(
        "ConvTranspose", [rand(1, 2, 4, 4), rand(2, 3, 4, 3)], strides=[2, 2], auto_pad="SAME_LOWER"
    )


# ---------------------------------------------------------------------------------------------
# Pooling


def test_max_pool_ceil_mode_with_pads_and_dilation():
    check(
        "MaxPool",
        [rand(2, 3, 10, 9)],
        kernel_shape=[3, 2],
        strides=[2, 2],
        pads=[1, 0, 1, 1],
        ceil_mode=1,
        dilations=[1, 2],
    )


def test_max_pool_same_upper_and_int8():
    check("MaxPool", [rand(1, 2, 7, 8)], kernel_shape=[3, 3], strides=[2, 2], auto_pad="SAME_UPPER")
    x = RNG.integers(-128, 127, size=(1, 3, 6, 6)).astype(np.int8)
    check("MaxPool", [x], kernel_shape=[2, 2], pads=[1, 1, 0, 0])


def test_max_pool_indices_output_runs_whole():
    check(
        "MaxPool",
        [rand(2, 2, 6, 7)],
        outputs=2,
        kernel_shape=[3, 3],
        strides=[2, 2],
        pads=[1, 1, 1, 1],
        expect_split=False,
    )
    check(
        "MaxPool",
        [rand(1, 2, 5, 6)],
        outputs=2,
        kernel_shape=[2, 2],
        storage_order=1,
        expect_split=False,
    )


@pytest.mark.parametrize("include_pad", [0, 1])
def test_average_pool_count_include_pad_with_ceil_mode(include_pad):
    check(
        "AveragePool",
        [rand(2, 3, 9, 8)],
        kernel_shape=[3, 3],
        strides=[2, 2],
        pads=[1, 1, 1, 0],
        count_include_pad=include_pad,
        ceil_mode=1,
    )


def test_average_pool_1d_same_lower_and_3d():
    check("AveragePool", [rand(2, 3, 11)], kernel_shape=[4], strides=[3], auto_pad="SAME_LOWER")
    check("AveragePool", [rand(1, 2, 5, 6, 4)], kernel_shape=[2, 3, 2], pads=[1, 1, 0, 0, 1, 1])


def test_average_pool_dilations_opset19():
    check(
        "AveragePool",
        [rand(1, 2, 9, 9)],
        opset=19,
        kernel_shape=[2, 2],
        dilations=[2, 2],
        pads=[1, 1, 1, 1],
        count_include_pad=1,
    )


def test_lp_pool():
    check("LpPool", [rand(1, 2, 7, 6)], kernel_shape=[3, 2], strides=[2, 1], pads=[1, 0, 1, 0], p=3)


@pytest.mark.parametrize("op", ["GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool"])
def test_global_pools(op):
    check(op, [rand(3, 5, 4, 6)])


# ---------------------------------------------------------------------------------------------
# MatMul, Gemm, Einsum


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ((5, 7), (7, 6)),
        ((3, 1, 5, 4), (2, 4, 6)),  # broadcast batch dims both ways
        ((2, 5, 4), (4,)),  # 1-D B
        ((4,), (3, 4, 5)),  # 1-D A
        ((4,), (4,)),  # scalar result: runs whole
    ],
)
def test_matmul_broadcasting(a, b):
    check("MatMul", [rand(*a), rand(*b)], expect_split=len(a) + len(b) > 2)


def test_matmul_int32_and_float16():
    a, b = (
        RNG.integers(-50, 50, (3, 4, 5)).astype(np.int32),
        RNG.integers(-50, 50, (5, 2)).astype(np.int32),
    )
    check("MatMul", [a, b], rtol=0, atol=0)
    check(
        "MatMul",
        [rand(2, 6, 8, dtype=np.float16), rand(8, 5, dtype=np.float16)],
        rtol=2e-3,
        atol=2e-3,
    )


def test_matmul_splits_rows_then_columns_then_batch():
    info = check("MatMul", [rand(2, 5, 4), rand(4, 6)])
    assert REGISTRY.lookup("MatMul").split_axes(info) == [1, 2, 0]


@pytest.mark.parametrize("c_shape", [(6,), (5, 1), (1, 6), (5, 6), ()])
@pytest.mark.parametrize(("trans_a", "trans_b"), [(0, 0), (1, 1), (1, 0)])
def test_gemm_transposes_and_broadcast_c(c_shape, trans_a, trans_b):
    a = rand(4, 5) if trans_a else rand(5, 4)
    b = rand(6, 4) if trans_b else rand(4, 6)
    check("Gemm", [a, b, rand(*c_shape)], transA=trans_a, transB=trans_b, alpha=0.5, beta=2.0)


def test_gemm_without_c_and_old_opset():
    check("Gemm", [rand(3, 4), rand(4, 2)], opset=13)
    check("Gemm", [rand(3, 4), rand(4, 2), rand(2)], opset=9, transB=0)


def test_einsum_runs_whole():
    check("Einsum", [rand(2, 3, 4), rand(2, 4, 5)], equation="bij,bjk->bik", expect_split=False)
    check("Einsum", [rand(2, 3, 4, 5)], equation="...ij->...ji", expect_split=False)


# ---------------------------------------------------------------------------------------------
# Normalisation and softmax family


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax", "Hardmax"])
@pytest.mark.parametrize(("opset", "axis"), [(11, None), (11, 2), (13, None), (13, 1), (13, -3)])
def test_softmax_family_axis_semantics_by_opset(op, opset, axis):
    attrs = {} if axis is None else {"axis": axis}
    x = rand(2, 3, 4, 5)
    if op == "Hardmax":
        x[0, 0, 0, :2] = 7.0  # ties resolve to the first index
    check(op, [x], opset=opset, **attrs)


def test_batch_norm_inference_across_opsets():
    args = [rand(2, 3, 5, 4), rand(3), rand(3), rand(3), np.abs(rand(3)) + 0.1]
    for opset in (7, 9, 14, 15):
        check("BatchNormalization", args, opset=opset, epsilon=1e-3)
    check("BatchNormalization", [rand(4, 6), rand(6), rand(6), rand(6), np.abs(rand(6))], opset=15)


def test_batch_norm_per_activation_parameters_when_spatial_is_zero():
    params = [rand(3, 4, 5), rand(3, 4, 5), rand(3, 4, 5), np.abs(rand(3, 4, 5)) + 0.1]
    check("BatchNormalization", [rand(2, 3, 4, 5), *params], opset=7, spatial=0)


def test_batch_norm_training_mode_uses_batch_statistics_and_updates_the_running_ones():
    from onnx.reference import ReferenceEvaluator

    x, scale, bias = rand(2, 3, 4, 5), rand(3), rand(3)
    mean, var = rand(3), np.abs(rand(3)) + 0.1
    node = helper.make_node(
        "BatchNormalization", list("xsbmv"), ["y", "rm", "rv"], training_mode=1, momentum=0.8
    )
    f = onnx.TensorProto.FLOAT
    graph = helper.make_graph(
        [node],
        "bn",
        [
            helper.make_tensor_value_info(n, f, a.shape)
            for n, a in zip("xsbmv", [x, scale, bias, mean, var], strict=True)
        ],
        [helper.make_tensor_value_info(n, f, None) for n in ("y", "rm", "rv")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)])
    expected = ReferenceEvaluator(model).run(
        None, dict(zip("xsbmv", [x, scale, bias, mean, var], strict=True))
    )
    info = NodeInfo(
        "BatchNormalization",
        "bn",
        {"training_mode": 1, "momentum": 0.8},
        ((2, 3, 4, 5), (3,), (3,), (3,), (3,)),
        ("float32",) * 5,
        ((2, 3, 4, 5), (3,), (3,)),
        ("float32",) * 3,
        opset=15,
    )
    opdef = REGISTRY.lookup("BatchNormalization", opset=15)
    assert opdef is not None and opdef.split_axes(info) == []
    got = opdef.compute(info, [x, scale, bias, mean, var], TileCtx.whole(info))
    for ours, ref in zip(got, expected, strict=True):
        np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-6)


def test_instance_norm():
    check("InstanceNormalization", [rand(2, 3, 5, 6), rand(3), rand(3)], epsilon=1e-3)


def test_layer_norm_axis_and_optional_outputs():
    check("LayerNormalization", [rand(2, 3, 8), rand(8), rand(8)])
    check("LayerNormalization", [rand(2, 3, 4, 5), rand(4, 5)], axis=-2)
    check("LayerNormalization", [rand(3, 6), rand(6), rand(6)], outputs=3, expect_split=False)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("axes", [(2,), (1, 2), (0, 1, 2)])
def test_layer_norm_means_are_numpys_own_bit_for_bit(dtype: type, axes: tuple[int, ...]) -> None:
    """The kernel's sum-then-divide mean (norm.py `_mean`) is `ndarray.mean`, so the layer
    norm of a tile keeps the bytes it had when it called `mean`."""
    from compiler_core.ops.norm import _mean

    x = (np.random.default_rng(4).standard_normal((3, 5, 77)) * 100 + 7).astype(dtype)
    count = int(np.prod([x.shape[a] for a in axes]))
    want = x.mean(axis=axes, keepdims=True)
    got = _mean(x, axes, count)
    assert got.dtype == want.dtype and got.tobytes() == want.tobytes()


def test_lrn_splits_channels_with_halo():
    for size in (3, 5):
        check("LRN", [rand(2, 7, 4, 5)], size=size, alpha=0.01, beta=0.6, bias=2.0)


def test_lp_and_mean_variance_normalization():
    check("LpNormalization", [rand(3, 4, 5)], axis=1, p=1)
    check("LpNormalization", [rand(3, 4, 5)])
    check("MeanVarianceNormalization", [rand(2, 3, 4, 5)])
    check("MeanVarianceNormalization", [rand(2, 3, 4, 5)], axes=[1, 3])


# ---------------------------------------------------------------------------------------------
# Pad, Resize, Upsample


def i64(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def f32(*values: float) -> np.ndarray:
    return np.array(values, dtype=np.float32)


@pytest.mark.parametrize("mode", ["constant", "reflect", "edge", "wrap"])
def test_pad_modes_with_pads_input(mode):
    x = rand(2, 3, 5, 4)
    value = f32(1.5) if mode == "constant" else None
    info = check("Pad", [x, i64(0, 1, 2, 0, 0, 0, 1, 3), value], opset=19, consts=[1], mode=mode)
    split = REGISTRY.lookup("Pad", opset=19).split_axes(info)
    assert split == ([0, 1, 2, 3] if mode == "constant" else [0])


def test_pad_negative_pads_crop_and_axes_input():
    check("Pad", [rand(3, 6, 5), i64(1, -2, 0, 2, -1, 1)], opset=13, consts=[1])
    check("Pad", [rand(3, 6, 5), i64(2, 1, 0, 3), None, i64(0, -1)], opset=18, consts=[1, 3])


def test_pad_attribute_form_and_unknown_pads_run_whole():
    check("Pad", [rand(2, 5)], opset=2, pads=[1, 0, 0, 2], value=-1.0)
    check("Pad", [rand(2, 5), i64(1, 1, 1, 1)], opset=13, expect_split=False)
    ints = RNG.integers(0, 9, (3, 4)).astype(np.int32)
    check("Pad", [ints, i64(1, 0, 0, 2), np.array(7, dtype=np.int32)], opset=13, consts=[1])


RESIZE_COORDINATES = [
    "half_pixel",
    "pytorch_half_pixel",
    "align_corners",
    "asymmetric",
    "tf_half_pixel_for_nn",
]


@pytest.mark.parametrize("coordinates", RESIZE_COORDINATES)
@pytest.mark.parametrize("nearest", ["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"])
def test_resize_nearest_with_scales(coordinates, nearest):
    # 4 x 2.5 and 5 x 0.6 are whole lengths: there ONNX Runtime's align_corners agrees with
    # the ONNX definition (test_resize_align_corners_uses_the_unrounded_resized_length).
    args = [rand(1, 2, 4, 5), None, f32(1, 1, 2.5, 0.6)]
    check(
        "Resize",
        args,
        opset=13,
        consts=[2],
        mode="nearest",
        coordinate_transformation_mode=coordinates,
        nearest_mode=nearest,
    )


@pytest.mark.parametrize("coordinates", [*RESIZE_COORDINATES[:4], "half_pixel_symmetric"])
def test_resize_linear_with_sizes(coordinates):
    args = [rand(2, 3, 5, 4), None, None, i64(2, 3, 9, 3)]
    check(
        "Resize",
        args,
        opset=19,
        consts=[3],
        mode="linear",
        coordinate_transformation_mode=coordinates,
    )


@pytest.mark.parametrize("exclude_outside", [0, 1])
def test_resize_cubic(exclude_outside):
    args = [rand(1, 2, 6, 5), f32(), f32(1, 1, 1.5, 2.0)]
    check(
        "Resize",
        args,
        opset=11,
        consts=[1, 2],
        mode="cubic",
        exclude_outside=exclude_outside,
        cubic_coeff_a=-0.5,
    )


def test_resize_tf_crop_and_resize_extrapolates():
    roi = f32(0, 0, -0.2, 0.1, 1, 1, 0.9, 1.3)
    check(
        "Resize",
        [rand(1, 2, 6, 7), roi, f32(1, 1, 1.5, 0.8)],
        opset=13,
        consts=[1, 2],
        mode="linear",
        coordinate_transformation_mode="tf_crop_and_resize",
        extrapolation_value=-3.0,
    )


def test_resize_axes_and_keep_aspect_ratio_opset18():
    check(
        "Resize",
        [rand(1, 2, 6, 8), None, None, i64(9, 9)],
        opset=18,
        consts=[3],
        axes=[2, 3],
        keep_aspect_ratio_policy="not_larger",
        mode="linear",
    )
    check(
        "Resize",
        [rand(1, 2, 6, 8), None, None, i64(9, 9)],
        opset=18,
        consts=[3],
        axes=[2, 3],
        keep_aspect_ratio_policy="not_smaller",
    )


def test_resize_opset10_and_upsample_use_asymmetric_coordinates():
    for mode in ("nearest", "linear"):
        check("Resize", [rand(1, 2, 4, 5), f32(1, 1, 2, 1.5)], opset=10, consts=[1], mode=mode)
        check("Upsample", [rand(1, 2, 4, 5), f32(1, 1, 2, 3)], opset=9, consts=[1], mode=mode)
    check("Upsample", [rand(1, 2, 3, 3)], opset=7, scales=[1.0, 1.0, 2.0, 2.0])


def test_resize_with_unknown_scales_runs_whole():
    check("Resize", [rand(1, 1, 4, 4), None, f32(1, 1, 2, 2)], opset=13, expect_split=False)


# ---------------------------------------------------------------------------------------------
# Tiling rules as specifications


def conv_info(**attrs: Any) -> NodeInfo:
    return NodeInfo(
        "Conv",
        "conv",
        attrs,
        ((1, 4, 16, 16), (8, 4, 3, 3), (8,)),
        ("float32",) * 3,
        ((1, 8, 16, 16),),
        ("float32",),
    )


def test_conv_row_tile_asks_for_its_halo_clipped_to_the_input():
    conv = REGISTRY.lookup("Conv")
    info = conv_info(pads=[1, 1, 1, 1])
    assert conv.split_axes(info) == [0, 1, 2, 3]
    assert conv.input_boxes(info, ((0, 1), (0, 8), (4, 8), (0, 16))) == [
        ((0, 1), (0, 4), (3, 9), (0, 16)),
        ((0, 8), (0, 4), (0, 3), (0, 3)),
        ((0, 8),),
    ]
    first_rows = conv.input_boxes(info, ((0, 1), (2, 5), (0, 3), (0, 16)))
    assert first_rows[0] == ((0, 1), (0, 4), (0, 4), (0, 16))
    assert first_rows[1][0] == (2, 5) and first_rows[2] == ((2, 5),)


def test_gemm_boxes_follow_transposes_and_c_broadcast():
    info = NodeInfo(
        "Gemm",
        "gemm",
        {"transA": 1, "transB": 1},
        ((7, 5), (6, 7), (1, 6)),
        ("float32",) * 3,
        ((5, 6),),
        ("float32",),
    )
    boxes = REGISTRY.lookup("Gemm").input_boxes(info, ((1, 3), (2, 6)))
    assert boxes == [((0, 7), (1, 3)), ((2, 6), (0, 7)), ((0, 1), (2, 6))]


def test_matmul_boxes_broadcast_batch_dims():
    info = NodeInfo(
        "MatMul",
        "mm",
        {},
        ((3, 1, 5, 4), (2, 4, 6)),
        ("float32",) * 2,
        ((3, 2, 5, 6),),
        ("float32",),
    )
    boxes = REGISTRY.lookup("MatMul").input_boxes(info, ((1, 2), (0, 2), (1, 3), (0, 4)))
    assert boxes == [((1, 2), (0, 1), (1, 3), (0, 4)), ((0, 2), (0, 4), (0, 4))]


def test_every_heavy_op_is_registered_with_its_unit():
    hmx = {"Conv", "ConvTranspose", "MatMul", "Gemm", "Einsum"}
    for op in [
        "Conv",
        "ConvTranspose",
        "MatMul",
        "Gemm",
        "BatchNormalization",
        "MaxPool",
        "AveragePool",
        "GlobalAveragePool",
        "GlobalMaxPool",
        "Softmax",
        "LogSoftmax",
        "LayerNormalization",
        "InstanceNormalization",
        "LRN",
        "Resize",
        "Upsample",
        "Pad",
        "Hardmax",
        "LpNormalization",
        "MeanVarianceNormalization",
        "Einsum",
    ]:
        versions = REGISTRY.versions(op)
        assert versions, op
        assert all(v.unit == ("hmx" if op in hmx else "hvx") for v in versions), op


@pytest.mark.parametrize("mode", ["linear", "cubic"])
@pytest.mark.parametrize("exclude_outside", [0, 1])
def test_resize_antialias_downsampling_widens_the_filter(mode, exclude_outside):
    check(
        "Resize",
        [rand(1, 2, 9, 11), None, f32(1, 1, 0.45, 0.6)],
        opset=18,
        consts=[2],
        mode=mode,
        antialias=1,
        exclude_outside=exclude_outside,
    )


@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
def test_resize_align_corners_uses_the_unrounded_resized_length(mode):
    """ONNX defines x_original = x * (in - 1) / (in * scale - 1); ONNX Runtime divides by the
    rounded output length instead, so the oracle here is the ONNX reference."""
    x = rand(1, 1, 5, 7)
    scales = f32(1, 1, 0.6, 1.3)
    node = helper.make_node(
        "Resize",
        ["x", "", "scales"],
        ["y"],
        mode=mode,
        coordinate_transformation_mode="align_corners",
    )
    model = one_node_model(
        node,
        {"x": x, "scales": scales},
        {"y": (np.float32, [1, 1, 3, 9])},
        opset=19,
        initializers={"scales": scales},
    )
    assert_matches(model, {"x": x}, oracle="reference", rtol=1e-5, atol=1e-5)
