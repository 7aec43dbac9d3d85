"""Conv and ConvTranspose, plus the sliding-window geometry that pooling shares.

Tiles are computed in global coordinates: a kernel reads where its tile sits from the
`TileCtx` boxes and works out, per spatial axis, which input positions it needs and how much
of that range is implicit padding. The input it was given may be any box containing what it
needs (a whole tensor included), so the same code serves whole ops and tiles.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from compiler_core.ops.registry import (
    FLOATS,
    Box,
    HmxShape,
    NodeInfo,
    Shape,
    TileCtx,
    box_shape,
    full_box,
    register,
)


@dataclass(frozen=True)
class Window:
    """Sliding-window geometry of one spatial axis, in global coordinates."""

    kernel: int
    stride: int
    dilation: int
    pad_begin: int
    pad_end: int
    in_size: int
    out_size: int

    @property
    def span(self) -> int:
        return (self.kernel - 1) * self.dilation + 1

    def need(self, o0: int, o1: int) -> tuple[int, int]:
        """Input range [lo, hi) read by outputs [o0, o1), padding positions included."""
        lo = o0 * self.stride - self.pad_begin
        return lo, (o1 - 1) * self.stride - self.pad_begin + self.span

    def clipped(self, o0: int, o1: int) -> tuple[int, int]:
        lo, hi = self.need(o0, o1)
        return clip_range(lo, hi, self.in_size)


def clip_range(lo: int, hi: int, size: int) -> tuple[int, int]:
    """Clip [lo, hi) to [0, size), never empty: a tile made only of padding still gets one
    element, which its kernel then ignores, so that no box is ever empty."""
    # conditional expressions, not min/max: called for every axis of every tile cut tried
    lo = lo if lo > 0 else 0
    hi = hi if hi < size else size
    if hi <= lo:
        lo = lo if lo < size - 1 else size - 1
        hi = lo + 1
    return lo, hi


def ints(node: NodeInfo, name: str, default: Sequence[int]) -> list[int]:
    value = node.attr(name)
    return [int(v) for v in (default if value is None else value)]


def windows(
    node: NodeInfo, kernel_shape: Sequence[int], in_spatial: Shape, out_spatial: Shape
) -> list[Window]:
    """Per-axis geometry from strides, dilations, pads and auto_pad (ONNX defaults applied)."""
    rank = len(kernel_shape)
    strides = ints(node, "strides", [1] * rank)
    dilations = ints(node, "dilations", [1] * rank)
    pads = ints(node, "pads", [0] * (2 * rank))
    auto_pad = str(node.attr("auto_pad", "NOTSET"))
    result = []
    for i in range(rank):
        k, s, d = int(kernel_shape[i]), strides[i], dilations[i]
        n_in, n_out = int(in_spatial[i]), int(out_spatial[i])
        if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            total = max(0, (n_out - 1) * s + (k - 1) * d + 1 - n_in)
            begin = total // 2 if auto_pad == "SAME_UPPER" else total - total // 2
            end = total - begin
        elif auto_pad == "VALID":
            begin = end = 0
        else:
            begin, end = pads[i], pads[i + rank]
        result.append(Window(k, s, d, begin, end, n_in, n_out))
    return result


def crop_or_pad(x: np.ndarray, axis: int, start: int, stop: int, fill: float) -> np.ndarray:
    """x[start:stop] along `axis`, with positions outside [0, len) set to `fill`."""
    n = x.shape[axis]
    before = max(0, min(stop, 0) - start)
    after = max(0, stop - max(start, n))
    index = [slice(None)] * x.ndim
    index[axis] = slice(max(start, 0), max(min(stop, n), max(start, 0)))
    part = x[tuple(index)]
    if before == 0 and after == 0:
        return part
    widths = [(0, 0)] * x.ndim
    widths[axis] = (before, after)
    return np.pad(part, widths, mode="constant", constant_values=fill)


def crop_or_pad_all(
    x: np.ndarray, ranges: Sequence[tuple[int, int] | None], fill: float
) -> np.ndarray:
    """`crop_or_pad` along every axis given a range (None: the whole axis), in one copy at
    most: a view when no position falls outside `x`."""
    wanted = [(0, n) if r is None else r for r, n in zip(ranges, x.shape, strict=True)]
    inside = tuple(
        slice(min(max(a, 0), n), min(max(b, 0), n))
        for (a, b), n in zip(wanted, x.shape, strict=True)
    )
    if all(0 <= a and b <= n for (a, b), n in zip(wanted, x.shape, strict=True)):
        return x[inside]
    out = np.full([b - a for a, b in wanted], fill, dtype=x.dtype)
    target = tuple(
        slice(s.start - a, s.start - a + (s.stop - s.start))
        for s, (a, _) in zip(inside, wanted, strict=True)
    )
    out[target] = x[inside]
    return out


def _window_ranges(
    shape: Sequence[int],
    wins: Sequence[Window],
    out_box: Box,
    in_box: Box,
    aligned: Sequence[int],
) -> list[tuple[int, int] | None]:
    """Per axis of an input of `shape` given as `in_box`, the range of it the windows of the
    output tile `out_box` read (None: the whole axis); see `gather_windows`."""
    first = len(shape) - len(wins)
    ranges: list[tuple[int, int] | None] = [None] * len(shape)
    for axis in aligned:
        shift = in_box[axis][0]
        ranges[axis] = (out_box[axis][0] - shift, out_box[axis][1] - shift)
    for i, win in enumerate(wins):
        lo, hi = win.need(*out_box[first + i])
        start = in_box[first + i][0]
        ranges[first + i] = (lo - start, hi - start)
    return ranges


def _window_view(
    x: np.ndarray, wins: Sequence[Window], pointwise: bool | None = None
) -> np.ndarray:
    """The windows (N, C, *O, *K) of `x`, cropped and padded to what they read: a
    read-only strided view (`pointwise`: whether every window is 1x1, if known)."""
    first = x.ndim - len(wins)
    if pointwise is None:
        pointwise = all(w.span == 1 for w in wins)
    if pointwise:  # 1x1 windows: the input itself, strided
        strided = x[(*[slice(None)] * first, *(slice(None, None, w.stride) for w in wins))]
        view = strided.reshape((*strided.shape, *(1,) * len(wins)))
        view.flags.writeable = False  # read-only, as sliding_window_view's
        return view
    spatial = tuple(range(first, x.ndim))
    view = sliding_window_view(x, [w.span for w in wins], axis=spatial)
    index = (
        [slice(None)] * first
        + [slice(None, None, w.stride) for w in wins]
        + [slice(None, None, w.dilation) for w in wins]
    )
    return view[tuple(index)]


def gather_windows(
    x: np.ndarray,
    wins: Sequence[Window],
    out_box: Box,
    in_box: Box,
    fill: float,
    aligned: Sequence[int] = (0,),
) -> np.ndarray:
    """Windows of a channels-first tile: shape (N, C, *out tile, *kernel), a strided view.

    `out_box` and `in_box` locate the output tile and the given input in global coordinates;
    positions outside the input (padding, or past the end under ceil_mode) read `fill`.
    `aligned` axes index input and output alike (batch; channels too for pooling).
    """
    ranges = _window_ranges(x.shape, wins, out_box, in_box, aligned)
    return _window_view(crop_or_pad_all(x, ranges, fill), wins)


class _TileWindows:
    """The windows one conv tile reads of an input of one shape and dtype (zero padding),
    laid out once: the crop of the input and, when the windows read padding, a private
    padded array whose borders are written once (each use copies only the input's part
    into its interior). The view is kept for the input array last seen, so an input that
    is the same array (a VTCM buffer's view, a kept copy) costs no new view."""

    __slots__ = ("inside", "wins", "pointwise", "interior", "x", "src", "view")

    def __init__(
        self,
        shape: tuple[int, ...],
        dtype: np.dtype,
        wins: Sequence[Window],
        out_box: Box,
        in_box: Box,
    ) -> None:
        ranges = _window_ranges(shape, wins, out_box, in_box, (0,))
        wanted = [(0, n) if r is None else r for r, n in zip(ranges, shape, strict=True)]
        self.inside = tuple(
            slice(min(max(a, 0), n), min(max(b, 0), n))
            for (a, b), n in zip(wanted, shape, strict=True)
        )
        self.wins = wins
        self.pointwise = all(w.span == 1 for w in wins)
        self.interior: np.ndarray | None = None
        """The padded array's part the input fills (None: the windows read no padding)."""
        self.x: np.ndarray | None = None
        self.src: np.ndarray | None = None
        """The part of `x` copied into `interior` at each use."""
        self.view: np.ndarray | None = None
        if not all(0 <= a and b <= n for (a, b), n in zip(wanted, shape, strict=True)):
            padded = np.zeros([b - a for a, b in wanted], dtype=dtype)
            self.interior = padded[
                tuple(
                    slice(s.start - a, s.start - a + (s.stop - s.start))
                    for s, (a, _) in zip(self.inside, wanted, strict=True)
                )
            ]
            self.view = _window_view(padded, wins, self.pointwise)

    def of(self, x: np.ndarray) -> np.ndarray:
        """The windows of `x` as it holds now (valid until the next call)."""
        if x is not self.x:
            self.x = x
            part = x[self.inside]
            if self.interior is None:
                self.view = _window_view(part, self.wins, self.pointwise)
            else:
                self.src = part
        interior, src, view = self.interior, self.src, self.view
        if interior is not None and src is not None:
            np.copyto(interior, src)
        assert view is not None
        return view


def accumulator(dtype: np.dtype) -> type[np.floating]:
    """Statistics (norms, pools, resize): fp16 in fp32, fp32 in fp64, rounded once.

    Matrix products (Conv, MatMul, Gemm, Einsum) follow `product_accumulator` instead."""
    return np.float32 if dtype == np.float16 else np.float64


def product_accumulator(dtype: np.dtype) -> type[np.floating]:
    """Matrix products accumulate fp16 and fp32 data in fp32 (as HMX does), fp64 in fp64.

    The fp32 sums run through numpy's BLAS (sgemm), whose order of summation depends on the
    shape of a tile and on where an output sits in it. So two tilings (core counts) of one
    product may differ by the rounding of fp32 dot products (at most 2 K u sum|a b| for K
    terms, u = 2^-24; measured around 1e-7 of the output's scale), and so may two outputs
    that exact arithmetic makes equal. Where those are equal because their weight rows are
    all equal (constant-filled weights), `uniform_rows` computes one row and repeats it, so
    such outputs stay exactly equal (docs/compiler.md, "Numerics"). The reduction axis itself
    is never cut into tiles.
    """
    return np.float64 if dtype == np.float64 else np.float32


def uniform_rows(rows: np.ndarray) -> bool:
    """Whether a 2-D weight has more than one row and all rows are equal (==, so a NaN
    row is never equal; the outputs they make are then one output repeated). Costs one row
    compare when the first two rows differ, as in any trained or random weight."""
    if rows.ndim != 2 or len(rows) < 2 or rows.size == 0:
        return False
    if not rows[0, 0] == rows[1, 0]:  # the usual answer, for the price of one compare
        return False
    if not np.array_equal(rows[0], rows[1]):
        return False
    return bool((rows == rows[:1]).all())


WIDE_OPERANDS = "wide-operands"
"""OpDef tag: the kernel casts its float inputs to `product_accumulator(output dtype)`
before using them, so the runtime may hand it constants already widened (it keeps them
per session; see compiler_core.runtime.copies)."""


def whole_box(node: NodeInfo, index: int) -> Box:
    shape = node.in_shapes[index]
    assert shape is not None
    return full_box(shape)


def tile_box(tile: TileCtx, node: NodeInfo, index: int) -> Box:
    box = tile.in_boxes[index] if index < len(tile.in_boxes) else None
    return whole_box(node, index) if box is None else box


def channel_part(
    vec: np.ndarray, box: Box, wanted: tuple[int, int], acc: type, rank: int
) -> np.ndarray:
    """The channels `wanted` of a per-channel vector given as `box`, shaped to broadcast
    over (N, C, *spatial)."""
    part = vec[wanted[0] - box[0][0] : wanted[1] - box[0][0]]
    return part.astype(acc, copy=False).reshape((-1,) + (1,) * rank)


# ---------------------------------------------------------------------------------------------
# Conv


def _conv_windows(node: NodeInfo) -> list[Window]:
    return node.once("conv_windows", lambda: _compute_conv_windows(node))


def _compute_conv_windows(node: NodeInfo) -> list[Window]:
    x_shape, w_shape = node.in_shapes[0], node.in_shapes[1]
    assert x_shape is not None and w_shape is not None
    kernel = ints(node, "kernel_shape", w_shape[2:])
    return windows(node, kernel, x_shape[2:], node.out_shapes[0][2:])


def _conv_group_geometry(node: NodeInfo) -> tuple[int, int, int]:
    """(group, input channels per group, output channels per group)."""
    w_shape = node.in_shapes[1]
    assert w_shape is not None
    group = int(node.attr("group", 1))
    return group, int(w_shape[1]), int(w_shape[0]) // group


def conv_split_axes(node: NodeInfo) -> list[int]:
    """Batch, output channels (a cut inside a group reads only that group's input channels),
    then the spatial axes."""
    rank = len(node.out_shapes[0])
    return [0, 1, *range(2, rank)]


@dataclass(frozen=True)
class _BoxGeometry:
    """What `conv_input_boxes` reads of a node, worked out once: the split chooser asks for
    the boxes of thousands of tiles of the same node."""

    group: int
    in_per_group: int
    out_per_group: int
    channels: tuple[int, int]
    """The input channels a tile reads when the conv has one group (all of them)."""
    kernel: Box
    windows: tuple[tuple[int, int, int, int], ...]
    """Per spatial axis: stride, leading pad, span and input size (see `Window`)."""
    bias: bool


def _box_geometry(node: NodeInfo) -> _BoxGeometry:
    group, in_per_group, out_per_group = _conv_group_geometry(node)
    return _BoxGeometry(
        group,
        in_per_group,
        out_per_group,
        whole_box(node, 0)[1],
        full_box(node.in_shapes[1][1:]),  # type: ignore[index]
        tuple((w.stride, w.pad_begin, w.span, w.in_size) for w in _conv_windows(node)),
        node.has_input(2),
    )


def conv_input_boxes(node: NodeInfo, out_box: Box) -> list[Box | None]:
    geo = node.derived.get("conv_box_geometry")
    if geo is None:
        geo = node.derived["conv_box_geometry"] = _box_geometry(node)
    (n0, n1), (m0, m1) = out_box[0], out_box[1]
    x_box: list[tuple[int, int]] = [(n0, n1)]
    if geo.group == 1:
        x_box.append(geo.channels)
    else:
        g0, g1 = m0 // geo.out_per_group, (m1 - 1) // geo.out_per_group + 1
        x_box.append((g0 * geo.in_per_group, g1 * geo.in_per_group))
    for (stride, pad_begin, span, size), (o0, o1) in zip(geo.windows, out_box[2:], strict=True):
        # Window.clipped, inlined
        lo = o0 * stride - pad_begin
        hi = (o1 - 1) * stride - pad_begin + span
        x_box.append(clip_range(lo, hi, size))
    boxes: list[Box | None] = [tuple(x_box), ((m0, m1), *geo.kernel)]
    if geo.bias:
        boxes.append(((m0, m1),))
    return boxes


def conv_grid_boxes(
    node: NodeInfo, ranges: Sequence[Sequence[tuple[int, int]]]
) -> Iterator[list[Box | None]]:
    """`conv_input_boxes` of each tile of a grid cut, in `itertools.product` order: the input
    rows and columns worked out once per spatial range, the channels, weights and bias once
    per output-channel range (tiles of one range share those boxes)."""
    geo = node.derived.get("conv_box_geometry")
    if geo is None:
        geo = node.derived["conv_box_geometry"] = _box_geometry(node)
    per_channels: list[tuple[tuple[int, int], Box, Box | None]] = []
    for m0, m1 in ranges[1]:
        if geo.group == 1:
            channels = geo.channels
        else:
            g0, g1 = m0 // geo.out_per_group, (m1 - 1) // geo.out_per_group + 1
            channels = (g0 * geo.in_per_group, g1 * geo.in_per_group)
        bias: Box | None = ((m0, m1),) if geo.bias else None
        per_channels.append((channels, ((m0, m1), *geo.kernel), bias))
    spatial = [
        [
            clip_range(o0 * stride - pad_begin, (o1 - 1) * stride - pad_begin + span, size)
            for o0, o1 in axis
        ]
        for (stride, pad_begin, span, size), axis in zip(geo.windows, ranges[2:], strict=True)
    ]
    for batch in ranges[0]:
        for channels, weights, bias in per_channels:
            for rest in itertools.product(*spatial):
                x_box = (batch, channels, *rest)
                yield [x_box, weights] if bias is None else [x_box, weights, bias]


class _ConvTile:
    """What `conv_compute` works out of a node and a tile, once per tile: the runtime
    calls it with the same tile (and mostly the same input arrays) at every inference."""

    __slots__ = (
        "node", "tile", "out_dtype", "acc", "group", "in_per_group", "out_per_group", "wins",
        "x_box", "out_tile", "channels", "w_first", "b_box", "windows",
    )  # fmt: skip

    def __init__(self, node: NodeInfo, tile: TileCtx) -> None:
        self.node = node
        self.tile = tile
        self.out_dtype = np.dtype(node.out_dtypes[0])
        self.acc = product_accumulator(self.out_dtype)
        self.group, self.in_per_group, self.out_per_group = _conv_group_geometry(node)
        self.wins = _conv_windows(node)
        self.x_box = tile_box(tile, node, 0)
        self.out_tile = box_shape(tile.out_box)
        self.channels: tuple[int, int] = tile.out_box[1]
        self.w_first = tile_box(tile, node, 1)[0][0]
        self.b_box = tile_box(tile, node, 2) if len(node.in_shapes) > 2 else None
        self.windows: dict[tuple[int, tuple[int, ...], np.dtype], _TileWindows] = {}

    def windows_of(self, x: np.ndarray) -> np.ndarray:
        """The windows (N, C, *O, *K) of the tile's input `x` as it holds now (a view, valid
        until this tile's next product)."""
        key = (threading.get_ident(), x.shape, x.dtype)
        found = self.windows.get(key)
        if found is None:
            found = self.windows[key] = _TileWindows(
                x.shape, x.dtype, self.wins, self.tile.out_box, self.x_box
            )
        return found.of(x)


def _conv_tile(node: NodeInfo, tile: TileCtx) -> _ConvTile:
    """The tile's `_ConvTile`: kept in the tile when it is one the runtime keeps for the
    session (a `kept` dict: runtime/shared.py `RunTile`), else worked out for this call."""
    kept: dict[str, Any] | None = getattr(tile, "kept", None)
    if kept is None:
        return _ConvTile(node, tile)
    found: _ConvTile | None = kept.get("conv")
    if found is None or found.node is not node:
        found = kept["conv"] = _ConvTile(node, tile)
    return found


def conv_compute(
    node: NodeInfo, inputs: list[np.ndarray | None], tile: TileCtx
) -> list[np.ndarray]:
    x, w = inputs[0], inputs[1]
    bias = inputs[2] if len(inputs) > 2 else None
    assert x is not None and w is not None
    plan = _conv_tile(node, tile)
    acc = plan.acc
    wins = plan.wins
    rank = len(wins)
    if plan.group != 1:
        x = x.astype(acc, copy=False)
    xw = plan.windows_of(x)
    w = w.astype(acc, copy=False)
    m0, m1 = plan.channels
    w = w[m0 - plan.w_first :][: m1 - m0]
    if plan.group == 1:
        y = _dense_conv(xw, w, rank, acc)
    else:
        in_per_group, out_per_group = plan.in_per_group, plan.out_per_group
        g0 = m0 // out_per_group
        first_channel = g0 * in_per_group - plan.x_box[1][0]
        n_groups = (m1 - 1) // out_per_group + 1 - g0
        xg = xw[:, first_channel : first_channel + n_groups * in_per_group]
        xg = xg.reshape(xg.shape[0], n_groups, in_per_group, *xg.shape[2:])
        y = _grouped_conv(xg, w, m0 - g0 * out_per_group, out_per_group, rank)
    if bias is not None:
        assert plan.b_box is not None
        b = channel_part(bias, plan.b_box, (m0, m1), acc, rank)
        if y.flags.writeable:  # the product's own fresh array (not a repeated row)
            np.add(y, b, out=y)
        else:
            y = y + b
    assert y.shape == plan.out_tile, (y.shape, plan.out_tile)
    return [y.astype(plan.out_dtype, copy=False)]


_SCRATCH = threading.local()
_SCRATCH_LIMIT = 1 << 26
"""Bytes of im2col columns kept per thread between products (larger ones are allocated)."""


def _columns(shape: tuple[int, ...], dtype: type) -> np.ndarray:
    """An uninitialised array for a product's im2col columns, in this thread's scratch
    memory: the columns live only until the product is taken, and a fresh multi-megabyte
    array per product costs the kernel's page clearing every time."""
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    if nbytes > _SCRATCH_LIMIT:
        return np.empty(shape, dtype=dtype)
    buf: np.ndarray | None = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.nbytes < nbytes:
        buf = _SCRATCH.buf = np.empty(max(nbytes, 1 << 20), dtype=np.uint8)
    return buf[:nbytes].view(dtype).reshape(shape)


def _dense_conv(xw: np.ndarray, w: np.ndarray, rank: int, acc: type) -> np.ndarray:
    """Ungrouped conv of windows xw (N, C, *O, *K) with weights w (M, C, *K), as one matrix
    product per batch entry: (M, C*K) @ (C*K, O) lands in NC(O) layout, so the result needs
    no transpose. The columns are the windows reordered (C, *K, *O) and cast to `acc` in one
    copy (none for 1x1 kernels at stride 1 on an `acc` input)."""
    n, c = int(xw.shape[0]), int(xw.shape[1])
    out_sp = xw.shape[2 : 2 + rank]
    taps = math.prod(xw.shape[2 + rank :])
    perm = (0, 1, *range(2 + rank, 2 + 2 * rank), *range(2, 2 + rank))
    windows = xw.transpose(perm)
    if windows.dtype == acc and taps == 1:
        cols = windows.reshape(n, c, -1)
    else:
        cols = _columns(windows.shape, acc)
        np.copyto(cols, windows)
        cols = cols.reshape(n, c * taps, -1)
    rows = w.reshape(len(w), c * taps)
    if uniform_rows(rows):
        y = np.broadcast_to(np.matmul(rows[:1], cols), (n, len(w), cols.shape[-1]))
    else:
        y = np.matmul(rows, cols)
    return y.reshape(n, len(w), *out_sp)


def conv_columns_into(node: NodeInfo, x: np.ndarray, tile: TileCtx, out: np.ndarray) -> None:
    """Write an ungrouped conv tile's im2col columns for its one batch entry into `out`
    (C * taps, output positions of the tile): the matrix `_dense_conv` multiplies, so
    several tiles' columns side by side make one product (runtime/joins.py)."""
    plan = _conv_tile(node, tile)
    rank = len(plan.wins)
    xw = plan.windows_of(x)
    perm = (0, 1, *range(2 + rank, 2 + 2 * rank), *range(2, 2 + rank))
    windows = xw.transpose(perm)[0]  # (C, *K, *O)
    np.copyto(np.reshape(out, windows.shape, copy=False), windows)


def _grouped_conv(
    xg: np.ndarray, w: np.ndarray, first: int, per_group: int, rank: int
) -> np.ndarray:
    """Grouped conv of windows xg (N, G, Cg, *O, *K) with the weights of output channels
    [first, first + len(w)) counted from the first group present (w: Mt, Cg, *K)."""
    n, groups, cg = xg.shape[:3]
    out_sp = xg.shape[3 : 3 + rank]
    k_sp = xg.shape[3 + rank :]
    taps = cg * int(np.prod(k_sp, dtype=np.int64))
    if first == 0 and len(w) == groups * per_group:
        # Aligned to whole groups: one batched matmul per group.
        perm = (1, 0, *range(3, 3 + rank), 2, *range(3 + rank, 3 + 2 * rank))
        cols = xg.transpose(perm).reshape(groups, -1, taps)
        wg = w.reshape(groups, per_group, taps).transpose(0, 2, 1)
        y = np.matmul(cols, wg).reshape(groups, n, *out_sp, per_group)
        y = np.moveaxis(y, 0, -2).reshape(n, *out_sp, groups * per_group)
        return np.moveaxis(y, -1, 1)
    group_of = (np.arange(first, first + len(w)) // per_group).astype(np.intp)
    picked = xg[:, group_of]
    letters = "abcdefghijkl"[:rank], "opqrstuvwxyz"[:rank]
    spec = f"nmc{letters[0]}{letters[1]},mc{letters[1]}->nm{letters[0]}"
    return np.einsum(spec, picked, w, optimize=True)


def conv_hmx(node: NodeInfo, out_box: Box) -> HmxShape:
    """Per tap and group: output positions x input channels per group x output channels."""
    group, in_per_group, out_per_group = _conv_group_geometry(node)
    shape = box_shape(out_box)
    w_shape = node.in_shapes[1]
    assert w_shape is not None
    # math.prod, not np.prod: the split chooser asks for thousands of tiles' HMX shapes
    taps = int(math.prod(w_shape[2:]))
    positions = shape[0] * int(math.prod(shape[2:]))
    groups = max(1, -(-shape[1] // out_per_group)) if group > 1 else 1
    channels = min(shape[1], out_per_group) if group > 1 else shape[1]
    if in_per_group < 32 and group == 1:
        # few input channels (an RGB stem): the kernel lays the taps out along the
        # reduction (im2col), so the array's depth is not mostly padding
        return HmxShape(positions, in_per_group * taps, channels, groups)
    return HmxShape(positions, in_per_group, channels, taps * groups)


def conv_macs(node: NodeInfo) -> int:
    w_shape = node.in_shapes[1]
    assert w_shape is not None
    per_output = int(math.prod(int(d) for d in w_shape[1:]))
    return int(math.prod(int(d) for d in node.out_shapes[0])) * per_output


register(
    "Conv",
    conv_compute,
    since=1,
    dtypes=FLOATS,
    kernel="conv",
    unit="hmx",
    tags=frozenset({WIDE_OPERANDS}),
    split_axes=conv_split_axes,
    input_boxes=conv_input_boxes,
    grid_input_boxes=conv_grid_boxes,
    macs=conv_macs,
    hmx_shape=conv_hmx,
    doc="N-d convolution (1-3 spatial dims): pads, auto_pad, strides, dilations, group.",
)


# ---------------------------------------------------------------------------------------------
# ConvTranspose


def _transpose_pads(node: NodeInfo) -> list[tuple[int, int]]:
    """(pad_begin, output_padding) per spatial axis. With auto_pad SAME_* or an explicit
    output_shape the total padding is derived, the odd element going to the end for
    SAME_UPPER and to the start otherwise (as the ONNX spec and ONNX Runtime agree)."""
    x_shape, w_shape = node.in_shapes[0], node.in_shapes[1]
    assert x_shape is not None and w_shape is not None
    kernel = ints(node, "kernel_shape", w_shape[2:])
    rank = len(kernel)
    strides = ints(node, "strides", [1] * rank)
    dilations = ints(node, "dilations", [1] * rank)
    out_pad = ints(node, "output_padding", [0] * rank)
    pads = node.attr("pads")
    auto_pad = str(node.attr("auto_pad", "NOTSET"))
    result = []
    for i in range(rank):
        full = (x_shape[2 + i] - 1) * strides[i] + out_pad[i] + (kernel[i] - 1) * dilations[i] + 1
        if node.attr("output_shape") is not None or auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            total = max(0, full - node.out_shapes[0][2 + i])
            begin = total // 2 if auto_pad == "SAME_UPPER" else total - total // 2
        elif pads is not None and auto_pad != "VALID":
            begin = int(pads[i])
        else:
            begin = 0
        result.append((begin, out_pad[i]))
    return result


def _transpose_geometry(node: NodeInfo) -> tuple[list[int], list[int], list[int], list[int]]:
    w_shape = node.in_shapes[1]
    assert w_shape is not None
    kernel = ints(node, "kernel_shape", w_shape[2:])
    rank = len(kernel)
    strides = ints(node, "strides", [1] * rank)
    dilations = ints(node, "dilations", [1] * rank)
    begins = [b for b, _ in _transpose_pads(node)]
    return kernel, strides, dilations, begins


def conv_transpose_split_axes(node: NodeInfo) -> list[int]:
    channels = [1] if int(node.attr("group", 1)) == 1 else []
    return [0, *channels, *range(2, len(node.out_shapes[0]))]


def conv_transpose_input_boxes(node: NodeInfo, out_box: Box) -> list[Box | None]:
    x_shape, w_shape = node.in_shapes[0], node.in_shapes[1]
    assert x_shape is not None and w_shape is not None
    kernel, strides, dilations, begins = _transpose_geometry(node)
    spatial = []
    for i, (o0, o1) in enumerate(out_box[2:]):
        # Output o receives input i through tap j when o = i * stride - pad + j * dilation.
        span = (kernel[i] - 1) * dilations[i]
        lo = -((-(o0 + begins[i] - span)) // strides[i])
        hi = (o1 - 1 + begins[i]) // strides[i] + 1
        spatial.append(clip_range(lo, hi, x_shape[2 + i]))
    group = int(node.attr("group", 1))
    channels = out_box[1] if group == 1 else (0, int(w_shape[1]))
    boxes: list[Box | None] = [
        (out_box[0], (0, x_shape[1]), *spatial),
        ((0, w_shape[0]), channels, *full_box(w_shape[2:])),
    ]
    if node.has_input(2):
        boxes.append((out_box[1],))
    return boxes


def conv_transpose_compute(
    node: NodeInfo, inputs: list[np.ndarray | None], tile: TileCtx
) -> list[np.ndarray]:
    x, w = inputs[0], inputs[1]
    bias = inputs[2] if len(inputs) > 2 else None
    assert x is not None and w is not None
    out_dtype = np.dtype(node.out_dtypes[0])
    acc = product_accumulator(out_dtype)
    x, w = x.astype(acc, copy=False), w.astype(acc, copy=False)
    kernel, strides, dilations, begins = _transpose_geometry(node)
    rank = len(kernel)
    group = int(node.attr("group", 1))
    x_box = tile_box(tile, node, 0)
    (n0, n1), shift = tile.out_box[0], x_box[0][0]
    x = x[n0 - shift : n1 - shift]
    n, c = x.shape[:2]
    out_channels = w.shape[1] * group
    # Scatter every tap of the given input into a buffer starting at global output `base`.
    base = [x_box[2 + i][0] * strides[i] - begins[i] for i in range(rank)]
    size = [
        (x.shape[2 + i] - 1) * strides[i] + (kernel[i] - 1) * dilations[i] + 1 for i in range(rank)
    ]
    buf = np.zeros((n, out_channels, *size), dtype=acc)
    cg, mg = c // group, w.shape[1]
    for tap in np.ndindex(*kernel):
        place = tuple(
            slice(
                tap[i] * dilations[i],
                tap[i] * dilations[i] + (x.shape[2 + i] - 1) * strides[i] + 1,
                strides[i],
            )
            for i in range(rank)
        )
        for g in range(group):
            w_tap = w[(slice(g * cg, (g + 1) * cg), slice(None), *tap)]
            contrib = np.tensordot(x[:, g * cg : (g + 1) * cg], w_tap, axes=([1], [0]))
            buf[(slice(None), slice(g * mg, (g + 1) * mg), *place)] += np.moveaxis(contrib, -1, 1)
    # With group == 1 the weights (hence buf) hold only the channels of their box.
    first = tile_box(tile, node, 1)[1][0] if group == 1 else 0
    y = buf[:, tile.out_box[1][0] - first : tile.out_box[1][1] - first]
    for i in range(rank):
        o0, o1 = tile.out_box[2 + i]
        y = crop_or_pad(y, 2 + i, o0 - base[i], o1 - base[i], 0.0)
    if bias is not None:
        y = y + channel_part(bias, tile_box(tile, node, 2), tile.out_box[1], acc, rank)
    return [np.ascontiguousarray(y, dtype=out_dtype)]


def conv_transpose_macs(node: NodeInfo) -> int:
    x_shape, w_shape = node.in_shapes[0], node.in_shapes[1]
    assert x_shape is not None and w_shape is not None
    return int(np.prod(x_shape, dtype=np.int64)) * int(np.prod(w_shape[1:], dtype=np.int64))


register(
    "ConvTranspose",
    conv_transpose_compute,
    since=1,
    dtypes=FLOATS,
    kernel="conv_transpose",
    unit="hmx",
    tags=frozenset({WIDE_OPERANDS}),
    split_axes=conv_transpose_split_axes,
    input_boxes=conv_transpose_input_boxes,
    macs=conv_transpose_macs,
    doc="N-d transposed convolution: pads, auto_pad, output_padding, output_shape, group.",
)
