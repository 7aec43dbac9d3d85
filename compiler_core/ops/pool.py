"""Pooling: MaxPool, AveragePool, LpPool and their global forms.

Windowed pools tile along batch, channels and output rows/columns (with the window halo),
using the same global-coordinate window geometry as Conv.
"""

from __future__ import annotations

import numpy as np

from compiler_core.ops.conv import (
    Window,
    accumulator,
    gather_windows,
    ints,
    tile_box,
    windows,
)
from compiler_core.ops.registry import (
    FLOATS,
    Box,
    NodeInfo,
    TileCtx,
    full_box,
    register,
)


def pool_windows(node: NodeInfo) -> list[Window]:
    x_shape = node.in_shapes[0]
    assert x_shape is not None
    kernel = ints(node, "kernel_shape", [])
    return windows(node, kernel, x_shape[2:], node.out_shapes[0][2:])


def pool_split_axes(node: NodeInfo) -> list[int]:
    if len(node.out_shapes) > 1:
        return []
    return list(range(len(node.out_shapes[0])))


def pool_input_boxes(node: NodeInfo, out_box: Box) -> list[Box | None]:
    spatial = tuple(w.clipped(*out_box[2 + i]) for i, w in enumerate(pool_windows(node)))
    return [(out_box[0], out_box[1], *spatial)]


def pool_macs(node: NodeInfo) -> int:
    taps = int(np.prod(ints(node, "kernel_shape", []), dtype=np.int64))
    return int(np.prod(node.out_shapes[0], dtype=np.int64)) * taps


def _window_axes(rank: int) -> tuple[int, ...]:
    return tuple(range(2 + rank, 2 + 2 * rank))


def _lowest(dtype: np.dtype) -> float:
    return float(-np.inf) if dtype.kind == "f" else int(np.iinfo(dtype).min)


def _window_max(view: np.ndarray, rank: int) -> np.ndarray:
    """The max over the window axes of (N, C, *O, *K) windows, one tap at a time: a few
    passes over the output instead of a reduction over strided axes."""
    taps = view.shape[2 + rank :]
    if not all(taps):
        return view.max(axis=_window_axes(rank))
    y: np.ndarray | None = None
    for tap in np.ndindex(*taps):
        part = view[(Ellipsis, *tap)]
        y = part.copy() if y is None else np.maximum(y, part, out=y)
    assert y is not None
    return y


def max_pool_compute(
    node: NodeInfo, inputs: list[np.ndarray | None], tile: TileCtx
) -> list[np.ndarray]:
    x = inputs[0]
    assert x is not None
    wins = pool_windows(node)
    x_box = tile_box(tile, node, 0)
    fill = _lowest(x.dtype)
    view = gather_windows(x, wins, tile.out_box, x_box, fill, aligned=(0, 1))
    rank = len(wins)
    y = _window_max(view, rank)
    if len(node.out_shapes) == 1:
        return [y]
    # Indices: flat positions in the whole input (row-major, or column-major spatially when
    # storage_order is 1), as ONNX Runtime numbers them.
    x_shape = node.in_shapes[0]
    assert x_shape is not None
    spatial = x_shape[2:]
    grids = np.indices(spatial)
    order = (
        list(range(rank)) if int(node.attr("storage_order", 0)) == 0 else list(range(rank))[::-1]
    )
    flat = np.zeros(spatial, dtype=np.int64)
    for axis in order:
        flat = flat * spatial[axis] + grids[axis]
    plane = int(np.prod(spatial, dtype=np.int64))
    nc = np.arange(x_shape[0] * x_shape[1], dtype=np.int64).reshape(x_shape[0], x_shape[1])
    index = nc.reshape(*nc.shape, *([1] * rank)) * plane + flat
    index = index[tuple(slice(lo, hi) for lo, hi in x_box)]
    index_view = gather_windows(index, wins, tile.out_box, x_box, -1, aligned=(0, 1))
    flat_values = view.reshape(*view.shape[: 2 + rank], -1)
    arg = flat_values.argmax(axis=-1)[..., None]
    picked = np.take_along_axis(index_view.reshape(flat_values.shape), arg, axis=-1)[..., 0]
    return [y, picked]


def average_pool_compute(
    node: NodeInfo, inputs: list[np.ndarray | None], tile: TileCtx
) -> list[np.ndarray]:
    x = inputs[0]
    assert x is not None
    acc = accumulator(x.dtype)
    wins = pool_windows(node)
    view = gather_windows(
        x.astype(acc, copy=False), wins, tile.out_box, tile_box(tile, node, 0), 0.0, aligned=(0, 1)
    )
    total = view.sum(axis=_window_axes(len(wins)))
    count = window_counts(node, wins, tile.out_box).astype(acc)
    return [(total / count).astype(x.dtype, copy=False)]


