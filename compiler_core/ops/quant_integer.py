"""Integer matrix ops on 8-bit operands: MatMulInteger, ConvInteger, QLinearMatMul, QLinearConv.

Zero points are subtracted from the operands before the product, so padding in the conv ops
reads as a real zero, as the spec's dequantised view requires. The product itself reuses the
float MatMul / Conv kernels (and their tiling rules) in float64: every operand is an integer in
[-255, 255], so each product is below 2**16 and sums stay exact until about 10**11 terms, far
beyond any model. The exact sum is then taken to int64; the *Integer ops wrap it to int32 (what
32-bit accumulation gives, the only overflow the spec allows).

The QLinear ops requantise: the multiplier a_scale * b_scale / y_scale is formed in the scale's
own type (float32 or float16), applied to the sum in float32 as ONNX Runtime does (so a result
that lands on .5 in float32 rounds the way ORT rounds it), rounded half to even, offset by the
output zero point and saturated to its type.

Parameters: QLinearMatMul / MatMulInteger take per-tensor ones, per-row ones for A ([M] or
[..., M, 1]) and per-column ones for B ([N] or [..., 1, N]); the output's are per tensor.
The conv ops take a per-tensor x (and y) and a per-tensor or per-output-channel w.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from compiler_core.errors import CompileError
from compiler_core.ops.conv import conv_compute, conv_input_boxes, conv_macs, conv_split_axes
from compiler_core.ops.matmul import (
    broadcast_box,
    matmul_input_boxes,
    matmul_macs,
    matmul_split_axes,
    narrow,
)
from compiler_core.ops.registry import (
    Box,
    NodeInfo,
    Shape,
    TileCtx,
    full_box,
    invalid_model,
    register,
)

Array = np.ndarray

INT8 = frozenset({"int8", "uint8"})

Params = dict[str, list[Array | None]]
"""Per side ("a", "b", "y"): [scale, zero point] (the *Integer ops: [zero point]), each cut to
the tile, None where absent."""


@dataclass(frozen=True)
class Layout:
    """Where an op keeps its two operands, and which operand each other input belongs to:
    "a" (the first), "b" (the second) or "y" (the output). Scales come before zero points."""

    operands: tuple[int, int]
    params: dict[int, str]


INTEGER = Layout((0, 1), {2: "a", 3: "b"})
QLINEAR = Layout((0, 3), {1: "a", 2: "a", 4: "b", 5: "b", 6: "y", 7: "y"})


def _layout(node: NodeInfo) -> Layout:
    return QLINEAR if node.op_type.startswith("QLinear") else INTEGER


def _operands(node: NodeInfo) -> tuple[int, int]:
    return _layout(node).operands


def _params(node: NodeInfo) -> dict[int, str]:
    return {i: side for i, side in _layout(node).params.items() if node.has_input(i)}


def _shape(node: NodeInfo, index: int) -> Shape:
    shape = node.in_shapes[index]
    assert shape is not None
    return shape


def _per_tensor(shape: Shape) -> bool:
    return int(np.prod(shape, dtype=np.int64)) == 1


def _float_node(node: NodeInfo) -> NodeInfo:
    """The node as the float MatMul / Conv kernel sees it: the two operands only, float64."""
    first, second = _operands(node)
    return dataclasses.replace(
        node,
        in_shapes=(node.in_shapes[first], node.in_shapes[second]),
        in_dtypes=("float64", "float64"),
        out_dtypes=("float64",) * len(node.out_dtypes),
        consts={},
    )


def _given(tile: TileCtx, node: NodeInfo, index: int) -> Box:
    box = tile.in_boxes[index] if index < len(tile.in_boxes) else None
    return full_box(_shape(node, index)) if box is None else box


# ---------------------------------------------------------------------------------------------
# Checks (run at lowering, from split_axes, before any tile is planned)


def _check_types(node: NodeInfo) -> None:
    first, second = _operands(node)
    kinds = {"a": node.in_dtypes[first], "b": node.in_dtypes[second], "y": node.out_dtypes[0]}
    for index, side in _params(node).items():
        dtype = node.in_dtypes[index]
        if dtype not in ("float32", "float16") and dtype != kinds[side]:
            raise invalid_model(
                node,
                f"input {index} has type {dtype}; a zero point must have "
                f"the type of its tensor ({kinds[side]})",
            )
    if node.in_dtypes[second] not in INT8:
        raise CompileError(
            "unsupported_type",
            f"{node.op_type} operand of type {node.in_dtypes[second]} (int8/uint8 only)",
            node=node.name,
        )
    if node.op_type.startswith("QLinear") and node.out_dtypes[0] not in INT8:
        raise CompileError(
            "unsupported_type",
            f"{node.op_type} output of type {node.out_dtypes[0]} (int8/uint8 only)",
            node=node.name,
        )


def _matmul_param_view(node: NodeInfo, index: int, side: str) -> Shape:
    """The shape a matmul parameter broadcasts as: [M] for A is per row, i.e. [M, 1]."""
    shape = _shape(node, index)
    if _per_tensor(shape):
        return ()
    if side == "a" and len(shape) == 1:
        return (shape[0], 1)
    return shape


def _check_matmul_params(node: NodeInfo) -> None:
    first, second = _operands(node)
    operand = {"a": _shape(node, first), "b": _shape(node, second)}
    for index, side in _params(node).items():
        view = _matmul_param_view(node, index, side)
        if not view:
            continue
        if side == "y":
            raise invalid_model(
                node, f"input {index}: the output's scale and zero point are per tensor"
            )
        if len(operand["a"]) < 2 or len(operand["b"]) < 2:
            raise invalid_model(node, f"input {index}: per-row/column parameters need 2-D A and B")
        target = operand[side]
        try:
            fits = np.broadcast_shapes(view, target) == tuple(target)
        except ValueError:
            fits = False
        want = "[M] or [..., M, 1]" if side == "a" else "[N] or [..., 1, N]"
        if not fits or view[-2 if side == "a" else -1] != target[-2 if side == "a" else -1]:
            raise invalid_model(
                node,
                f"input {index} has shape {list(_shape(node, index))}; "
                f"expected a scalar or {want} for an operand of shape {list(target)}",
            )


def _check_conv_params(node: NodeInfo) -> None:
    channels = _shape(node, _operands(node)[1])[0]
    for index, side in _params(node).items():
        shape = _shape(node, index)
        if _per_tensor(shape):
            continue
        if side != "b" or len(shape) != 1 or shape[0] != channels:
            raise invalid_model(
                node,
                f"input {index} has shape {list(shape)}; expected a scalar"
                + (f" or [{channels}] (one per output channel)" if side == "b" else ""),
            )
    if node.op_type == "QLinearConv" and node.has_input(8):
        bias = _shape(node, 8)
        if tuple(bias) != (channels,) or node.in_dtypes[8] != "int32":
            raise invalid_model(node, f"bias must be int32 of shape [{channels}], got {list(bias)}")


# ---------------------------------------------------------------------------------------------
# Tiling: the float kernel's rule for the operands; parameters follow their operand's box


def matmul_split(node: NodeInfo) -> list[int]:
    _check_types(node)
    _check_matmul_params(node)
    return matmul_split_axes(_float_node(node))


def matmul_boxes(node: NodeInfo, out_box: Box) -> list[Box | None]:
    a_box, b_box = matmul_input_boxes(_float_node(node), out_box)
    assert a_box is not None and b_box is not None
    boxes: list[Box | None] = [None if s is None else full_box(s) for s in node.in_shapes]
    first, second = _operands(node)
    boxes[first], boxes[second] = a_box, b_box
    for index, side in _params(node).items():
        view = _matmul_param_view(node, index, side)
        if view:
            box = broadcast_box(view, a_box if side == "a" else b_box)
            boxes[index] = box[: len(_shape(node, index))]
    return boxes


def conv_split(node: NodeInfo) -> list[int]:
    _check_types(node)
    _check_conv_params(node)
    return conv_split_axes(_float_node(node))


def conv_boxes(node: NodeInfo, out_box: Box) -> list[Box | None]:
    x_box, w_box = conv_input_boxes(_float_node(node), out_box)[:2]
    boxes: list[Box | None] = [None if s is None else full_box(s) for s in node.in_shapes]
    first, second = _operands(node)
    boxes[first], boxes[second] = x_box, w_box
    channel_params = [i for i, side in _params(node).items() if side == "b"]
    if node.op_type == "QLinearConv" and node.has_input(8):
        channel_params.append(8)
    for index in channel_params:
        if not _per_tensor(_shape(node, index)):
            boxes[index] = (out_box[1],)
    return boxes


# ---------------------------------------------------------------------------------------------
# Kernels


def _param(
    node: NodeInfo, inputs: Sequence[Array | None], tile: TileCtx, index: int, wanted: Box
) -> Array | None:
    """Input `index` cut to the box `wanted` (a scalar when per tensor); None when absent."""
    value = inputs[index] if index < len(inputs) else None
    if value is None:
        return None
    if value.size == 1:
        return value.reshape(())
    return narrow(value, _given(tile, node, index), wanted)


def _side_params(
    node: NodeInfo, inputs: Sequence[Array | None], tile: TileCtx, boxes: list[Box | None]
) -> Params:
    found: Params = {"a": [], "b": [], "y": []}
    for index, side in _layout(node).params.items():
        box = boxes[index] if index < len(boxes) else None
        found[side].append(None if box is None else _param(node, inputs, tile, index, box))
    return found


def _centred(x: Array, zero: Array | None) -> Array:
    x64 = x.astype(np.float64)
    return x64 if zero is None else x64 - zero.astype(np.float64)


def _multiplier(scales: list[Array]) -> Array:
    """a_scale * b_scale / y_scale in the scales' own type, as the oracles form it."""
    a, b, y = scales
    return np.asarray((a * b) / y).astype(np.float32)


