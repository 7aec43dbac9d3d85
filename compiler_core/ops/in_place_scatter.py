"""Scatters into retained state done in place: which ops, which of their inputs a scatter DMA
reads, and where their rows land.

With `-retained-state`, a scatter whose data input is a KV cache and whose output is that
cache's `_RetainedState` writes the cache's own device buffer: the DMA writes the update's
rows and nothing else of the cache is read or written. Three ONNX ops write a cache:

- `TensorScatter` (opset 24): per batch entry, `seq_len` consecutive rows along a sequence
  axis from a write index (see `ops/kv_cache.py`). The DMA's `axis` is that axis.
- `ScatterND` (reduction none): QEfficient's `CtxScatter` / `CtxScatterCB`, whose indices
  (batch slot, head, position) are built at run time from `position_ids` and, with
  continuous batching, `batch_index`. Each index tuple of depth K names one slice
  `data[i0, ..., iK-1]`; the DMA's `axis` is K (the first axis of a slice).
- `ScatterElements` (reduction none): one element per index along `axis`.

The update and the indices are read whole (one tile: any index may name any row), except
TensorScatter's, which tiles by batch entry and head. A reduction (add, mul, max, min) would
read the rows it combines with, so it is not done in place (the output is copied instead).
An MXINT8 cache is written in whole MX rows (blocks of the last axis): ScatterND whose slices
span the last axis qualifies, ScatterElements does not.

Positions outside the cache are runtime faults naming the op, as ONNX leaves them undefined.
"""

from __future__ import annotations

import numpy as np

from compiler_core.errors import CompileError
from compiler_core.ops.registry import Box, NodeInfo, full_box

Array = np.ndarray

OPS = ("TensorScatter", "ScatterND", "ScatterElements")


def operands(op_type: str) -> tuple[int, int]:
    """(update input, indices input) of a scatter op: TensorScatter is (cache, update,
    write_indices), ScatterND and ScatterElements are (data, indices, updates)."""
    return (1, 2) if op_type == "TensorScatter" else (2, 1)


def can_scatter_in_place(info: NodeInfo, mxint8: bool) -> bool:
    """The op writes rows without reading the cache (and whole MX rows for an MXINT8 cache)."""
    if info.op_type not in OPS:
        return False
    if info.op_type == "TensorScatter":
        return True
    if str(info.attrs.get("reduction", "none")) != "none":
        return False
    if info.op_type == "ScatterElements":
        return not mxint8
    data, indices = info.in_shapes[0], info.in_shapes[1]
    if data is None or indices is None or not indices:
        return False
    return not mxint8 or int(indices[-1]) < len(data)


def dma_axis(info: NodeInfo) -> int:
    """The DMA's `axis`: the sequence axis (TensorScatter), the index depth K (ScatterND),
    the scatter axis (ScatterElements)."""
    data = info.in_shapes[0]
    assert data is not None
    rank = len(data)
    if info.op_type == "ScatterND":
        indices = info.in_shapes[1]
        assert indices is not None
        return int(indices[-1])
    default = -2 if info.op_type == "TensorScatter" else 0
    return int(info.attrs.get("axis", default)) % rank


def whole_input_boxes(node: NodeInfo, out_box: Box) -> list[Box | None]:
    """ScatterND / ScatterElements in place: no cache box, the indices and updates whole."""
    return [None, *(full_box(s or ()) for s in node.in_shapes[1:3])]


def fault(info: NodeInfo, message: str) -> CompileError:
    return CompileError("runtime_fault", f"{info.op_type}: {message}", node=info.name or None)


def nd_positions(info: NodeInfo, indices: Array, shape: tuple[int, ...]) -> Array:
    """[n, K] cache coordinates of a ScatterND's slices (negative indices count from the end);
    an index outside the cache is a fault."""
    k = indices.shape[-1]
    flat = np.asarray(indices).astype(np.int64).reshape(-1, k)
    bounds = np.array(shape[:k], np.int64)
    flat = np.where(flat < 0, flat + bounds, flat)
    bad = np.flatnonzero(((flat < 0) | (flat >= bounds)).any(axis=1))
    if bad.size:
        raise fault(
            info,
            f"index {indices.reshape(-1, k)[bad[0]].tolist()} is outside the cache "
            f"of shape {list(shape)}",
        )
    return flat


def element_positions(info: NodeInfo, indices: Array, size: int, axis: int) -> Array:
    """A ScatterElements' positions along `axis` (negative counts from the end), checked."""
    at = np.asarray(indices).astype(np.int64)
    at = np.where(at < 0, at + size, at)
    if at.size and (at.min() < 0 or at.max() >= size):
        raise fault(info, f"an index is outside [-{size}, {size}) on axis {axis}")
    return at