def window_counts(node: NodeInfo, wins: list[Window], out_box: Box) -> np.ndarray:
    """The number of taps each output of the tile averages (spatial shape of the tile): the
    taps inside the input, or inside the padded input under count_include_pad."""
    include_pad = int(node.attr("count_include_pad", 0)) == 1
    count = np.ones((), dtype=np.int64)
    for i, win in enumerate(wins):
        o0, o1 = out_box[2 + i]
        starts = np.arange(o0, o1) * win.stride - win.pad_begin
        taps = starts[:, None] + np.arange(win.kernel) * win.dilation
        lo, hi = (-win.pad_begin, win.in_size + win.pad_end) if include_pad else (0, win.in_size)
        per_axis = ((taps >= lo) & (taps < hi)).sum(axis=1).astype(np.int64)
        count = np.multiply.outer(count, per_axis)
    return count


def lp_pool_compute(
    node: NodeInfo, inputs: list[np.ndarray | None], tile: TileCtx
) -> list[np.ndarray]:
    x = inputs[0]
    assert x is not None
    acc = accumulator(x.dtype)
    p = float(node.attr("p", 2))
    wins = pool_windows(node)
    powered = np.abs(x.astype(acc)) ** p
    view = gather_windows(powered, wins, tile.out_box, tile_box(tile, node, 0), 0.0, aligned=(0, 1))
    total = view.sum(axis=_window_axes(len(wins)))
    return [(total ** (1.0 / p)).astype(x.dtype, copy=False)]


register(
    "MaxPool",
    max_pool_compute,
    since=1,
    dtypes=FLOATS | {"int8", "uint8"},
    kernel="max_pool",
    split_axes=pool_split_axes,
    input_boxes=pool_input_boxes,
    macs=pool_macs,
    doc="Max pooling: pads, auto_pad, strides, dilations, ceil_mode; optional Indices output "
    "(then computed whole).",
)
register(
    "AveragePool",
    average_pool_compute,
    since=1,
    kernel="avg_pool",
    split_axes=pool_split_axes,
    input_boxes=pool_input_boxes,
    macs=pool_macs,
    doc="Average pooling: pads, auto_pad, strides, dilations, ceil_mode, count_include_pad.",
)
register(
    "LpPool",
    lp_pool_compute,
    since=1,
    kernel="lp_pool",
    split_axes=pool_split_axes,
    input_boxes=pool_input_boxes,
    macs=pool_macs,
    doc="Lp pooling over windows, zero padding.",
)


# ---------------------------------------------------------------------------------------------
# Global pools: reduce every spatial axis; tiles are (batch, channel) blocks.


def global_split_axes(node: NodeInfo) -> list[int]:
    return [0, 1]


def global_input_boxes(node: NodeInfo, out_box: Box) -> list[Box | None]:
    x_shape = node.in_shapes[0]
    assert x_shape is not None
    return [(out_box[0], out_box[1], *full_box(x_shape[2:]))]


def global_macs(node: NodeInfo) -> int:
    x_shape = node.in_shapes[0]
    assert x_shape is not None
    return int(np.prod(x_shape, dtype=np.int64))


def _global(x: np.ndarray, tile: TileCtx, node: NodeInfo) -> np.ndarray:
    """The (batch, channel) block of the given input that the output tile covers."""
    box = tile_box(tile, node, 0)
    (n0, n1), (c0, c1) = tile.out_box[0], tile.out_box[1]
    return x[n0 - box[0][0] : n1 - box[0][0], c0 - box[1][0] : c1 - box[1][0]]


def global_average_compute(
    node: NodeInfo, inputs: list[np.ndarray | None], tile: TileCtx
) -> list[np.ndarray]:
    x = inputs[0]
    assert x is not None
    part = _global(x, tile, node)
    axes = tuple(range(2, x.ndim))
    mean = part.astype(accumulator(x.dtype)).mean(axis=axes, keepdims=True)
    return [mean.astype(x.dtype, copy=False)]


def global_max_compute(
    node: NodeInfo, inputs: list[np.ndarray | None], tile: TileCtx
) -> list[np.ndarray]:
    x = inputs[0]
    assert x is not None
    return [_global(x, tile, node).max(axis=tuple(range(2, x.ndim)), keepdims=True)]


def global_lp_compute(
    node: NodeInfo, inputs: list[np.ndarray | None], tile: TileCtx
) -> list[np.ndarray]:
    x = inputs[0]
    assert x is not None
    p = float(node.attr("p", 2))
    part = np.abs(_global(x, tile, node).astype(accumulator(x.dtype))) ** p
    total = part.sum(axis=tuple(range(2, x.ndim)), keepdims=True)
    return [(total ** (1.0 / p)).astype(x.dtype, copy=False)]


for _op, _compute, _kernel in (
    ("GlobalAveragePool", global_average_compute, "global_avg_pool"),
    ("GlobalMaxPool", global_max_compute, "global_max_pool"),
    ("GlobalLpPool", global_lp_compute, "global_lp_pool"),
):
    register(
        _op,
        _compute,
        since=1,
        kernel=_kernel,
        split_axes=global_split_axes,
        input_boxes=global_input_boxes,
        macs=global_macs,
        doc="Reduces every spatial axis; tiles by batch and channel.",
    )