def _requantize(acc: Array, multiplier: Array, zero: Array | None, out: np.dtype) -> Array:
    y = np.rint(acc.astype(np.float32) * multiplier).astype(np.float64)
    if zero is not None:
        y = y + zero.astype(np.float64)
    info = np.iinfo(out)
    return np.clip(y, info.min, info.max).astype(out)


def _wrap_int32(acc: Array) -> Array:
    """The exact sum as 32-bit two's complement (what int32 accumulation would give)."""
    return acc.astype(np.int64).astype(np.int32)


def _matmul_product(
    node: NodeInfo, inputs: Sequence[Array | None], tile: TileCtx, params: Params
) -> Array:
    first, second = _operands(node)
    a_box, b_box = matmul_input_boxes(_float_node(node), tile.out_box)
    a, b = inputs[first], inputs[second]
    assert a is not None and b is not None and a_box is not None and b_box is not None
    a = narrow(a, _given(tile, node, first), a_box)
    b = narrow(b, _given(tile, node, second), b_box)
    a_zero, b_zero = params["a"][-1], params["b"][-1]
    if a_zero is not None and a_zero.ndim == 1:
        a_zero = a_zero.reshape(-1, 1)
    return np.asarray(np.matmul(_centred(a, a_zero), _centred(b, b_zero)))


