"""Col2Im and MaxUnpool: scatter-adds and scatters back into an image.

Both write each input element to a position computed from attributes (Col2Im) or from data
(MaxUnpool's indices), so an output tile may receive any input element: they run whole.
The output shape comes from the compiler (`node.out_shapes`): Col2Im's image_shape and
MaxUnpool's output_shape fix it, and the compiler takes it from the constant input or from
the graph output's declared shape.

Col2Im adds one strided slice of the padded image per kernel offset (prod(block_shape)
vectorised adds, not one per column). MaxUnpool scatters into the shape a pooling with these
attributes would have come from, indices flattened over that whole tensor as MaxPool produces
them, then pads or crops that to output_shape at the end: this is what the ONNX reference and
its conformance data do.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from compiler_core.errors import CompileError
from compiler_core.ops.registry import FLOATS, INTS, NodeInfo, TileCtx, register

Array = np.ndarray


def _ints(node: NodeInfo, name: str, default: Sequence[int]) -> list[int]:
    return [int(v) for v in node.attr(name, default)]


def _invalid(node: NodeInfo, message: str) -> CompileError:
    return CompileError("invalid_model", f"{node.op_type}: {message}", node=node.name)


# --- Col2Im ---------------------------------------------------------------------------------


def _col2im_geometry(
    node: NodeInfo, block: Sequence[int]
) -> tuple[list[int], list[int], list[int], list[int]]:
    """Strides, dilations, pads (begins then ends) and the number of block positions per axis."""
    out_shape = node.out_shapes[0]
    in_shape = node.in_shapes[0]
    assert in_shape is not None
    image = [int(d) for d in out_shape[2:]]
    rank = len(image)
    strides = _ints(node, "strides", [1] * rank)
    dilations = _ints(node, "dilations", [1] * rank)
    pads = _ints(node, "pads", [0] * 2 * rank)
    if (
        len(block) != rank
        or len(strides) != rank
        or len(dilations) != rank
        or len(pads) != 2 * rank
    ):
        raise _invalid(node, f"block_shape, strides, dilations or pads do not have {rank} axes")
    if min(strides + dilations + list(block), default=1) < 1 or min(pads, default=0) < 0:
        raise _invalid(node, "strides, dilations and block_shape must be positive, pads >= 0")
    counts = [
        (image[i] + pads[i] + pads[rank + i] - dilations[i] * (block[i] - 1) - 1) // strides[i] + 1
        for i in range(rank)
    ]
    channels = int(out_shape[1])
    if in_shape[1] != channels * int(np.prod(block)) or in_shape[2] != int(np.prod(counts)):
        expect = (channels * int(np.prod(block)), int(np.prod(counts)))
        raise _invalid(
            node,
            f"input shape {in_shape} should end in {expect}: {channels} channels of "
            f"{list(block)} blocks at {counts} positions",
        )
    return strides, dilations, pads, counts


def _col2im_split(node: NodeInfo) -> list[int]:
    """Runs whole; a constant block_shape is checked here, at compile time."""
    block = node.consts.get(2)
    if block is not None:
        _col2im_geometry(node, [int(b) for b in block.reshape(-1)])
    return []


def col2im_compute(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    cols, block_in = inputs[0], inputs[2]
    assert cols is not None and block_in is not None
    block = [int(b) for b in block_in.reshape(-1)]
    strides, dilations, pads, counts = _col2im_geometry(node, block)
    out_shape = node.out_shapes[0]
    n, c, image = out_shape[0], out_shape[1], out_shape[2:]
    rank = len(image)
    padded_shape = [image[i] + pads[i] + pads[rank + i] for i in range(rank)]
    acc = np.float32 if cols.dtype == np.float16 else cols.dtype
    padded = np.zeros((n, c, *padded_shape), dtype=acc)
    blocks = cols.reshape(n, c, *block, *counts).astype(acc)
    for offset in itertools.product(*(range(b) for b in block)):
        window = tuple(
            slice(k * d, k * d + (m - 1) * s + 1, s)
            for k, d, m, s in zip(offset, dilations, counts, strides, strict=True)
        )
        kernel_at: tuple[Any, ...] = (slice(None), slice(None), *offset)
        padded[(slice(None), slice(None), *window)] += blocks[kernel_at]
    crop = tuple(slice(b, b + size) for b, size in zip(pads[:rank], image, strict=True))
    y = padded[(slice(None), slice(None), *crop)]
    return [y.astype(np.dtype(node.out_dtypes[0]))]


register(
    "Col2Im",
    col2im_compute,
    since=18,
    dtypes=FLOATS | INTS,
    kernel="col2im",
    split_axes=_col2im_split,
    macs=lambda node: int(np.prod(node.in_shapes[0] or (), dtype=np.int64)),
    doc="Sums column blocks back into an N-D image with strides, dilations and pads; "
    "image_shape fixes the output shape.",
)


# --- MaxUnpool ------------------------------------------------------------------------------


def _unpooled_shape(node: NodeInfo, x_shape: Sequence[int]) -> list[int]:
    """The shape of the tensor MaxPool would have read: where the indices point."""
    kernel = _ints(node, "kernel_shape", [])
    rank = len(x_shape) - 2
    strides = _ints(node, "strides", [1] * rank)
    pads = _ints(node, "pads", [0] * 2 * rank)
    if len(kernel) != rank or len(strides) != rank or len(pads) != 2 * rank:
        raise _invalid(node, f"kernel_shape, strides or pads do not have {rank} axes")
    spatial = [
        (x_shape[2 + i] - 1) * strides[i] - pads[i] - pads[rank + i] + kernel[i]
        for i in range(rank)
    ]
    if min(spatial, default=1) < 1:
        raise _invalid(node, f"kernel_shape {kernel}, strides and pads give an empty output")
    return [int(x_shape[0]), int(x_shape[1]), *spatial]


def _max_unpool_split(node: NodeInfo) -> list[int]:
    """Runs whole; checked here so that bad attributes fail at compile time."""
    x_shape = node.in_shapes[0]
    assert x_shape is not None
    _unpooled_shape(node, x_shape)
    return []


def max_unpool_compute(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    x, indices = inputs[0], inputs[1]
    assert x is not None and indices is not None
    shape = _unpooled_shape(node, x.shape)
    total = int(np.prod(shape, dtype=np.int64))
    flat_index = indices.reshape(-1).astype(np.int64)
    if flat_index.size and (flat_index.min() < 0 or flat_index.max() >= total):
        raise _invalid(node, f"an index is outside the {total} elements of shape {shape}")
    unpooled = np.zeros(total, dtype=x.dtype)
    unpooled[flat_index] = x.reshape(-1)
    unpooled = unpooled.reshape(shape)
    out_shape = node.out_shapes[0]
    y = np.zeros(out_shape, dtype=np.dtype(node.out_dtypes[0]))
    common = tuple(slice(0, min(a, b)) for a, b in zip(shape, out_shape, strict=True))
    y[common] = unpooled[common]
    return [y]


register(
    "MaxUnpool",
    max_unpool_compute,
    since=9,
    dtypes=FLOATS,
    kernel="max_unpool",
    split_axes=_max_unpool_split,
    macs=lambda node: int(np.prod(node.in_shapes[0] or (), dtype=np.int64)),
    doc="Scatters pooled values to their MaxPool indices; an output_shape larger than the "
    "inferred one zero-pads at the end.",
)
