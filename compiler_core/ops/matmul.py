"""MatMul, Gemm and Einsum: the HMX matrix ops.

MatMul tiles along rows of A, columns of B and the (numpy-broadcast) batch dims; Gemm along
its two output axes, honouring transA/transB and the broadcast of C. Einsum runs whole.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import DTypeLike

from compiler_core.ops.conv import WIDE_OPERANDS, product_accumulator, uniform_rows
from compiler_core.ops.registry import (
    FLOATS,
    Box,
    HmxShape,
    NodeInfo,
    Shape,
    TileCtx,
    box_shape,
    register,
)

MATMUL_TYPES = FLOATS | {"int32", "int64", "uint32", "uint64"}


def narrow(x: np.ndarray, given: Box | None, wanted: Box | None) -> np.ndarray:
    """The part `wanted` of an array that holds the part `given` (both in global coordinates)."""
    if given is None or wanted is None or given == wanted:
        return x
    index = tuple(slice(w0 - g0, w1 - g0) for (g0, _), (w0, w1) in zip(given, wanted, strict=True))
    return x[index]


def broadcast_box(shape: Shape, out_box: Box) -> Box:
    """The box of an input broadcast (numpy rules, right-aligned) to the output box."""
    tail = out_box[len(out_box) - len(shape) :] if shape else ()
    return tuple((0, 1) if dim == 1 else rng for dim, rng in zip(shape, tail, strict=True))


def _in_shapes(node: NodeInfo) -> tuple[Shape, Shape]:
    a, b = node.in_shapes[0], node.in_shapes[1]
    assert a is not None and b is not None
    return a, b


def _narrow_inputs(
    node: NodeInfo, inputs: list[np.ndarray | None], tile: TileCtx, wanted: list[Box | None]
) -> list[np.ndarray | None]:
    return [
        None
        if x is None
        else narrow(x, tile.in_boxes[i] if i < len(tile.in_boxes) else None, wanted[i])
        for i, x in enumerate(inputs)
    ]


# ---------------------------------------------------------------------------------------------
# MatMul


def matmul_split_axes(node: NodeInfo) -> list[int]:
    a, b = _in_shapes(node)
    rank = len(node.out_shapes[0])
    n_batch = rank - (len(a) >= 2) - (len(b) >= 2)
    axes = []
    if len(a) >= 2:
        axes.append(n_batch)
    if len(b) >= 2:
        axes.append(rank - 1)
    return axes + list(range(n_batch))


def matmul_input_boxes(node: NodeInfo, out_box: Box) -> list[Box | None]:
    a, b = _in_shapes(node)
    n_batch = len(out_box) - (len(a) >= 2) - (len(b) >= 2)
    batch = out_box[:n_batch]
    if len(a) >= 2:
        a_box = (*broadcast_box(a[:-2], batch), out_box[n_batch], (0, a[-1]))
    else:
        a_box = ((0, a[0]),)
    if len(b) >= 2:
        b_box = (*broadcast_box(b[:-2], batch), (0, b[-2]), out_box[-1])
    else:
        b_box = ((0, b[0]),)
    return [a_box, b_box]


def matmul_compute(
    node: NodeInfo, inputs: list[np.ndarray | None], tile: TileCtx
) -> list[np.ndarray]:
    a, b = _narrow_inputs(node, inputs, tile, matmul_input_boxes(node, tile.out_box))
    assert a is not None and b is not None
    out_dtype = np.dtype(node.out_dtypes[0])
    if out_dtype.kind == "f":
        acc = product_accumulator(out_dtype)
        a, b = a.astype(acc, copy=False), b.astype(acc, copy=False)
        if b.ndim == 2 and uniform_rows(b.T):
            return [_repeat_column(np.matmul(a, b[:, :1]), b.shape[1], out_dtype)]
    return [np.asarray(np.matmul(a, b)).astype(out_dtype, copy=False)]


def _repeat_column(y: np.ndarray, columns: int, dtype: DTypeLike) -> np.ndarray:
    """A product whose weight columns are all equal, computed for one column (see
    `uniform_rows`): that column, `columns` times."""
    return np.broadcast_to(y, (*y.shape[:-1], columns)).astype(dtype)


def matmul_hmx(node: NodeInfo, out_box: Box) -> HmxShape:
    """Rows x K x columns; batch dims repeat the product (shared weights stack as rows)."""
    a, b = _in_shapes(node)
    shape = box_shape(out_box)
    rows = shape[-2] if len(a) >= 2 else 1
    cols = shape[-1] if len(b) >= 2 else 1
    n_batch = len(shape) - (len(a) >= 2) - (len(b) >= 2)
    batch = math.prod(shape[:n_batch])  # per tile in the timeline: math, not numpy
    if len(b) <= 2:  # one weight matrix for every batch entry: the batch is more rows
        return HmxShape(rows * batch, int(a[-1]), cols)
    return HmxShape(rows, int(a[-1]), cols, batch)


def matmul_macs(node: NodeInfo) -> int:
    a, _ = _in_shapes(node)
    return int(np.prod(node.out_shapes[0], dtype=np.int64)) * int(a[-1])


register(
    "MatMul",
    matmul_compute,
    since=1,
    dtypes=MATMUL_TYPES,
    kernel="matmul",
    unit="hmx",
    tags=frozenset({WIDE_OPERANDS}),
    split_axes=matmul_split_axes,
    input_boxes=matmul_input_boxes,
    macs=matmul_macs,
    hmx_shape=matmul_hmx,
    doc="numpy matmul semantics: 1-D operands, broadcast batch dims.",
)


# ---------------------------------------------------------------------------------------------
# Gemm


def gemm_split_axes(node: NodeInfo) -> list[int]:
    return [0, 1]


def gemm_input_boxes(node: NodeInfo, out_box: Box) -> list[Box | None]:
    a, b = _in_shapes(node)
    rows, cols = out_box
    a_box = ((0, a[0]), rows) if int(node.attr("transA", 0)) else (rows, (0, a[1]))
    b_box = (cols, (0, b[1])) if int(node.attr("transB", 0)) else ((0, b[0]), cols)
    boxes: list[Box | None] = [a_box, b_box]
    if len(node.in_shapes) > 2:
        c = node.in_shapes[2]
        boxes.append(None if c is None else broadcast_box(c, out_box))
    return boxes


def gemm_compute(
    node: NodeInfo, inputs: list[np.ndarray | None], tile: TileCtx
) -> list[np.ndarray]:
    narrowed = _narrow_inputs(node, inputs, tile, gemm_input_boxes(node, tile.out_box))
    a, b = narrowed[0], narrowed[1]
    c = narrowed[2] if len(narrowed) > 2 else None
    assert a is not None and b is not None
    out_dtype = np.dtype(node.out_dtypes[0])
    acc = product_accumulator(out_dtype)
    a, b = a.astype(acc, copy=False), b.astype(acc, copy=False)
    if int(node.attr("transA", 0)):
        a = a.T
    if int(node.attr("transB", 0)):
        b = b.T
    alpha, beta = node.attr("alpha", 1.0), node.attr("beta", 1.0)
    y = _repeat_column(a @ b[:, :1], b.shape[1], acc) if uniform_rows(b.T) else a @ b
    if alpha != 1.0:
        y = y * acc(alpha)
    if c is not None and beta != 0.0:
        c = c.astype(acc, copy=False)
        y = y + (c if beta == 1.0 else c * acc(beta))
    return [np.broadcast_to(y, [hi - lo for lo, hi in tile.out_box]).astype(out_dtype)]


def gemm_hmx(node: NodeInfo, out_box: Box) -> HmxShape:
    a, _ = _in_shapes(node)
    rows, cols = box_shape(out_box)
    return HmxShape(rows, int(a[0] if int(node.attr("transA", 0)) else a[1]), cols)


def gemm_macs(node: NodeInfo) -> int:
    a, _ = _in_shapes(node)
    k = a[0] if int(node.attr("transA", 0)) else a[1]
    return int(np.prod(node.out_shapes[0], dtype=np.int64)) * int(k)


register(
    "Gemm",
    gemm_compute,
    since=1,
    dtypes=FLOATS,
    kernel="gemm",
    unit="hmx",
    tags=frozenset({WIDE_OPERANDS}),
    split_axes=gemm_split_axes,
    input_boxes=gemm_input_boxes,
    macs=gemm_macs,
    hmx_shape=gemm_hmx,
    doc="alpha * A' @ B' + beta * C with transA/transB and a broadcast C.",
)


# ---------------------------------------------------------------------------------------------
# Einsum (whole only)


def einsum_compute(
    node: NodeInfo, inputs: list[np.ndarray | None], tile: TileCtx
) -> list[np.ndarray]:
    operands = [x for x in inputs if x is not None]
    out_dtype = np.dtype(node.out_dtypes[0])
    if out_dtype.kind == "f":
        operands = [x.astype(product_accumulator(out_dtype), copy=False) for x in operands]
    equation = str(node.attr("equation")).replace(" ", "")
    y = np.einsum(equation, *operands, optimize=True)
    return [np.asarray(y).astype(out_dtype, copy=False)]


def einsum_macs(node: NodeInfo) -> int:
    """Product of every index's extent (ellipsis dims included): the loop-nest size."""
    equation = str(node.attr("equation")).replace(" ", "")
    terms = equation.split("->")[0].split(",")
    sizes: dict[str, int] = {}
    ellipsis: list[Shape] = []
    for term, shape in zip(terms, node.in_shapes, strict=False):
        if shape is None:
            continue
        head, _, tail = term.partition("...")
        n_ell = len(shape) - len(head) - len(tail) if "..." in term else 0
        for letter, dim in zip(head, shape, strict=False):
            sizes[letter] = max(sizes.get(letter, 1), int(dim))
        for letter, dim in zip(tail, shape[len(shape) - len(tail) :], strict=False):
            sizes[letter] = max(sizes.get(letter, 1), int(dim))
        if "..." in term:
            ellipsis.append(tuple(shape[len(head) : len(head) + n_ell]))
    total = int(np.prod(list(sizes.values()), dtype=np.int64))
    if ellipsis:
        total *= int(np.prod(np.broadcast_shapes(*ellipsis), dtype=np.int64))
    return max(total, 1)


register(
    "Einsum",
    einsum_compute,
    since=12,
    dtypes=MATMUL_TYPES,
    kernel="einsum",
    unit="hmx",
    tags=frozenset({WIDE_OPERANDS}),
    macs=einsum_macs,
    doc="General Einstein summation; runs whole (not tiled).",
)
