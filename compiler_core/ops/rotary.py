"""RotaryEmbedding (opset 23+): rotate pairs of each head's first `rotary_embedding_dim`
channels by per-position angles given as cos/sin caches, looked up by `position_ids` (a table
of rows) or given per (batch, position) when there are none.

Each output element depends on its own (batch, position) angle and its pair partner in the same
head, so the op tiles along batch, heads (4-D input) and sequence; the head (or 3-D hidden)
axis stays whole. A tile reads its x box, its part of position_ids or of the per-position
caches, and the whole cache table when position_ids index it. float16 inputs are rotated in
float32 and rounded once. The attribute and shape checks run at lowering (from the split rule,
which lowering asks first), so a bad model fails to compile rather than to run.
"""

from __future__ import annotations

import numpy as np

from compiler_core.ops.matmul import broadcast_box, narrow
from compiler_core.ops.registry import (
    FLOATS,
    Box,
    NodeInfo,
    Shape,
    TileCtx,
    full_box,
    invalid_model,
    register,
)

Array = np.ndarray


def _shape(node: NodeInfo, index: int) -> Shape:
    shape = node.in_shapes[index]
    assert shape is not None
    return shape


def _geometry(node: NodeInfo) -> tuple[int, int, int]:
    """(heads, head size, rotated channels), after checking the input against the attributes."""
    x = _shape(node, 0)
    if len(x) == 4:
        heads, head = int(x[1]), int(x[3])
    elif len(x) == 3:
        heads = int(node.attr("num_heads", 0) or 0)
        if heads <= 0 or x[2] % heads:
            raise invalid_model(
                node, f"3-D input of hidden size {x[2]} needs num_heads dividing it, got {heads}"
            )
        head = int(x[2]) // heads
    else:
        raise invalid_model(node, f"input must be 3-D or 4-D, got {len(x)}-D")
    dim = int(node.attr("rotary_embedding_dim", 0) or 0) or head
    if dim % 2 or dim > head:
        raise invalid_model(node, f"rotary_embedding_dim {dim} must be even and at most {head}")
    return heads, head, dim


def _check(node: NodeInfo) -> None:
    _, _, dim = _geometry(node)
    x = _shape(node, 0)
    batch, seq = int(x[0]), int(x[2] if len(x) == 4 else x[1])
    with_ids = node.has_input(3)
    for index, name in ((1, "cos_cache"), (2, "sin_cache")):
        cache = _shape(node, index)
        per_position = len(cache) == 3 and cache[0] in (1, batch) and cache[1] in (1, seq)
        if cache[-1:] != (dim // 2,) or not (len(cache) == 2 if with_ids else per_position):
            want = "(positions, " if with_ids else f"({batch}, {seq}, "
            raise invalid_model(node, f"{name} has shape {list(cache)}, expected {want}{dim // 2})")
    if with_ids and tuple(_shape(node, 3)) not in ((batch, seq), (1, seq)):
        raise invalid_model(
            node, f"position_ids has shape {list(_shape(node, 3))}, expected {batch}x{seq}"
        )


def _batch_seq(node: NodeInfo, out_box: Box) -> tuple[tuple[int, int], tuple[int, int]]:
    return out_box[0], out_box[2] if len(out_box) == 4 else out_box[1]


def rotary_split_axes(node: NodeInfo) -> list[int]:
    _check(node)
    return [0, 1, 2] if len(node.out_shapes[0]) == 4 else [0, 1]


def rotary_input_boxes(node: NodeInfo, out_box: Box) -> list[Box | None]:
    rows, cols = _batch_seq(node, out_box)
    if node.has_input(3):
        ids = broadcast_box(_shape(node, 3), (rows, cols))
        return [out_box, full_box(_shape(node, 1)), full_box(_shape(node, 2)), ids]
    caches = [broadcast_box(_shape(node, i), (rows, cols, (0, _shape(node, i)[2]))) for i in (1, 2)]
    return [out_box, *caches]


def _angles(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> tuple[Array, Array]:
    """cos and sin for the tile, shaped (batch, seq, half)."""
    wanted = rotary_input_boxes(node, tile.out_box)

    def part(index: int) -> Array:
        value = inputs[index]
        assert value is not None
        given = tile.in_boxes[index] if index < len(tile.in_boxes) else None
        return narrow(value, given, wanted[index])

    cos, sin = part(1), part(2)
    if node.has_input(3):
        ids = part(3).astype(np.intp)
        cos, sin = cos[ids], sin[ids]
    return cos, sin


def rotary_compute(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    x = inputs[0]
    assert x is not None
    heads, head, dim = _geometry(node)
    x = narrow(x, tile.in_boxes[0] if tile.in_boxes else None, tile.out_box)
    work = np.float32 if x.dtype == np.float16 else x.dtype
    if x.ndim == 4:
        x4 = x.transpose(0, 2, 1, 3)  # (B, S, heads, head)
    else:
        x4 = x.reshape(x.shape[0], x.shape[1], heads, head)
    x4 = x4.astype(work, copy=False)
    cos, sin = (c.astype(work, copy=False)[:, :, None, :] for c in _angles(node, inputs, tile))
    rot, rest = x4[..., :dim], x4[..., dim:]
    interleaved = bool(int(node.attr("interleaved", 0)))
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    else:
        x1, x2 = rot[..., : dim // 2], rot[..., dim // 2 :]
    real = cos * x1 - sin * x2
    imag = sin * x1 + cos * x2
    if interleaved:
        rot = np.stack([real, imag], axis=-1).reshape(rot.shape)
    else:
        rot = np.concatenate([real, imag], axis=-1)
    y = np.concatenate([rot, rest], axis=-1)
    y = y.transpose(0, 2, 1, 3) if x.ndim == 4 else y.reshape(x.shape)
    return [np.ascontiguousarray(y, dtype=np.dtype(node.out_dtypes[0]))]


register(
    "RotaryEmbedding",
    rotary_compute,
    since=23,
    dtypes=FLOATS,
    kernel="rotary_embedding",
    split_axes=rotary_split_axes,
    input_boxes=rotary_input_boxes,
    macs=lambda node: 2 * int(np.prod(node.out_shapes[0], dtype=np.int64)),
    doc="Rotary position embedding: 3-D/4-D, interleaved or halves, partial rotation, with "
    "or without position_ids.",
)
