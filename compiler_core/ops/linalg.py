"""Linear-algebra ops without a matmul shape: Det.

Det reduces each trailing M x M matrix to a scalar through an LU factorisation, which needs the
whole matrix, so the node runs whole as one tile. The factorisation runs in float64 and rounds
once to the output type (numpy's LU has no float16 path, and float32 loses digits on
ill-conditioned matrices).
"""

from __future__ import annotations

import numpy as np

from compiler_core.errors import CompileError
from compiler_core.ops.registry import FLOATS, NodeInfo, TileCtx, register

Array = np.ndarray


def _check_square(node: NodeInfo, shape: tuple[int, ...]) -> None:
    if len(shape) < 2 or shape[-1] != shape[-2]:
        raise CompileError(
            "invalid_model",
            f"Det: input shape {shape} does not end in a square matrix",
            node=node.name,
        )


def det_compute(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    x = inputs[0]
    assert x is not None
    _check_square(node, tuple(x.shape))
    out = np.linalg.det(x.astype(np.float64))
    return [np.asarray(out).astype(np.dtype(node.out_dtypes[0]))]


def det_macs(node: NodeInfo) -> int:
    """About M^3 / 3 multiply-adds of LU per matrix; also the compile-time shape check."""
    shape = node.in_shapes[0]
    assert shape is not None
    _check_square(node, tuple(shape))
    m = int(shape[-1])
    batch = int(np.prod(shape[:-2], dtype=np.int64))
    return batch * max(1, m**3 // 3)


register(
    "Det",
    det_compute,
    since=11,
    dtypes=FLOATS,
    kernel="det",
    macs=det_macs,
    doc="Whole-tensor kernel; determinant of each trailing square matrix via float64 LU.",
)