def _conv_product(
    node: NodeInfo, inputs: Sequence[Array | None], tile: TileCtx, params: Params
) -> Array:
    first, second = _operands(node)
    x, w = inputs[first], inputs[second]
    assert x is not None and w is not None
    x_zero, w_zero = params["a"][-1], params["b"][-1]
    w_box = _given(tile, node, second)
    if w_zero is not None and w_zero.ndim == 1:
        # Per output channel: the tile's weights may cover more channels than the tile.
        m0, m1 = tile.out_box[1]
        full = np.zeros(w_box[0][1] - w_box[0][0], np.float64)
        full[m0 - w_box[0][0] : m1 - w_box[0][0]] = w_zero
        w_zero = full.reshape((-1,) + (1,) * (w.ndim - 1))
    sub_tile = TileCtx(tile.out_box, (_given(tile, node, first), w_box))
    float_node = _float_node(node)
    (acc,) = conv_compute(float_node, [_centred(x, x_zero), _centred(w, w_zero)], sub_tile)
    return acc


def _channels(value: Array | None, rank: int) -> Array | None:
    """A per-output-channel vector (already cut to the tile) shaped over (N, C, *spatial)."""
    if value is None or value.ndim == 0:
        return value
    return value.reshape((-1,) + (1,) * rank)


