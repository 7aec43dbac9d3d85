"""BitCast (opset 26): reinterpret a tensor's little-endian bytes as another type of the same
width, without converting values.

Element i of the output is made of element i's bytes alone, so the op tiles along every axis
with each tile reading the same box of the input. It is a kernel rather than an alias of its
input: aliases keep the input's element type. The width check runs at lowering (from the
split rule, which lowering asks first), so a mismatched `to` fails compilation. A bool output
keeps the input's byte as it is (a byte other than 0 or 1 stays so), as a bit copy must.
"""

from __future__ import annotations

import numpy as np

from compiler_core.errors import CompileError
from compiler_core.ops.matmul import narrow
from compiler_core.ops.registry import ALL, Box, NodeInfo, TileCtx, register

Array = np.ndarray


def _check_width(node: NodeInfo) -> None:
    source, target = np.dtype(str(node.in_dtypes[0])), np.dtype(node.out_dtypes[0])
    if source.itemsize != target.itemsize:
        raise CompileError(
            "invalid_model",
            f"BitCast from {source} ({8 * source.itemsize} bits) to {target} "
            f"({8 * target.itemsize} bits): 'to' must name a type of the same bit width",
            node=node.name,
        )


def bitcast_split_axes(node: NodeInfo) -> list[int]:
    _check_width(node)
    return list(range(len(node.out_shapes[0])))


def bitcast_input_boxes(node: NodeInfo, out_box: Box) -> list[Box | None]:
    return [out_box]


def bitcast_compute(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    x = inputs[0]
    assert x is not None
    _check_width(node)
    x = narrow(x, tile.in_boxes[0] if tile.in_boxes else None, tile.out_box)
    target = np.dtype(node.out_dtypes[0])
    # Little-endian bytes in, little-endian bytes out, whatever the host's byte order; copy
    # to C order first (a view needs contiguous bytes) without losing a 0-d shape.
    little = np.array(x, dtype=x.dtype.newbyteorder("<"), order="C")
    return [little.view(target.newbyteorder("<")).astype(target, copy=False)]


register(
    "BitCast",
    bitcast_compute,
    since=26,
    dtypes=ALL,
    kernel="bitcast",
    split_axes=bitcast_split_axes,
    input_boxes=bitcast_input_boxes,
    doc="Reinterpret the bytes as another type of the same width (numeric and bool types).",
)
