"""Linear (de)quantisation: QuantizeLinear, DequantizeLinear and DynamicQuantizeLinear.

Scale and zero point are per tensor (scalars), per axis (1-D along `axis`) or blocked (same
rank as X, `block_size` elements of `axis` per parameter). The static forms tile along every
axis, each tile taking the parameters its elements use. Only the integer types int8, uint8,
int16, uint16 and int32 are supported; float8 and 4-bit types are rejected at compile time.
"""

from __future__ import annotations

import numpy as np

from compiler_core.errors import CompileError
from compiler_core.ops.conv import tile_box
from compiler_core.ops.matmul import narrow
from compiler_core.ops.registry import (
    FLOATS,
    Box,
    NodeInfo,
    Shape,
    TileCtx,
    full_box,
    register,
)

Array = np.ndarray

QUANT_TYPES = frozenset({"int8", "uint8", "int16", "uint16", "int32"})


def _x_shape(node: NodeInfo) -> Shape:
    shape = node.in_shapes[0]
    assert shape is not None
    return shape


def _axis(node: NodeInfo) -> int:
    axis = int(node.attr("axis", 1))
    rank = len(_x_shape(node))
    return axis + rank if axis < 0 and rank else axis


def _per_tensor(shape: Shape) -> bool:
    return len(shape) == 0 or (len(shape) == 1 and shape[0] == 1)


def _param_box(node: NodeInfo, shape: Shape | None, out_box: Box) -> Box | None:
    """The part of a scale / zero point a tile of the output needs."""
    if shape is None:
        return None
    if _per_tensor(shape):
        return full_box(shape)
    axis = _axis(node)
    block = int(node.attr("block_size", 0))
    if block <= 0:
        return (out_box[axis],)
    lo, hi = out_box[axis]
    return tuple(
        (lo // block, -(-hi // block)) if a == axis else out_box[a] for a in range(len(shape))
    )


def _param_tile(
    node: NodeInfo, inputs: list[Array | None], tile: TileCtx, index: int
) -> Array | None:
    """Input `index` (scale or zero point) laid out to broadcast over the output tile."""
    value = inputs[index] if index < len(inputs) else None
    if value is None:
        return None
    if _per_tensor(value.shape):
        return value.reshape(())
    given = tile_box(tile, node, index)
    axis = _axis(node)
    out_box = tile.out_box
    block = int(node.attr("block_size", 0))
    if block <= 0:
        part = narrow(value, given, (out_box[axis],))
        shape = [1] * len(out_box)
        shape[axis] = -1
        return part.reshape(shape)
    lo, hi = out_box[axis]
    picked = np.take(value, np.arange(lo, hi) // block - given[axis][0], axis=axis)
    index_ = tuple(
        slice(None) if a == axis else slice(w0 - g0, w1 - g0)
        for a, ((g0, _), (w0, w1)) in enumerate(zip(given, out_box, strict=True))
    )
    return picked[index_]


def _input_boxes(node: NodeInfo, out_box: Box) -> list[Box | None]:
    return [out_box, *(_param_box(node, s, out_box) for s in node.in_shapes[1:])]


def _check_type(node: NodeInfo, dtype: str | None) -> None:
    if dtype is not None and dtype not in QUANT_TYPES:
        raise CompileError(
            "unsupported_dtype",
            f"{node.op_type} with quantised type {dtype} is not supported "
            f"(supported: {', '.join(sorted(QUANT_TYPES))})",
            node=node.name,
        )


def _quantize_split(node: NodeInfo) -> list[int]:
    """Every axis; also where the output type is checked, as lowering asks this first."""
    _check_type(node, node.out_dtypes[0])
    return list(range(len(node.out_shapes[0])))


def _dequantize_split(node: NodeInfo) -> list[int]:
    _check_type(node, node.in_dtypes[0])
    return list(range(len(node.out_shapes[0])))


def quantize_compute(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    """y = saturate(round_half_even(x / scale) + zero_point)."""
    x = inputs[0]
    assert x is not None
    out_dtype = np.dtype(node.out_dtypes[0])
    _check_type(node, out_dtype.name)
    x = narrow(x, tile_box(tile, node, 0), tile.out_box)
    acc = np.float64 if x.dtype == np.float64 else np.float32
    scale = _param_tile(node, inputs, tile, 1)
    assert scale is not None
    zero = _param_tile(node, inputs, tile, 2)
    y = np.rint(x.astype(acc) / scale.astype(acc))
    if zero is not None:
        y = y + zero.astype(np.float64)
    info = np.iinfo(out_dtype)
    return [np.clip(y, info.min, info.max).astype(out_dtype)]


def dequantize_compute(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    """y = (x - zero_point) * scale, in the scale's (or output_dtype's) float type."""
    x = inputs[0]
    assert x is not None
    _check_type(node, x.dtype.name)
    x = narrow(x, tile_box(tile, node, 0), tile.out_box)
    out_dtype = np.dtype(node.out_dtypes[0])
    acc = np.float64 if out_dtype == np.float64 else np.float32
    scale = _param_tile(node, inputs, tile, 1)
    assert scale is not None
    zero = _param_tile(node, inputs, tile, 2)
    centred = x.astype(np.int64) - (0 if zero is None else zero.astype(np.int64))
    return [(centred.astype(acc) * scale.astype(acc)).astype(out_dtype)]


def dynamic_quantize_compute(
    node: NodeInfo, inputs: list[Array | None], tile: TileCtx
) -> list[Array]:
    """uint8 quantisation with scale and zero point chosen from the data range (which
    always includes 0), as DynamicQuantizeLinear defines."""
    x = inputs[0]
    assert x is not None
    xf = x.astype(np.float32)
    low = min(0.0, float(xf.min())) if xf.size else 0.0
    high = max(0.0, float(xf.max())) if xf.size else 0.0
    scale = np.float32((high - low) / 255.0)
    zero = np.clip(np.rint(-low / scale), 0, 255) if scale != 0 else np.float32(0)
    y = np.clip(np.rint(xf / scale) + zero, 0, 255) if scale != 0 else np.full(xf.shape, zero)
    return [y.astype(np.uint8), np.asarray(scale, np.float32), np.asarray(zero, np.uint8)]


def _elements(node: NodeInfo) -> int:
    return int(np.prod(node.out_shapes[0], dtype=np.int64))


register(
    "QuantizeLinear",
    quantize_compute,
    since=10,
    dtypes=FLOATS,
    kernel="quantize_linear",
    split_axes=_quantize_split,
    input_boxes=_input_boxes,
    macs=_elements,
    doc="Per-tensor, per-axis or blocked; int8/uint8/int16/uint16/int32 outputs only.",
)
register(
    "DequantizeLinear",
    dequantize_compute,
    since=10,
    dtypes=QUANT_TYPES,
    kernel="dequantize_linear",
    split_axes=_dequantize_split,
    input_boxes=_input_boxes,
    macs=_elements,
    doc="Per-tensor, per-axis or blocked; int8/uint8/int16/uint16/int32 inputs only.",
)
register(
    "DynamicQuantizeLinear",
    dynamic_quantize_compute,
    since=11,
    dtypes=frozenset({"float32"}),
    kernel="dynamic_quantize_linear",
    macs=_elements,
    doc="Whole-tensor: the range reduction decides scale and zero point for every element.",
)
