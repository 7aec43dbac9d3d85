"""Box arithmetic shared by the op families' tiling rules.

Tiling rules answer "which part of each input does this output box need"; most answers are a
broadcast, a permutation or a crop of the output box, so those live here once.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from compiler_core.ops.registry import Box, NodeInfo, Shape, full_box


def broadcast_input_box(in_shape: Sequence[int], out_shape: Sequence[int], out_box: Box) -> Box:
    """The part of a numpy-broadcast input that an output box reads.

    Input axes align with the trailing output axes; an input axis of size 1 (broadcast) maps
    to (0, 1) whatever the output range; missing leading axes are dropped.
    """
    offset = len(out_shape) - len(in_shape)
    if offset < 0:
        raise ValueError(f"input rank {len(in_shape)} exceeds output rank {len(out_shape)}")
    box: list[tuple[int, int]] = []
    for axis, dim in enumerate(in_shape):
        start, stop = out_box[axis + offset]
        if int(dim) == 1 and int(out_shape[axis + offset]) != 1:
            box.append((0, 1))
        else:
            box.append((start, stop))
    return tuple(box)


def box_slices(box: Box) -> tuple[slice, ...]:
    """Index a whole tensor with a box: `array[box_slices(box)]`."""
    return tuple(slice(start, stop) for start, stop in box)


def relative_box(inner: Box, outer: Box) -> Box:
    """`inner` expressed in the coordinates of a tile that holds `outer` (inner within outer)."""
    return tuple((i0 - o0, i1 - o0) for (i0, i1), (o0, _) in zip(inner, outer, strict=True))


def crop(tile: np.ndarray, tile_box: Box | None, want: Box) -> np.ndarray:
    """The part `want` of a tile that holds `tile_box` (None: the tile is the whole tensor)."""
    if tile_box is None:
        return tile[box_slices(want)]
    return tile[box_slices(relative_box(want, tile_box))]


def replace_axis(box: Box, axis: int, rng: tuple[int, int]) -> Box:
    """`box` with the range of one axis replaced."""
    return box[:axis] + (rng,) + box[axis + 1 :]


def permute_box(box: Box, perm: Sequence[int]) -> Box:
    """The input box of a transpose: output axis i reads input axis perm[i]."""
    out: list[tuple[int, int]] = [(0, 0)] * len(box)
    for out_axis, in_axis in enumerate(perm):
        out[in_axis] = box[out_axis]
    return tuple(out)


def is_full(box: Box, shape: Shape) -> bool:
    return tuple(box) == full_box(shape)


def normalize_axis(axis: int, rank: int) -> int:
    """An ONNX axis (negative counts from the end) as a non-negative index."""
    if not -rank <= axis < max(rank, 1):
        raise ValueError(f"axis {axis} out of range for rank {rank}")
    return axis + rank if axis < 0 else axis


def all_axes(rank: int) -> list[int]:
    """Every axis, outermost first: the split preference of elementwise-like ops."""
    return list(range(rank))


def elementwise_split(node: NodeInfo) -> list[int]:
    """Any output axis of an elementwise op can be cut, outermost first."""
    return all_axes(len(node.out_shapes[0]))


def broadcast_boxes(node: NodeInfo, out_box: Box) -> list[Box | None]:
    """Input boxes of an op whose inputs all broadcast (numpy rules) to output 0."""
    out_shape = node.out_shapes[0]
    return [
        None if shape is None else broadcast_input_box(shape, out_shape, out_box)
        for shape in node.in_shapes
    ]
