"""Light op kernels (elementwise, activations, reductions, tensor manipulation) against ONNX
Runtime.

Every case runs one ONNX node in ONNX Runtime, then checks our registry entry two ways: the
whole op computed at once, and the output reassembled from uneven tiles cut along each axis the
op offers (and along two at once), each tile fed only the input boxes its tiling rule asked for.
Inputs listed in `consts` are initializers, so tiling rules see their values as the lowering
would.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from compiler_core.errors import CompileError
from compiler_core.ops import REGISTRY, NodeInfo, OpDef, TileCtx
from compiler_core.ops._tiling import box_slices, broadcast_input_box
from compiler_core.ops.registry import Box, box_shape, full_box

RNG = np.random.default_rng(7)


def f32(*shape: int, low: float = -3.0, high: float = 3.0) -> np.ndarray:
    return RNG.uniform(low, high, shape).astype(np.float32)


def ints(*shape: int, low: int = -20, high: int = 20, dtype: Any = np.int32) -> np.ndarray:
    return RNG.integers(low, high, shape).astype(dtype)


def boolean(*shape: int) -> np.ndarray:
    return RNG.integers(0, 2, shape).astype(bool)


def nonzero_ints(*shape: int) -> np.ndarray:
    """Divisors of both signs, never zero."""
    return ints(*shape, low=1, high=6) * np.where(boolean(*shape), 1, -1).astype(np.int32)


def i64(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


@dataclass
class Case:
    op: str
    inputs: list[np.ndarray | None]
    attrs: dict[str, Any] = field(default_factory=dict)
    consts: tuple[int, ...] = ()
    opset: int = 17
    outputs: int = 1
    id: str = ""
    rtol: float = 2e-5
    atol: float = 2e-6

    def param(self) -> Any:
        return pytest.param(self, id=self.id or self.op)


X = f32(3, 4, 5)
SMALL = f32(3, 4, 5, low=-0.9, high=0.9)
POSITIVE = f32(3, 4, 5, low=0.1, high=4.0)
WITH_NONFINITE = np.array([[1.0, np.inf, -np.inf], [np.nan, 0.0, -2.0]], dtype=np.float32)
SHIFT = ints(4, 6, low=0, high=200, dtype=np.uint8)

ELEMENTWISE = [
    Case("Add", [X, f32(4, 1)], id="Add-broadcast"),
    Case("Add", [f32(2, 3).astype(np.float16), f32(3).astype(np.float16)], id="Add-f16"),
    Case("Add", [np.array([2**31 - 1, 5], np.int32), np.array([1, -7], np.int32)], id="Add-wrap"),
    Case("Sub", [X, f32(5)]),
    Case("Mul", [f32(1, 4, 1), X]),
    Case("Div", [X, f32(3, 1, 5, low=0.5, high=2.0)]),
    Case("Div", [ints(4, 6), nonzero_ints(6)], id="Div-int"),
    Case("Pow", [POSITIVE, f32(5)]),
    Case("Pow", [ints(3, 4, low=-4, high=5, dtype=np.int64), i64(0, 1, 2, 3)], id="Pow-int"),
    Case("Pow", [nonzero_ints(3, 4), i64(-1, 2, -2, 3)], id="Pow-int-negative-exponent"),
    Case("Pow", [ints(3, 4, low=-4, high=5), f32(4, low=0.0, high=2.0)], id="Pow-int-float"),
    Case("Mod", [ints(4, 5), nonzero_ints(5)], id="Mod-int"),
    Case("Mod", [ints(4, 5), ints(5, low=1, high=6)], attrs={"fmod": 1}, id="Mod-fmod"),
    Case("Mod", [X, f32(5, low=0.5, high=2.0)], attrs={"fmod": 1}, id="Mod-float"),
    Case("Max", [X, f32(4, 5), f32(5)]),
    Case("Min", [f32(3, 1, 5), X]),
    Case("Mean", [X, f32(3, 4, 1), f32(1)]),
    Case("Sum", [f32(3, 4), f32(4), f32(3, 1)]),
    Case("Max", [ints(3, 4), ints(4)], id="Max-int"),
    Case("Neg", [ints(3, 4)], id="Neg-int"),
    Case("Abs", [X]),
    Case("Sqrt", [POSITIVE]),
    Case("Reciprocal", [POSITIVE]),
    Case("Exp", [X]),
    Case("Log", [POSITIVE]),
    Case("Erf", [X]),
    Case("Erf", [f32(6, 7).astype(np.float16)], id="Erf-f16", rtol=1e-3, atol=1e-3),
    Case("Floor", [X]),
    Case("Ceil", [X]),
    Case("Round", [np.array([[-2.5, -1.5, -0.5, 0.5], [1.5, 2.5, 2.6, -0.4]], np.float32)]),
    Case("Sign", [np.where(X > 1, 0, X).astype(np.float32)]),
    Case("Sin", [X]),
    Case("Cos", [X]),
    Case("Tan", [SMALL]),
    Case("Asin", [SMALL]),
    Case("Acos", [SMALL]),
    Case("Atan", [X]),
    Case("Sinh", [X]),
    Case("Cosh", [X]),
    Case("Asinh", [X]),
    Case("Acosh", [POSITIVE + 1]),
    Case("Atanh", [SMALL]),
    Case("Not", [boolean(3, 4)]),
    Case("And", [boolean(3, 4), boolean(4)]),
    Case("Or", [boolean(3, 4), boolean(3, 1)]),
    Case("Xor", [boolean(3, 4), boolean(3, 4)]),
    Case("Equal", [ints(3, 4, low=0, high=3), ints(4, low=0, high=3)]),
    Case("Less", [X, f32(5)]),
    Case("LessOrEqual", [ints(3, 4, low=0, high=3), ints(3, 1, low=0, high=3)]),
    Case("Greater", [X, f32(4, 1)]),
    Case("GreaterOrEqual", [X, np.round(X)]),
    Case("Where", [boolean(4, 1), X, f32(5)]),
    Case("Cast", [X * 10], attrs={"to": onnx.TensorProto.INT32}, id="Cast-float-int"),
    Case("Cast", [np.where(X > 0, X, 0)], attrs={"to": onnx.TensorProto.BOOL}, id="Cast-bool"),
    Case("Cast", [ints(3, 4, dtype=np.int64)], attrs={"to": onnx.TensorProto.FLOAT16},
         id="Cast-f16"),
    Case("Cast", [boolean(3, 4)], attrs={"to": onnx.TensorProto.FLOAT}, id="Cast-from-bool"),
    Case("Cast", [X * 40 + 120], attrs={"to": onnx.TensorProto.UINT8}, id="Cast-uint8"),
    Case("CastLike", [ints(3, 4), np.zeros(1, np.float64)], consts=(1,)),
    Case("IsNaN", [WITH_NONFINITE]),
    Case("IsInf", [WITH_NONFINITE]),
    Case("IsInf", [WITH_NONFINITE], attrs={"detect_negative": 0}, id="IsInf-positive"),
    Case("BitShift", [SHIFT, ints(6, low=0, high=8, dtype=np.uint8)], attrs={"direction": "LEFT"}),
    Case("BitShift", [SHIFT, ints(4, 1, low=0, high=8, dtype=np.uint8)],
         attrs={"direction": "RIGHT"}, id="BitShift-right"),
    Case("BitwiseAnd", [ints(3, 4), ints(4)], opset=18),
    Case("BitwiseOr", [ints(3, 4), ints(3, 1)], opset=18),
    Case("BitwiseXor", [ints(3, 4), ints(3, 4)], opset=18),
    Case("BitwiseNot", [ints(3, 4)], opset=18),
]  # fmt: skip

A = f32(2, 3, 4, 5)

ACTIVATIONS = [
    Case("Relu", [A]),
    Case("Relu", [ints(3, 4)], opset=14, id="Relu-int"),
    Case("LeakyRelu", [A], attrs={"alpha": 0.1}),
    Case("PRelu", [A, f32(3, 1, 1)]),
    Case("Sigmoid", [A]),
    Case("Sigmoid", [A.astype(np.float16)], id="Sigmoid-f16", rtol=1e-3, atol=1e-3),
    Case("HardSigmoid", [A], attrs={"alpha": 0.3}),
    Case("HardSwish", [A]),
    Case("Tanh", [A]),
    Case("Elu", [A], attrs={"alpha": 0.5}),
    Case("Selu", [A]),
    Case("Celu", [A], attrs={"alpha": 2.0}),
    Case("Gelu", [A], opset=20),
    Case("Gelu", [A], attrs={"approximate": "tanh"}, opset=20, id="Gelu-tanh"),
    Case("Mish", [A], opset=18),
    Case("Softplus", [A * 10]),
    Case("Softsign", [A]),
    Case("ThresholdedRelu", [A], attrs={"alpha": 0.5}),
    Case("Swish", [A], attrs={"alpha": 0.75}, opset=24),
    Case("Shrink", [ints(3, 4, dtype=np.int64)], attrs={"lambd": 2.0, "bias": 1.0},
         id="Shrink-int"),
    Case("Shrink", [A], attrs={"lambd": 1.0, "bias": 0.25}),
    Case("Clip", [A], attrs={"min": -1.0, "max": 0.5}, opset=10, id="Clip-attrs"),
    Case("Clip", [A, np.array(-1.0, np.float32), np.array(0.5, np.float32)], consts=(1, 2),
         opset=13, id="Clip-inputs"),
    Case("Clip", [A, None, np.array(0.5, np.float32)], consts=(2,), opset=13, id="Clip-max-only"),
    Case("Clip", [ints(3, 4), np.array(-5, np.int32), np.array(7, np.int32)], opset=13,
         id="Clip-int"),
]  # fmt: skip

R = f32(3, 4, 5)

REDUCTIONS = [
    Case("ReduceSum", [R, i64(1)], attrs={"keepdims": 0}, consts=(1,), opset=13),
    Case("ReduceSum", [R], attrs={"axes": [0, 2]}, opset=11, id="ReduceSum-attr"),
    Case("ReduceSum", [ints(3, 4), i64(-1)], consts=(1,), opset=13, id="ReduceSum-int"),
    Case("ReduceSum", [R, i64()], attrs={"noop_with_empty_axes": 1}, consts=(1,), opset=13,
         id="ReduceSum-noop"),
    Case("ReduceMean", [R, i64(-1)], consts=(1,), opset=18),
    Case("ReduceMean", [ints(3, 4), i64(1)], consts=(1,), opset=18, id="ReduceMean-int"),
    Case("ReduceMax", [R], opset=18, id="ReduceMax-all"),
    Case("ReduceMax", [R.astype(np.float16), i64(1)], consts=(1,), opset=18, id="ReduceMax-f16"),
    Case("ReduceSum", [R.astype(np.float16), i64(2)], consts=(1,), opset=13, id="ReduceSum-f16"),
    Case("ReduceMax", [R], attrs={"axes": [1]}, opset=13, id="ReduceMax-attr"),
    Case("ReduceMin", [R, i64(0, 2)], attrs={"keepdims": 0}, consts=(1,), opset=18),
    Case("ReduceProd", [R, i64(1)], consts=(1,), opset=18),
    Case("ReduceL1", [R, i64(2)], consts=(1,), opset=18),
    Case("ReduceL2", [R, i64(0)], attrs={"keepdims": 0}, consts=(1,), opset=18),
    Case("ReduceLogSum", [POSITIVE, i64(1)], consts=(1,), opset=18),
    Case("ReduceLogSumExp", [R * 30, i64(2)], consts=(1,), opset=18),
    Case("ReduceSumSquare", [R, i64(1, 2)], consts=(1,), opset=18),
    Case("ArgMax", [R], attrs={"axis": 1, "keepdims": 0}),
    Case("ArgMin", [ints(3, 6, low=0, high=3)], attrs={"axis": -1, "select_last_index": 1}),
    Case("CumSum", [R, np.array(1, np.int64)], consts=(1,)),
    Case("CumSum", [ints(3, 5), np.array(-1, np.int32)], attrs={"exclusive": 1, "reverse": 1},
         consts=(1,), id="CumSum-exclusive-reverse"),
]  # fmt: skip

T = f32(2, 3, 4, 5)
IMG = f32(2, 8, 3, 4)

TENSOR = [
    Case("Reshape", [T, i64(0, -1, 5)], consts=(1,)),
    Case("Reshape", [np.zeros((0, 3), np.float32), i64(3, 0)], attrs={"allowzero": 1},
         consts=(1,), opset=14, id="Reshape-allowzero"),
    Case("Flatten", [T], attrs={"axis": 2}),
    Case("Flatten", [T], attrs={"axis": -1}, id="Flatten-negative"),
    Case("Squeeze", [f32(3, 1, 4, 1), i64(-1)], consts=(1,), opset=13),
    Case("Squeeze", [f32(3, 1, 4, 1)], attrs={"axes": [1]}, opset=11, id="Squeeze-attr"),
    Case("Squeeze", [f32(1, 3, 1)], opset=13, id="Squeeze-all"),
    Case("Unsqueeze", [f32(3, 4), i64(0, -1)], consts=(1,), opset=13),
    Case("Unsqueeze", [f32(3, 4)], attrs={"axes": [1]}, opset=11, id="Unsqueeze-attr"),
    Case("Identity", [ints(3, 4)]),
    Case("Dropout", [T], opset=13),
    Case("Dropout", [T], opset=13, outputs=2, id="Dropout-mask"),
    Case("Transpose", [T], attrs={"perm": [2, 0, 3, 1]}),
    Case("Transpose", [T], id="Transpose-default"),
    Case("Concat", [f32(2, 3, 4), f32(2, 1, 4), f32(2, 5, 4)], attrs={"axis": 1}),
    Case("Concat", [boolean(3, 2), boolean(3, 4)], attrs={"axis": -1}, id="Concat-bool"),
    Case("Split", [f32(4, 7), i64(2, 5)], attrs={"axis": 1}, consts=(1,), opset=13, outputs=2),
    Case("Split", [f32(7, 3)], attrs={"num_outputs": 3}, opset=18, outputs=3, id="Split-uneven"),
    Case("Split", [f32(6, 3)], attrs={"split": [1, 5]}, opset=11, outputs=2, id="Split-attr"),
    Case("Split", [f32(6, 3)], opset=11, outputs=3, id="Split-equal"),
    Case("Slice", [T, i64(1, -1), i64(100, -100), i64(2, -1), i64(1, -2)], consts=(1, 2, 3, 4),
         opset=13),
    Case("Slice", [T, i64(-2, 4, 1), i64(-10**18, 1, 10**18), i64(1, 3, 2), i64(-1, -3, 2)],
         consts=(1, 2, 3, 4), opset=13, id="Slice-negative-steps"),
    Case("Slice", [T, i64(-100, 10), i64(-1, -100), i64(0, 3), i64(-1, -2)], consts=(1, 2, 3, 4),
         opset=13, id="Slice-clamped-starts"),
    Case("Slice", [T, i64(0, 1), i64(2, 3)], consts=(1, 2), opset=13, id="Slice-default-axes"),
    Case("Slice", [T], attrs={"starts": [1], "ends": [-1], "axes": [3]}, opset=9,
         id="Slice-attrs"),
    Case("Gather", [T, np.array([[2, -1], [0, 1], [1, 1]], np.int64)], attrs={"axis": 2}),
    Case("Gather", [f32(5, 3), np.array(-2, np.int64)], id="Gather-scalar"),
    Case("GatherElements", [f32(4, 5), ints(3, 5, low=-4, high=4, dtype=np.int64)]),
    Case("GatherElements", [f32(3, 6), ints(3, 4, low=0, high=6, dtype=np.int64)],
         attrs={"axis": 1}, id="GatherElements-axis1"),
    Case("GatherND", [T, np.array([[0, 1], [1, -1]], np.int64)]),
    Case("GatherND", [f32(2, 3, 4), np.array([[[1], [2]], [[0], [1]]], np.int64)],
         attrs={"batch_dims": 1}, id="GatherND-batch"),
    Case("ScatterElements", [np.zeros((3, 4), np.float32), np.array([[1, 0, 2, 1]], np.int64),
                             f32(1, 4)], attrs={"axis": 0}, opset=16),
    Case("ScatterElements", [f32(3, 4), np.array([[1, 1], [0, 0]], np.int64), f32(2, 2)],
         attrs={"axis": 1, "reduction": "add"}, opset=18, id="ScatterElements-add"),
    Case("ScatterND", [f32(4, 3), np.array([[2], [0]], np.int64), f32(2, 3)]),
    Case("ScatterND", [f32(4, 3), np.array([[1, 2], [1, 2]], np.int64), f32(2)],
         attrs={"reduction": "mul"}, opset=18, id="ScatterND-mul"),
    Case("Expand", [f32(3, 1), i64(2, 1, 4)], consts=(1,)),
    Case("Tile", [f32(2, 3), i64(3, 2)], consts=(1,)),
    Case("Constant", [], attrs={"value": numpy_helper.from_array(f32(2, 3))}),
    Case("Constant", [], attrs={"value_ints": [1, 2, 3]}, id="Constant-ints"),
    Case("ConstantOfShape", [i64(2, 3)],
         attrs={"value": numpy_helper.from_array(np.array([7], np.int32))}),
    Case("ConstantOfShape", [i64(4)], id="ConstantOfShape-default"),
    Case("Shape", [T]),
    Case("Shape", [T], attrs={"start": 1, "end": -1}, opset=15, id="Shape-slice"),
    Case("Size", [T]),
    Case("Range", [np.array(10, np.int32), np.array(-3, np.int32), np.array(-3, np.int32)]),
    Case("Range", [np.array(0.1, np.float32), np.array(2.0, np.float32),
                   np.array(0.3, np.float32)], id="Range-float"),
    Case("Trilu", [T]),
    Case("Trilu", [T, np.array(-1, np.int64)], attrs={"upper": 0}, id="Trilu-lower"),
    Case("Trilu", [f32(4, 6), np.array(2, np.int64)], id="Trilu-k"),
    Case("OneHot", [np.array([[0, 3], [-1, 9]], np.int64), np.array(4, np.int64),
                    np.array([0.5, 2.0], np.float32)], attrs={"axis": 1}),
    Case("DepthToSpace", [IMG], attrs={"blocksize": 2}),
    Case("DepthToSpace", [IMG], attrs={"blocksize": 2, "mode": "CRD"}, id="DepthToSpace-CRD"),
    Case("SpaceToDepth", [f32(2, 3, 4, 6)], attrs={"blocksize": 2}),
    Case("TopK", [ints(3, 6, low=0, high=4), i64(3)], outputs=2, opset=11),
    Case("TopK", [f32(3, 6), i64(2)], attrs={"largest": 0, "axis": 0}, outputs=2, opset=11,
         id="TopK-smallest"),
    Case("NonZero", [ints(3, 4, low=-1, high=2)]),
    Case("EyeLike", [f32(3, 5)], attrs={"k": 1}),
    Case("EyeLike", [f32(4, 4)], attrs={"dtype": onnx.TensorProto.INT32}, id="EyeLike-int"),
    Case("Compress", [f32(3, 4), np.array([1, 0, 1], bool)], attrs={"axis": 0}),
    Case("Compress", [f32(3, 4), np.array([0, 1, 1, 0, 1], bool)], id="Compress-flat"),
    Case("ReverseSequence", [f32(4, 3, 2), np.array([4, 1, 2], np.int64)]),
    Case("ReverseSequence", [f32(3, 4, 2), np.array([1, 4, 3], np.int64)],
         attrs={"batch_axis": 0, "time_axis": 1}, id="ReverseSequence-batch-first"),
]  # fmt: skip

ALL_CASES = ELEMENTWISE + ACTIVATIONS + REDUCTIONS + TENSOR


# --- harness ------------------------------------------------------------------------------------


def attr_value(attr: onnx.AttributeProto) -> Any:
    value = helper.get_attribute_value(attr)
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, onnx.TensorProto):
        return numpy_helper.to_array(value)
    if isinstance(value, list):
        return [v.decode() if isinstance(v, bytes) else v for v in value]
    return value


def build(case: Case) -> tuple[onnx.NodeProto, onnx.ModelProto, dict[str, np.ndarray]]:
    names = ["" if v is None else f"in{i}" for i, v in enumerate(case.inputs)]
    outputs = [f"out{i}" for i in range(case.outputs)]
    node = helper.make_node(case.op, names, outputs, name="n", **case.attrs)
    graph_inputs, initializers, feeds = [], [], {}
    for i, (name, value) in enumerate(zip(names, case.inputs, strict=True)):
        if value is None:
            continue
        if i in case.consts:
            initializers.append(numpy_helper.from_array(value, name))
        else:
            elem = helper.np_dtype_to_tensor_dtype(value.dtype)
            graph_inputs.append(helper.make_tensor_value_info(name, elem, value.shape))
            feeds[name] = value
    graph_outputs = [onnx.ValueInfoProto(name=name) for name in outputs]
    graph = helper.make_graph([node], "g", graph_inputs, graph_outputs, initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", case.opset)])
    model.ir_version = 8 if case.opset < 21 else 10
    return node, model, feeds


def run_ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return [np.asarray(v) for v in session.run(None, feeds)]


def node_info(case: Case, node: onnx.NodeProto, expected: list[np.ndarray]) -> NodeInfo:
    return NodeInfo(
        op_type=node.op_type,
        name=node.name,
        attrs={a.name: attr_value(a) for a in node.attribute},
        in_shapes=tuple(None if v is None else tuple(v.shape) for v in case.inputs),
        in_dtypes=tuple(None if v is None else str(v.dtype) for v in case.inputs),
        out_shapes=tuple(tuple(o.shape) for o in expected),
        out_dtypes=tuple(str(o.dtype) for o in expected),
        opset=case.opset,
        consts={i: case.inputs[i] for i in case.consts if case.inputs[i] is not None},  # type: ignore[misc]
    )


def assert_matches(case: Case, got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype, f"dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"shape {got.shape} != {want.shape}"
    if want.dtype == np.float16:
        np.testing.assert_allclose(got, want, rtol=max(case.rtol, 1e-3), atol=max(case.atol, 1e-3))
    elif want.dtype.kind == "f":
        np.testing.assert_allclose(got, want, rtol=case.rtol, atol=case.atol)
    else:
        np.testing.assert_array_equal(got, want)


def cuts(size: int) -> list[tuple[int, int]]:
    """Two or three uneven pieces covering [0, size)."""
    points = sorted({0, 1, (2 * size) // 3, size})
    return list(itertools.pairwise(points))


def compute_tile(
    opdef: OpDef, info: NodeInfo, inputs: list[np.ndarray | None], out_box: Box
) -> np.ndarray:
    boxes = opdef.input_boxes(info, out_box)
    assert len(boxes) == len(inputs)
    parts: list[np.ndarray | None] = []
    for value, box in zip(inputs, boxes, strict=True):
        if value is None:
            assert box is None, "a missing input must get no box"
            parts.append(None)
            continue
        assert box is not None
        assert len(box) == value.ndim
        for (start, stop), dim in zip(box, value.shape, strict=True):
            assert 0 <= start <= stop <= dim, f"box {box} outside {value.shape}"
        parts.append(value[box_slices(box)])
    tile = TileCtx(out_box=out_box, in_boxes=tuple(boxes))
    result = opdef.compute(info, parts, tile)[0]
    assert result.shape == box_shape(out_box)
    return result


def tiled(opdef: OpDef, info: NodeInfo, inputs: list[np.ndarray | None], axes: list[int]):
    out_shape = info.out_shapes[0]
    result = np.empty(out_shape, dtype=np.dtype(info.out_dtypes[0]))
    for ranges in itertools.product(*(cuts(out_shape[a]) for a in axes)):
        out_box = full_box(out_shape)
        for axis, rng in zip(axes, ranges, strict=True):
            out_box = out_box[:axis] + (rng,) + out_box[axis + 1 :]
        result[box_slices(out_box)] = compute_tile(opdef, info, inputs, out_box)
    return result


# --- tests --------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", [c.param() for c in ALL_CASES])
def test_op_matches_onnxruntime_whole_and_tiled(case: Case) -> None:
    node, model, feeds = build(case)
    expected = run_ort(model, feeds)
    opdef = REGISTRY.lookup(case.op, opset=case.opset)
    assert opdef is not None, f"{case.op} is not registered for opset {case.opset}"
    info = node_info(case, node, expected)

    got = opdef.compute(info, list(case.inputs), TileCtx.whole(info))
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert_matches(case, np.asarray(g), e)

    # Unsplit ops still get asked for the input boxes of their whole output, consts or not.
    for whole_info in (info, dataclasses.replace(info, consts={})):
        if info.out_shapes[0] and len(expected) == 1:
            full = full_box(info.out_shapes[0])
            got_whole = compute_tile(opdef, whole_info, list(case.inputs), full)
            assert_matches(case, got_whole, expected[0])

    split = opdef.split_axes(info)
    assert all(0 <= a < len(info.out_shapes[0]) for a in split)
    cut = [a for a in split if info.out_shapes[0][a] >= 2]
    for axes in [[a] for a in cut] + ([cut[:2]] if len(cut) >= 2 else []):
        assert_matches(case, tiled(opdef, info, list(case.inputs), axes), expected[0])


def test_broadcast_input_box_maps_size_one_axes_to_their_only_element() -> None:
    out_box = ((1, 2), (0, 3), (2, 5))
    assert broadcast_input_box((4, 1), (2, 4, 6), out_box) == ((0, 3), (0, 1))
    assert broadcast_input_box((2, 4, 6), (2, 4, 6), out_box) == out_box
    assert broadcast_input_box((), (2, 4, 6), out_box) == ()


def test_dropout_with_a_bad_ratio_in_training_mode_is_an_invalid_model() -> None:
    case = Case("Dropout", [T, np.array(1.5, np.float32), np.array(True)], opset=13)
    node, _, _ = build(case)
    info = node_info(case, node, [T])
    opdef = REGISTRY.lookup("Dropout", opset=13)
    assert opdef is not None
    with pytest.raises(CompileError, match=r"ratio 1.5") as err:
        opdef.compute(info, list(case.inputs), TileCtx.whole(info))
    assert err.value.code == "invalid_model"


SPLITTABLE = ["Add", "Relu", "Where", "Clip", "ReduceSum", "Transpose", "Concat", "Slice", "Gather"]


@pytest.mark.parametrize("op", SPLITTABLE)
def test_common_ops_offer_split_axes(op: str) -> None:
    """The ops the lowering cuts most often must offer at least one axis in these cases."""
    case = next(c for c in ALL_CASES if c.op == op)
    node, model, feeds = build(case)
    info = node_info(case, node, run_ort(model, feeds))
    opdef = REGISTRY.lookup(op, opset=case.opset)
    assert opdef is not None and opdef.split_axes(info)


def test_views_are_aliases_and_elementwise_ops_are_fusable() -> None:
    for op in ("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"):
        opdef = REGISTRY.lookup(op)
        assert opdef is not None and opdef.alias, op
    for op in ("Add", "Mul", "Relu", "Sigmoid", "Clip", "Where", "Cast", "Gelu", "Erf"):
        opdef = REGISTRY.lookup(op)
        assert opdef is not None and opdef.elementwise and not opdef.alias, op
    for op in ("ReduceSum", "Transpose", "Concat", "Split", "TopK"):
        opdef = REGISTRY.lookup(op)
        assert opdef is not None and not opdef.elementwise, op


def test_split_axes_empty_when_axes_are_not_constant() -> None:
    case = Case("ReduceSum", [R, i64(1)], opset=13)
    node, model, feeds = build(case)
    info = node_info(case, node, run_ort(model, feeds))
    opdef = REGISTRY.lookup("ReduceSum", opset=13)
    assert opdef is not None and opdef.split_axes(info) == []


def test_reduction_keeps_only_non_reduced_axes_splittable() -> None:
    case = REDUCTIONS[0]  # ReduceSum over axis 1 of (3, 4, 5), keepdims=0 -> (3, 5)
    node, model, feeds = build(case)
    info = node_info(case, node, run_ort(model, feeds))
    opdef = REGISTRY.lookup("ReduceSum", opset=13)
    assert opdef is not None
    assert opdef.split_axes(info) == [0, 1]
    assert opdef.input_boxes(info, ((1, 2), (0, 3))) == [((1, 2), (0, 4), (0, 3)), ((0, 1),)]
