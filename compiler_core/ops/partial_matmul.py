"""PartialMatMul: one slice of a MatMul's or Gemm's reduction axis per output row (K split).

The compiler's own op (domain `com.qpcfarm`), made by lowering (`lowering/ksplit.py`), never
by a model. A K split cuts a matrix product along its reduction axis K into `slices` parts;
output `[p, ...]` is the product of slice p alone:

    out[p] = alpha * A[..., k_p:k_p+1] @ B[k_p:k_p+1, :]

so the product is `sum(out, axis=0)`, which a ReduceSum kernel computes afterwards (with the
original kernel's bias and epilogue). Slice bounds are multiples of the HMX reduction block
(32) where K allows, so no slice pads a block the whole product would not.

Attributes: `slices`, `base` ("MatMul" or "Gemm"), and Gemm's `transA`, `transB`, `alpha`.
Inputs are the original A and B (B 2-D), so weights keep their layout in `constants.bin`.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from compiler_core.cost_rates import HMX_DEPTH
from compiler_core.ops.conv import WIDE_OPERANDS, product_accumulator
from compiler_core.ops.int8 import DOMAIN
from compiler_core.ops.matmul import narrow
from compiler_core.ops.registry import (
    FLOATS,
    Box,
    HmxShape,
    NodeInfo,
    TileCtx,
    box_shape,
    register,
)

BLOCK = HMX_DEPTH["fp16"]
"""The HMX reduction block (fp16) that slice bounds are aligned to."""


@functools.cache
def slice_bounds(depth: int, slices: int) -> tuple[int, ...]:
    """The `slices + 1` bounds of the K slices: near-equal, on multiples of BLOCK."""
    bounds = [min(depth, round(depth * p / slices / BLOCK) * BLOCK) for p in range(slices)]
    return (*bounds, depth)


def _depth(node: NodeInfo) -> int:
    a = node.in_shapes[0]
    assert a is not None
    if node.attr("base") == "Gemm" and int(node.attr("transA", 0)):
        return int(a[0])
    return int(a[-1])


def _k_range(node: NodeInfo, slices: tuple[int, int]) -> tuple[int, int]:
    bounds = slice_bounds(_depth(node), int(node.attr("slices")))
    return bounds[slices[0]], bounds[slices[1]]


def partial_split_axes(node: NodeInfo) -> list[int]:
    """Slices first (the point of the op), then the output's own axes."""
    return list(range(len(node.out_shapes[0])))


def partial_input_boxes(node: NodeInfo, out_box: Box) -> list[Box | None]:
    k = _k_range(node, out_box[0])
    rest, cols = out_box[1:-1], out_box[-1]
    if node.attr("base") == "Gemm":
        a_box: Box = (k, rest[0]) if int(node.attr("transA", 0)) else (rest[0], k)
        b_box: Box = (cols, k) if int(node.attr("transB", 0)) else (k, cols)
    else:
        a_box, b_box = (*rest, k), (k, cols)
    return [a_box, b_box]


def partial_compute(
    node: NodeInfo, inputs: list[np.ndarray | None], tile: TileCtx
) -> list[np.ndarray]:
    wanted = partial_input_boxes(node, tile.out_box)
    given = [tile.in_boxes[i] if i < len(tile.in_boxes) else None for i in range(2)]
    a_in, b_in = inputs[0], inputs[1]
    assert a_in is not None and b_in is not None
    a, b = narrow(a_in, given[0], wanted[0]), narrow(b_in, given[1], wanted[1])
    out_dtype = np.dtype(node.out_dtypes[0])
    acc = product_accumulator(out_dtype)
    a, b = a.astype(acc, copy=False), b.astype(acc, copy=False)
    gemm = node.attr("base") == "Gemm"
    if gemm and int(node.attr("transA", 0)):
        a = a.T
    if gemm and int(node.attr("transB", 0)):
        b = b.T
    bounds = slice_bounds(_depth(node), int(node.attr("slices")))
    p0, p1 = tile.out_box[0]
    k0 = bounds[p0]
    parts = []
    for p in range(p0, p1):
        lo, hi = bounds[p] - k0, bounds[p + 1] - k0
        parts.append(np.matmul(a[..., lo:hi], b[lo:hi]))
    y = np.stack(parts)
    alpha = float(node.attr("alpha", 1.0)) if gemm else 1.0
    if alpha != 1.0:
        y = y * acc(alpha)
    return [y.astype(out_dtype, copy=False)]


def partial_hmx(node: NodeInfo, out_box: Box) -> HmxShape:
    """Each slice is its own product: rows x (one slice of K) x columns, once per slice."""
    shape = box_shape(out_box)
    bounds = slice_bounds(_depth(node), int(node.attr("slices")))
    p0, p1 = out_box[0]
    depth = max(bounds[p + 1] - bounds[p] for p in range(p0, p1))
    rows = math.prod(shape[1:-1])
    return HmxShape(rows, depth, shape[-1], p1 - p0)


def partial_macs(node: NodeInfo) -> int:
    out = node.out_shapes[0]
    return int(np.prod(out[1:], dtype=np.int64)) * _depth(node)


register(
    "PartialMatMul",
    partial_compute,
    domain=DOMAIN,
    dtypes=FLOATS,
    kernel="partial_matmul",
    unit="hmx",
    tags=frozenset({WIDE_OPERANDS}),
    split_axes=partial_split_axes,
    input_boxes=partial_input_boxes,
    macs=partial_macs,
    hmx_shape=partial_hmx,
    doc="Internal (from K splits): one slice of a MatMul/Gemm reduction axis per output row.",
)
