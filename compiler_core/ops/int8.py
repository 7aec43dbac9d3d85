"""The int8 (and int16) kernels a quantized program runs, in exact integer arithmetic.

These are the compiler's own ops (domain `com.qpcfarm`): the fold-qdq pass turns a
DequantizeLinear -> float op -> QuantizeLinear group into one of them, so the program carries
integer tensors between kernels and the requantization each kernel applies, as integers:

- QConv / QMatMul: the product of the zero-point-centred operands summed exactly and wrapped
  to int32 (the accumulator), plus an int32 bias, or an int8 bias rescaled into the
  accumulator by its own fixed-point multiplier; then per output channel
  `y = round_half_even(acc * mult / 2**shift) + y_zero`, saturated to [y_min, y_max] (a fused
  Relu or Clip narrows that range). `rq` holds (mult, shift) per channel ([C, 2] or [1, 2]).
- QAdd / QMul: each operand centred, scaled by its fixed-point multiplier onto a common shift
  (QAdd) or multiplied and scaled once (QMul), rounded, offset, saturated.
- QAvgPool: GlobalAveragePool (or a spatial ReduceMean) as an exact sum requantized by
  mult / 2**shift, which includes 1 / count.
- QAveragePool: a windowed AveragePool, each window's exact sum requantized by the
  multiplier for its own tap count (pads without count_include_pad, ceil_mode edges).
- QLut: any unary elementwise op as a table over every input code (256 for 8 bits), built at
  compile time from the float op and both tensors' scales.

A multiplier is a float32 value decomposed exactly into a 24-bit mantissa and a shift
(`fixed_point`), so `acc * mult >> shift` is the exact product rounded once: ONNX Runtime
computes the same product in float32 and differs only where float32 rounding crosses a .5.
Operands are exact integers held in float64 for the BLAS product (|terms| < 2**16, sums far
below 2**53), then taken to int64.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from compiler_core.ops._tiling import broadcast_boxes, elementwise_split
from compiler_core.ops.conv import (
    conv_compute,
    conv_hmx,
    conv_input_boxes,
    conv_macs,
    conv_split_axes,
    gather_windows,
    tile_box,
)
from compiler_core.ops.matmul import (
    matmul_hmx,
    matmul_input_boxes,
    matmul_macs,
    matmul_split_axes,
    narrow,
)
from compiler_core.ops.pool import (
    global_input_boxes,
    global_macs,
    global_split_axes,
    pool_input_boxes,
    pool_macs,
    pool_split_axes,
    pool_windows,
    window_counts,
)
from compiler_core.ops.registry import (
    QPCFARM_DOMAIN,
    Box,
    NodeInfo,
    TileCtx,
    full_box,
    register,
)

Array = np.ndarray

DOMAIN = QPCFARM_DOMAIN
QTYPES = frozenset({"int8", "uint8", "int16", "uint16"})
MANTISSA_BITS = 24
MAX_SHIFT = 62


# ---------------------------------------------------------------------------------------------
# Fixed point


def fixed_point(multiplier: Array | float) -> tuple[Array, Array]:
    """float32 multipliers as (mantissa, shift) int64 arrays with m == mantissa * 2**-shift
    exactly (float32 has a 24-bit significand)."""
    m = np.asarray(multiplier, dtype=np.float32).astype(np.float64)
    if np.any(m < 0) or not np.all(np.isfinite(m)):
        raise ValueError(f"requantization multipliers must be finite and >= 0, got {m}")
    frac, exp = np.frexp(m)
    mant = np.rint(frac * (1 << MANTISSA_BITS)).astype(np.int64)
    shift = (MANTISSA_BITS - exp).astype(np.int64)
    if np.any(shift < 0):
        raise ValueError(f"requantization multiplier {m.max()} is too large (>= 2**24)")
    over = shift > MAX_SHIFT
    if np.any(over):  # a multiplier below 2**-38: keep the top bits that still count
        mant = np.where(over, round_shift(mant, np.where(over, shift - MAX_SHIFT, 0)), mant)
        shift = np.minimum(shift, MAX_SHIFT)
    mant = np.where(m == 0, 0, mant)
    shift = np.where(m == 0, 0, shift)
    return mant, shift


def round_shift(x: Array, shift: Array | int) -> Array:
    """x / 2**shift rounded half to even, in integers (x int64, shift >= 0)."""
    x = np.asarray(x, dtype=np.int64)
    s = np.asarray(shift, dtype=np.int64)
    q = x >> s
    r = x - (q << s)
    half = np.where(s > 0, np.left_shift(np.int64(1), np.maximum(s - 1, 0)), 0)
    up = (r > half) | ((r == half) & (s > 0) & ((q & 1) == 1))
    return q + up.astype(np.int64)


def requant_table(multipliers: Array | float) -> Array:
    """The [C, 2] int32 (mantissa, shift) table a kernel reads from multipliers."""
    mant, shift = fixed_point(np.atleast_1d(np.asarray(multipliers, dtype=np.float32)))
    return np.stack([mant, shift], axis=-1).astype(np.int32)


def _saturate(node: NodeInfo, y: Array) -> Array:
    out = np.dtype(node.out_dtypes[0])
    info = np.iinfo(out)
    lo = max(int(node.attr("y_min", info.min)), int(info.min))
    hi = min(int(node.attr("y_max", info.max)), int(info.max))
    return np.clip(y + int(node.attr("y_zero", 0)), lo, hi).astype(out)


def _wrap_int32(acc: Array) -> Array:
    """The exact sum as the 32-bit accumulator holds it (two's complement)."""
    return acc.astype(np.int64).astype(np.int32).astype(np.int64)


def _exact(y: Array) -> Array:
    return np.rint(y).astype(np.int64)


# ---------------------------------------------------------------------------------------------
# QConv and QMatMul: x, w, [bias], [w_zero], rq, [bias_rq]

X, W, BIAS, W_ZERO, RQ, BIAS_RQ = range(6)


def _float_view(node: NodeInfo) -> NodeInfo:
    """The node as the float Conv / MatMul rules see it: the two operands only, float64."""
    return dataclasses.replace(
        node,
        in_shapes=(node.in_shapes[X], node.in_shapes[W]),
        in_dtypes=("float64", "float64"),
        out_dtypes=("float64",),
        consts={},
    )


def _channel_box(node: NodeInfo, index: int, channels: tuple[int, int]) -> Box | None:
    shape = node.in_shapes[index] if index < len(node.in_shapes) else None
    if shape is None:
        return None
    if shape[0] == 1:
        return full_box(shape)
    return (channels, *full_box(shape[1:]))


def _channel_param(
    node: NodeInfo, inputs: Sequence[Array | None], tile: TileCtx, index: int, axis_shape: int
) -> Array | None:
    """A per-channel (or single) parameter cut to the tile's channels, as [C_tile, ...]."""
    value = inputs[index] if index < len(inputs) else None
    if value is None:
        return None
    if value.shape[0] == 1:
        return value
    wanted = _channel_box(node, index, tile.out_box[axis_shape])
    return narrow(value, tile_box(tile, node, index), wanted)


def _finish(
    node: NodeInfo,
    acc: Array,
    inputs: Sequence[Array | None],
    tile: TileCtx,
    axis: int,
    shape: tuple[int, ...],
) -> Array:
    """Bias, requantization and saturation of an accumulator tile whose channels lie on
    `axis` (`shape` broadcasts a [C] vector along it)."""
    wide = _wide(node)
    acc = acc if wide else _wrap_int32(acc)
    bias = _channel_param(node, inputs, tile, BIAS, axis)
    if bias is not None:
        b = bias.astype(np.int64)
        rescale = _channel_param(node, inputs, tile, BIAS_RQ, axis)
        if rescale is not None:
            b = round_shift(b * rescale[:, 0].astype(np.int64), rescale[:, 1])
        acc = acc + b.reshape(shape)
        acc = acc if wide else _wrap_int32(acc)
    rq = _channel_param(node, inputs, tile, RQ, axis)
    assert rq is not None
    mult = rq[:, 0].astype(np.int64).reshape(shape)
    shift = rq[:, 1].astype(np.int64).reshape(shape)
    return _saturate(node, _scaled(acc, mult, shift))


def _wide(node: NodeInfo) -> bool:
    """16-bit operands accumulate in 64 bits (their products overflow an int32 sum)."""
    return any(d in ("int16", "uint16") for d in node.in_dtypes[:2])


def _scaled(acc: Array, mult: Array, shift: Array) -> Array:
    """round(acc * mult / 2**shift), exact: in Python integers when int64 could overflow
    (a 16-bit accumulator times a 24-bit mantissa)."""
    if acc.size and int(np.abs(acc).max()) >= 1 << (62 - MANTISSA_BITS):
        exact = acc.astype(object) * np.broadcast_to(mult, acc.shape).astype(object)
        s = np.broadcast_to(shift, acc.shape).astype(object)
        q = exact >> s
        r = exact - (q << s)
        half = np.where(s > 0, 1 << np.maximum(s - 1, 0), 0)
        up = (r > half) | ((r == half) & (s > 0) & ((q & 1) == 1))
        return (q + up.astype(object)).astype(np.int64)
    return round_shift(acc * mult, shift)


def _centred(x: Array, zero: Array | int) -> Array:
    return x.astype(np.float64) - np.asarray(zero, dtype=np.float64)


def qconv_input_boxes(node: NodeInfo, out_box: Box) -> list[Box | None]:
    boxes: list[Box | None] = list(conv_input_boxes(_float_view(node), out_box)[:2])
    for index in range(2, len(node.in_shapes)):
        boxes.append(_channel_box(node, index, out_box[1]))
    return boxes


def qconv_compute(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    x, w = inputs[X], inputs[W]
    assert x is not None and w is not None
    w_box = tile_box(tile, node, W)
    zero = _channel_param(node, inputs, tile, W_ZERO, 1)
    w_zero: Array | int = 0
    if zero is not None:
        if zero.shape[0] == 1:
            w_zero = zero.reshape(())
        else:  # the tile's weights may cover more channels than the tile
            m0, m1 = tile.out_box[1]
            full = np.zeros(w_box[0][1] - w_box[0][0], np.float64)
            full[m0 - w_box[0][0] : m1 - w_box[0][0]] = zero
            w_zero = full.reshape((-1,) + (1,) * (w.ndim - 1))
    sub = TileCtx(tile.out_box, (tile_box(tile, node, X), w_box))
    centred = [_centred(x, int(node.attr("x_zero", 0))), _centred(w, w_zero)]
    (acc,) = conv_compute(_float_view(node), centred, sub)  # type: ignore[arg-type]
    shape = (1, -1) + (1,) * (acc.ndim - 2)
    return [_finish(node, _exact(acc), inputs, tile, 1, shape)]


def qmatmul_input_boxes(node: NodeInfo, out_box: Box) -> list[Box | None]:
    boxes: list[Box | None] = list(matmul_input_boxes(_float_view(node), out_box))
    for index in range(2, len(node.in_shapes)):
        boxes.append(_channel_box(node, index, out_box[-1]))
    return boxes


def qmatmul_compute(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    a, b = inputs[X], inputs[W]
    assert a is not None and b is not None
    a_box, b_box = matmul_input_boxes(_float_view(node), tile.out_box)
    a = narrow(a, tile_box(tile, node, X), a_box)
    b = narrow(b, tile_box(tile, node, W), b_box)
    zero = _channel_param(node, inputs, tile, W_ZERO, len(tile.out_box) - 1)
    b_zero: Array | int = 0 if zero is None else (zero.reshape(()) if zero.size == 1 else zero)
    acc = np.matmul(_centred(a, int(node.attr("x_zero", 0))), _centred(b, b_zero))
    return [_finish(node, _exact(acc), inputs, tile, len(tile.out_box) - 1, (-1,))]


# ---------------------------------------------------------------------------------------------
# QAdd, QMul: a, b with attributes a_zero, b_zero, y_zero, a_mult, b_mult (QAdd) or mult
# (QMul), shift


def qadd_compute(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    a, b = _operands(node, inputs, tile)
    total = a * int(node.attr("a_mult")) + b * int(node.attr("b_mult"))
    return [_saturate(node, round_shift(total, int(node.attr("shift"))))]


def qmul_compute(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    a, b = _operands(node, inputs, tile)
    product = _wrap_int32(a * b) * int(node.attr("mult"))
    return [_saturate(node, round_shift(product, int(node.attr("shift"))))]


def _operands(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> tuple[Array, Array]:
    wanted = broadcast_boxes(node, tile.out_box)
    out: list[Array] = []
    for index, side in enumerate("ab"):
        x = inputs[index]
        assert x is not None
        x = narrow(x, tile_box(tile, node, index), wanted[index])
        out.append(x.astype(np.int64) - int(node.attr(f"{side}_zero", 0)))
    return out[0], out[1]


# ---------------------------------------------------------------------------------------------
# QAvgPool (global): x with attributes x_zero, y_zero, mult, shift


def qavgpool_compute(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    x = inputs[0]
    assert x is not None
    box = tile_box(tile, node, 0)
    (n0, n1), (c0, c1) = tile.out_box[0], tile.out_box[1]
    part = x[n0 - box[0][0] : n1 - box[0][0], c0 - box[1][0] : c1 - box[1][0]]
    total = (part.astype(np.int64) - int(node.attr("x_zero", 0))).sum(
        axis=tuple(range(2, x.ndim)), keepdims=True
    )
    total = _wrap_int32(total) * int(node.attr("mult"))
    y = _saturate(node, round_shift(total, int(node.attr("shift"))))
    return [y.reshape(tuple(b - a for a, b in tile.out_box))]  # keepdims=0 of a ReduceMean


# ---------------------------------------------------------------------------------------------
# QAveragePool (windowed): x with AveragePool's attributes and x_zero, y_zero, mult, shift
# (mult / 2**shift = s_x / s_y). Each window's exact sum is divided by its own tap count
# exactly: round_half_even(sum * mult / (count * 2**shift)). A rounded 1/count multiplier
# would turn the exact ties of counts 2, 4, 6 ... into ups where ONNX Runtime divides.


def qaverage_pool_compute(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    x = inputs[0]
    assert x is not None
    wins = pool_windows(node)
    centred = x.astype(np.int64) - int(node.attr("x_zero", 0))
    view = gather_windows(centred, wins, tile.out_box, tile_box(tile, node, 0), 0, aligned=(0, 1))
    total = view.sum(axis=tuple(range(2 + len(wins), 2 + 2 * len(wins))))
    total = total if _wide(node) else _wrap_int32(total)
    count = np.broadcast_to(window_counts(node, wins, tile.out_box), total.shape)
    mult, shift = int(node.attr("mult")), int(node.attr("shift"))
    peak = int(np.abs(total).max()) if total.size else 0
    if peak * mult >= 1 << 62 or int(count.max(initial=1)) << (shift + 1) >= 1 << 62:
        total, count = total.astype(object), count.astype(object)  # exact whatever the shift
    y = _round_divide(total * mult, count << shift)
    return [_saturate(node, y.astype(np.int64))]


def _round_divide(n: Array, d: Array) -> Array:
    """n / d rounded half to even (d > 0), exactly, for int64 or Python-integer arrays."""
    q = n // d
    twice = (n - q * d) * 2
    up = (twice > d) | ((twice == d) & (q % 2 == 1))
    return q + up.astype(n.dtype)


# ---------------------------------------------------------------------------------------------
# QLut: x, table (one entry per code of x's type, lowest code first)


def qlut_boxes(node: NodeInfo, out_box: Box) -> list[Box | None]:
    table = node.in_shapes[1]
    assert table is not None
    return [out_box, full_box(table)]


def qlut_compute(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    x, table = inputs[0], inputs[1]
    assert x is not None and table is not None
    x = narrow(x, tile_box(tile, node, 0), tile.out_box)
    low = int(np.iinfo(x.dtype).min)
    return [table[x.astype(np.int64) - low].astype(np.dtype(node.out_dtypes[0]))]


def _elements(node: NodeInfo) -> int:
    return int(np.prod(node.out_shapes[0], dtype=np.int64))


register(
    "QConv",
    qconv_compute,
    domain=DOMAIN,
    dtypes=QTYPES,
    kernel="qconv",
    unit="hmx",
    split_axes=conv_split_axes,
    input_boxes=qconv_input_boxes,
    macs=conv_macs,
    hmx_shape=conv_hmx,
    doc="Internal (from fold-qdq): int8/int16 conv, int32 accumulation, fixed-point requant.",
)
register(
    "QMatMul",
    qmatmul_compute,
    domain=DOMAIN,
    dtypes=QTYPES,
    kernel="qmatmul",
    unit="hmx",
    split_axes=lambda node: matmul_split_axes(_float_view(node)),
    input_boxes=qmatmul_input_boxes,
    macs=matmul_macs,
    hmx_shape=matmul_hmx,
    doc="Internal (from fold-qdq): int8/int16 matmul, int32 accumulation, fixed-point requant.",
)
for _op, _compute in (("QAdd", qadd_compute), ("QMul", qmul_compute)):
    register(
        _op,
        _compute,
        domain=DOMAIN,
        dtypes=QTYPES,
        kernel=_op.lower(),
        split_axes=elementwise_split,
        input_boxes=broadcast_boxes,
        doc="Internal (from fold-qdq): int8/int16 elementwise, fixed-point requant.",
    )
register(
    "QAvgPool",
    qavgpool_compute,
    domain=DOMAIN,
    dtypes=QTYPES,
    kernel="qavgpool",
    split_axes=global_split_axes,
    input_boxes=global_input_boxes,
    macs=global_macs,
    doc="Internal (from fold-qdq): int8/int16 global average pool, fixed-point requant.",
)
register(
    "QAveragePool",
    qaverage_pool_compute,
    domain=DOMAIN,
    dtypes=QTYPES,
    kernel="qaverage_pool",
    split_axes=pool_split_axes,
    input_boxes=pool_input_boxes,
    macs=pool_macs,
    doc="Internal (from fold-qdq): int8/int16 windowed average pool (pads, strides, "
    "ceil_mode, count_include_pad): exact window sums, fixed-point requant per window count.",
)
register(
    "QLut",
    qlut_compute,
    domain=DOMAIN,
    dtypes=QTYPES,
    kernel="qlut",
    split_axes=elementwise_split,
    input_boxes=qlut_boxes,
    doc="Internal (from fold-qdq): a unary op on int8/int16 codes as a lookup table.",
)