def matmul_integer_compute(
    node: NodeInfo, inputs: list[Array | None], tile: TileCtx
) -> list[Array]:
    params = _side_params(node, inputs, tile, matmul_boxes(node, tile.out_box))
    return [_wrap_int32(_matmul_product(node, inputs, tile, params))]


def conv_integer_compute(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    params = _side_params(node, inputs, tile, conv_boxes(node, tile.out_box))
    return [_wrap_int32(_conv_product(node, inputs, tile, params))]


def qlinear_matmul_compute(
    node: NodeInfo, inputs: list[Array | None], tile: TileCtx
) -> list[Array]:
    params = _side_params(node, inputs, tile, matmul_boxes(node, tile.out_box))
    acc = np.rint(_matmul_product(node, inputs, tile, params)).astype(np.int64)
    scales = [params[side][0] for side in "aby"]
    a_scale = scales[0]
    if a_scale is not None and a_scale.ndim == 1:
        scales[0] = a_scale.reshape(-1, 1)
    multiplier = _multiplier([s for s in scales if s is not None])
    return [_requantize(acc, multiplier, params["y"][1], np.dtype(node.out_dtypes[0]))]


def qlinear_conv_compute(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    boxes = conv_boxes(node, tile.out_box)
    params = _side_params(node, inputs, tile, boxes)
    acc = np.rint(_conv_product(node, inputs, tile, params)).astype(np.int64)
    rank = acc.ndim - 2
    if node.has_input(8):
        bias = _channels(_param(node, inputs, tile, 8, boxes[8] or ()), rank)
        assert bias is not None
        acc = acc + bias.astype(np.int64)
    scales = [params[side][0] for side in "aby"]
    scales[1] = _channels(scales[1], rank)
    multiplier = _multiplier([s for s in scales if s is not None])
    return [_requantize(acc, multiplier, params["y"][1], np.dtype(node.out_dtypes[0]))]


def _matmul_macs(node: NodeInfo) -> int:
    return matmul_macs(_float_node(node))


def _conv_macs(node: NodeInfo) -> int:
    return conv_macs(_float_node(node))


for _op, _compute, _split, _boxes, _macs, _doc in (
    (
        "MatMulInteger",
        matmul_integer_compute,
        matmul_split,
        matmul_boxes,
        _matmul_macs,
        "int8/uint8 matmul to int32; scalar, per-row (A) or per-column (B) zero points.",
    ),
    (
        "QLinearMatMul",
        qlinear_matmul_compute,
        matmul_split,
        matmul_boxes,
        _matmul_macs,
        "int8/uint8 quantised matmul; float32/float16 scales per tensor, row (A) or column (B).",
    ),
    (
        "ConvInteger",
        conv_integer_compute,
        conv_split,
        conv_boxes,
        _conv_macs,
        "int8/uint8 conv to int32; scalar x zero point, per-tensor or per-channel w zero point.",
    ),
    (
        "QLinearConv",
        qlinear_conv_compute,
        conv_split,
        conv_boxes,
        _conv_macs,
        "int8/uint8 quantised conv with int32 bias; w scale/zero point per tensor or channel.",
    ),
):
    register(
        _op,
        _compute,
        since=10,
        dtypes=INT8,
        kernel=_op.lower(),
        unit="hmx",
        split_axes=_split,
        input_boxes=_boxes,
        macs=_macs,
        doc=_doc,
    )
