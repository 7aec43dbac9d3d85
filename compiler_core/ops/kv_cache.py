"""ONNX TensorScatter (opset 24): writes a KV-cache update into a fixed-size cache buffer at a
per-batch write index, linearly or wrapping around (circular).

Tiled along every axis but the sequence axis (batch entries, heads, head dims): a tile
holds the whole sequence, so whatever positions the write_indices values name at run time
fall inside it; the sequence axis itself cannot be cut statically. The cache tile is copied
and the update written with one indexed assignment per batch entry; no arithmetic is done, so
every element type is exact. The update may not be longer than the cache, in
either mode (sequence_length <= max_sequence_length, as the specification states).

Attributes and shapes are checked when the node is lowered (from `split_axes`, which lowering
asks first). A linear-mode write index that runs past the end of the cache can only be seen
at run time and is a runtime fault naming the batch entry.

In place: when the cache is retained state (`-retained-state`) and the scatter's output is the
cache's own `_RetainedState`, lowering makes the output the cache's buffer and the kernel a
scatter DMA (`IN_PLACE_KERNEL`): its tiles read only the update and the write indices
(`in_place_input_boxes`) and the DMA writes the update's rows at the positions the indices
name (`positions`); no other row of the cache is read or written.
"""

from __future__ import annotations

import numpy as np

from compiler_core.errors import CompileError
from compiler_core.ops.registry import ALL, Box, NodeInfo, TileCtx, invalid_model, register

Array = np.ndarray

_MODES = ("linear", "circular")


def _mode(node: NodeInfo) -> str:
    return node.choice("mode", "linear", _MODES)


def _axis(node: NodeInfo) -> int:
    """The sequence axis, validated against the cache and update shapes."""
    cache, update = node.in_shapes[0], node.in_shapes[1]
    assert cache is not None and update is not None
    rank = len(cache)
    axis = int(node.attr("axis", -2))
    if not -rank <= axis < rank or axis % rank == 0:
        raise invalid_model(node, f"axis {axis} is out of range or the batch axis for rank {rank}")
    axis %= rank
    if len(update) != rank:
        raise invalid_model(node, f"update rank {len(update)} differs from past_cache rank {rank}")
    others = [a for a in range(rank) if a != axis]
    if any(update[a] != cache[a] for a in others):
        raise invalid_model(
            node, f"update shape {update} differs from past_cache {cache} off axis {axis}"
        )
    if update[axis] > cache[axis]:
        raise invalid_model(
            node, f"update length {update[axis]} exceeds cache length {cache[axis]} on axis {axis}"
        )
    if node.has_input(2) and tuple(node.in_shapes[2] or ()) != (cache[0],):
        raise invalid_model(node, f"write_indices shape {node.in_shapes[2]} is not ({cache[0]},)")
    return axis


def _split_axes(node: NodeInfo) -> list[int]:
    """Every axis but the sequence axis; lowering asks this first, so it is where the node is
    validated."""
    _mode(node)
    axis = _axis(node)
    return [a for a in range(len(node.out_shapes[0])) if a != axis]


def _input_boxes(node: NodeInfo, out_box: Box) -> list[Box | None]:
    """The cache tile itself, the update over the whole (new) sequence, the tile's indices."""
    axis = _axis(node)
    update = node.in_shapes[1]
    assert update is not None
    update_box = out_box[:axis] + ((0, update[axis]),) + out_box[axis + 1 :]
    boxes: list[Box | None] = [out_box, update_box]
    if node.has_input(2):
        boxes.append((out_box[0],))
    return boxes


IN_PLACE_KERNEL = "tensor_scatter_in_place"
"""The kernel name of a TensorScatter done in place by a scatter DMA (see the module doc)."""


def in_place_input_boxes(node: NodeInfo, out_box: Box) -> list[Box | None]:
    """In place: no cache box (it is not read), the update over the new rows, the indices."""
    boxes = _input_boxes(node, out_box)
    return [None, *boxes[1:]]


def sequence_axis(node: NodeInfo) -> int:
    return _axis(node)


def positions(node: NodeInfo, start: int, length: int, size: int, batch: int) -> Array:
    """Cache positions of the update's `length` steps written from `start` (a runtime fault
    when a linear-mode write runs past the cache)."""
    return _positions(node, start, length, size, batch)


def _positions(node: NodeInfo, start: int, length: int, size: int, batch: int) -> Array:
    """Cache positions of the update's `length` steps written from `start`."""
    if _mode(node) == "circular":
        return (start + np.arange(length)) % size
    if start < 0 or start + length > size:
        raise CompileError(
            "runtime_fault",
            f"TensorScatter: write index {start} for batch {batch} plus {length} new steps "
            f"does not fit the cache length {size} (linear mode)",
            node=node.name,
        )
    return start + np.arange(length)


def tensor_scatter_compute(
    node: NodeInfo, inputs: list[Array | None], tile: TileCtx
) -> list[Array]:
    cache, update = inputs[0], inputs[1]
    assert cache is not None and update is not None
    axis = _axis(node)
    indices = inputs[2] if len(inputs) > 2 else None
    batch = cache.shape[0]
    starts = np.zeros(batch, np.int64) if indices is None else indices.astype(np.int64)
    present = np.array(cache, dtype=np.dtype(node.out_dtypes[0]), copy=True)
    size, length = cache.shape[axis], update.shape[axis]
    # Sequence axis next to the batch axis; both are views, so writes land in `present`.
    target = np.moveaxis(present, axis, 1)
    source = np.moveaxis(update, axis, 1)
    first = tile.out_box[0][0] if tile.out_box else 0
    for b in range(batch):
        target[b, _positions(node, int(starts[b]), length, size, first + b)] = source[b]
    return [present]


register(
    "TensorScatter",
    tensor_scatter_compute,
    since=24,
    dtypes=ALL,
    kernel="tensor_scatter",
    split_axes=_split_axes,
    input_boxes=_input_boxes,
    macs=lambda node: 0,
    doc="KV-cache write at per-batch indices along a sequence axis; linear or circular mode.",
)
