"""Sampling ops: GridSample, AffineGrid, RoiAlign and DeformConv.

All read their data at computed, fractional positions, so an output tile may need any part of
the input: they run whole. GridSample and DeformConv work for any number of spatial axes as a
sum over interpolation taps (1, 2 or 4 per axis): each tap combination is one gather from the
flattened image times a weight, vectorised over every output point and channel. Coordinates
are computed in the grid's precision (float32 for float16/float32), as the ONNX reference and
ONNX Runtime denormalise and round them; sums run in float32 (float64 for float64 data).
GridSample's cubic mode pads each tap, not the sampling position, like PyTorch and ONNX Runtime
(the ONNX reference clamps or reflects the position first, which differs near borders).
RoiAlign clamps samples within a pixel of the edge and zeroes those further out; DeformConv
reads zero outside the image. AffineGrid needs a constant size (it fixes the output shape).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from compiler_core.errors import CompileError
from compiler_core.ops.registry import FLOATS, NodeInfo, TileCtx, register

Array = np.ndarray

_MODES = {"nearest": "nearest", "linear": "linear", "bilinear": "linear"}
_MODES.update({"cubic": "cubic", "bicubic": "cubic"})
_PADDINGS = ("zeros", "border", "reflection")
_CUBIC_A = -0.75
"""Keys' cubic convolution coefficient, as in PyTorch's and ONNX's bicubic GridSample."""


def _str_attr(node: NodeInfo, name: str, default: str) -> str:
    value = node.attr(name, default)
    return value.decode() if isinstance(value, bytes) else str(value)


def _work_dtype(*arrays: Array) -> type[np.floating]:
    return np.float64 if any(a.dtype == np.float64 for a in arrays) else np.float32


# --- GridSample -----------------------------------------------------------------------------


def _reflect(v: Array, lo: float, hi: float) -> Array:
    """Fold coordinates outside [lo, hi] back in, mirroring at each border in turn."""
    span = hi - lo
    if span <= 0:
        return np.full_like(v, lo)
    below, above = v < lo, v > hi
    dist = np.where(below, lo - v, np.where(above, v - hi, 0))
    folds = np.floor(dist / span)
    rest = dist - folds * span
    even = folds % 2 == 0
    from_low = np.where(even, lo + rest, hi - rest)
    from_high = np.where(even, hi - rest, lo + rest)
    return np.where(below, from_low, np.where(above, from_high, v))


def _cubic_weights(t: Array) -> list[Array]:
    """Weights of the taps at offsets -1, 0, 1, 2 for a fractional position t in [0, 1)."""
    a = _CUBIC_A

    def near(x: Array) -> Array:  # |x| <= 1
        return ((a + 2) * x - (a + 3)) * x * x + 1

    def far(x: Array) -> Array:  # 1 < |x| < 2
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a

    return [far(t + 1), near(t), near(1 - t), far(2 - t)]


def _taps(x: Array, mode: str) -> list[tuple[Array, Array]]:
    """(integer position, weight) of each interpolation tap along one axis."""
    if mode == "nearest":
        return [(x.astype(np.int64), np.ones_like(x))]
    base = np.floor(x)
    t = x - base
    start = base.astype(np.int64)
    if mode == "linear":
        return [(start, 1 - t), (start + 1, t)]
    return [(start + k - 1, w) for k, w in enumerate(_cubic_weights(t))]


def _pad_index(
    index: Array, size: int, padding: str, lo: float, hi: float
) -> tuple[Array, Array | None]:
    """Map tap positions into [0, size): the index to read and, for zero padding, a mask."""
    if padding == "zeros":
        valid = (index >= 0) & (index < size)
        return np.where(valid, index, 0), valid
    if padding == "border":
        return np.clip(index, 0, size - 1), None
    folded = _reflect(index.astype(np.float64), lo, hi).astype(np.int64)
    return np.clip(folded, 0, size - 1), None


def _grid_sample_check(node: NodeInfo) -> tuple[str, str, bool]:
    """Mode, padding and align_corners, or a CompileError naming what does not fit."""
    mode = _MODES.get(_str_attr(node, "mode", "linear"))
    padding = _str_attr(node, "padding_mode", "zeros")
    x_shape, grid_shape = node.in_shapes[0], node.in_shapes[1]
    assert x_shape is not None and grid_shape is not None
    problem = ""
    if mode is None:
        problem = f"mode {_str_attr(node, 'mode', '')!r} is not nearest, linear or cubic"
    elif padding not in _PADDINGS:
        problem = f"padding_mode {padding!r} is not zeros, border or reflection"
    elif len(x_shape) < 3 or len(grid_shape) != len(x_shape) or grid_shape[-1] != len(x_shape) - 2:
        problem = f"grid shape {grid_shape} does not fit input shape {x_shape}"
    elif grid_shape[0] != x_shape[0]:
        problem = f"grid batch {grid_shape[0]} differs from input batch {x_shape[0]}"
    if problem:
        raise CompileError("invalid_model", f"GridSample: {problem}", node=node.name)
    assert mode is not None
    return mode, padding, bool(int(node.attr("align_corners", 0)))


def _grid_sample_split(node: NodeInfo) -> list[int]:
    """Runs whole; checked here so that a bad node fails at compile time."""
    _grid_sample_check(node)
    return []


Tap = tuple[Array, Array | None, Array]
"""Index to read along one axis, its validity mask (zero padding only) and its weight."""


def _axis_taps(
    g: Array, size: int, mode: str, padding: str, align: bool, acc: type[np.floating]
) -> list[Tap]:
    """The taps along one axis for normalised coordinates g (in the grid's precision)."""
    coord = g.dtype.type
    if align:
        pos, lo, hi = (g + coord(1)) / coord(2) * coord(size - 1), 0.0, size - 1.0
    else:
        pos, lo, hi = ((g + coord(1)) * coord(size) - coord(1)) / coord(2), -0.5, size - 0.5
    if mode == "nearest":
        pos = np.rint(pos)
    # Linear and nearest fold an outside position back in before choosing taps; cubic
    # keeps it and pads each tap (as PyTorch and ONNX Runtime do).
    if padding == "border" and mode != "cubic":
        pos = np.where((pos < lo) | (pos > hi), np.clip(pos, 0, size - 1), pos)
    elif padding == "reflection" and mode != "cubic":
        pos = _reflect(pos, lo, hi)
    taps: list[Tap] = []
    for index, weight in _taps(pos.astype(g.dtype), mode):
        read, valid = _pad_index(index, size, padding, lo, hi)
        taps.append((read, valid, weight.astype(acc)))
    return taps


def grid_sample_compute(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    x, grid = inputs[0], inputs[1]
    assert x is not None and grid is not None
    mode, padding, align = _grid_sample_check(node)
    n, c, dims = x.shape[0], x.shape[1], x.shape[2:]
    coord_dtype = np.float64 if grid.dtype == np.float64 else np.float32
    acc = _work_dtype(x, grid)
    # The grid lists coordinates innermost axis first (x, y[, z]): reverse to axis order.
    points = grid.reshape(n, -1, len(dims)).astype(coord_dtype)[..., ::-1]
    axis_taps = [
        _axis_taps(points[..., axis], size, mode, padding, align, acc)
        for axis, size in enumerate(dims)
    ]
    strides = [int(np.prod(dims[k + 1 :], dtype=np.int64)) for k in range(len(dims))]
    flat = x.reshape(n, c, -1).astype(acc)
    out = np.zeros((n, c, points.shape[1]), dtype=acc)
    for combo in itertools.product(*axis_taps):
        offset = np.zeros(points.shape[:2], dtype=np.int64)
        weight = np.ones(points.shape[:2], dtype=acc)
        for (read, valid, w), stride in zip(combo, strides, strict=True):
            offset += read * stride
            weight = weight * w if valid is None else weight * w * valid
        values = np.take_along_axis(flat, offset[:, None, :], axis=2)
        out += values * weight[:, None, :]
    return [out.reshape(node.out_shapes[0]).astype(np.dtype(node.out_dtypes[0]))]


def _grid_sample_macs(node: NodeInfo) -> int:
    rank = len(node.out_shapes[0]) - 2
    mode = _MODES.get(_str_attr(node, "mode", "linear"), "linear")
    per_axis = {"nearest": 1, "linear": 2, "cubic": 4}[mode]
    return int(np.prod(node.out_shapes[0], dtype=np.int64)) * per_axis**rank


register(
    "GridSample",
    grid_sample_compute,
    since=16,
    dtypes=FLOATS,
    kernel="grid_sample",
    split_axes=_grid_sample_split,
    macs=_grid_sample_macs,
    doc="Nearest, (bi)linear or (bi)cubic sampling at normalised grid positions; zeros, "
    "border or reflection padding; 2-D (16) or N-D (20).",
)


# --- AffineGrid -----------------------------------------------------------------------------


def _base_axis(size: int, align: bool, dtype: type[np.floating]) -> Array:
    """Normalised positions of the pixel centres (or corners) along one axis, in [-1, 1]."""
    k = np.arange(size, dtype=dtype)
    if align:
        step = dtype(2.0 / (size - 1)) if size > 1 else dtype(0.0)
        return dtype(-1.0) + k * step
    step = dtype(2.0 / size)
    return dtype(-1.0) + step / 2 + k * step


def affine_grid_compute(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    theta = inputs[0]
    assert theta is not None
    out_shape = node.out_shapes[0]
    spatial = tuple(int(d) for d in out_shape[1:-1])
    rank = len(spatial)
    if rank not in (2, 3) or theta.shape[1:] != (rank, rank + 1):
        raise CompileError(
            "invalid_model",
            f"AffineGrid: theta shape {theta.shape} does not fit a {rank}-D size",
            node=node.name,
        )
    acc = _work_dtype(theta)
    align = bool(int(node.attr("align_corners", 0)))
    axes = [_base_axis(size, align, acc) for size in spatial]
    mesh = np.meshgrid(*axes, indexing="ij")
    # Homogeneous points (x, y[, z], 1): x runs along the last (width) axis.
    base = np.stack([*mesh[::-1], np.ones(spatial, dtype=acc)], axis=-1).reshape(-1, rank + 1)
    grid = np.einsum("pk,njk->npj", base, theta.astype(acc))
    return [grid.reshape(out_shape).astype(np.dtype(node.out_dtypes[0]))]


register(
    "AffineGrid",
    affine_grid_compute,
    since=20,
    dtypes=FLOATS,
    kernel="affine_grid",
    macs=lambda node: int(np.prod(node.out_shapes[0], dtype=np.int64)) * 4,
    doc="2-D or 3-D sampling grid from affine matrices; the size input must be constant.",
)


# --- RoiAlign -------------------------------------------------------------------------------


def _roi_axis(
    start: float, length: float, bins: int, samples: int, size: int
) -> tuple[Array, Array, Array, Array]:
    """Sample positions along one axis of one RoI, as (low, high, weight of high, valid),
    each shaped (bins, samples). Positions within one pixel outside the image clamp to the
    edge; further out they are invalid (contribute zero)."""
    bin_size = length / bins
    k = np.arange(bins, dtype=np.float64)[:, None]
    s = np.arange(samples, dtype=np.float64)[None, :]
    pos = start + k * bin_size + (s + 0.5) * bin_size / samples
    valid = (pos >= -1.0) & (pos <= size)
    pos = np.maximum(pos, 0.0)
    low = np.floor(pos).astype(np.int64)
    at_edge = low >= size - 1
    low = np.where(at_edge, size - 1, low)
    high = np.where(at_edge, size - 1, low + 1)
    frac = np.where(at_edge, 0.0, pos - low)
    return low, high, frac, valid


def _roi_attrs(node: NodeInfo) -> tuple[str, bool, int, int, int, float]:
    mode = _str_attr(node, "mode", "avg")
    default_ctm = "half_pixel" if node.opset >= 16 else "output_half_pixel"
    ctm = _str_attr(node, "coordinate_transformation_mode", default_ctm)
    heights, widths = int(node.attr("output_height", 1)), int(node.attr("output_width", 1))
    ratio = int(node.attr("sampling_ratio", 0))
    problem = ""
    if mode not in ("avg", "max"):
        problem = f"mode {mode!r} is not avg or max"
    elif ctm not in ("half_pixel", "output_half_pixel"):
        problem = f"coordinate_transformation_mode {ctm!r} is not half_pixel or output_half_pixel"
    elif heights < 1 or widths < 1 or ratio < 0:
        problem = "output_height and output_width must be positive, sampling_ratio >= 0"
    if problem:
        raise CompileError("invalid_model", f"RoiAlign: {problem}", node=node.name)
    scale = float(node.attr("spatial_scale", 1.0))
    return mode, ctm == "half_pixel", heights, widths, ratio, scale


def _roi_align_split(node: NodeInfo) -> list[int]:
    """Runs whole; checked here so that bad attributes fail at compile time."""
    _roi_attrs(node)
    return []


def _roi_align_one(image: Array, roi: Array, node: NodeInfo, acc: type[np.floating]) -> Array:
    """(C, output_height, output_width) pooled from one RoI of one (C, H, W) image."""
    mode, half_pixel, heights, widths, ratio, scale = _roi_attrs(node)
    shift = 0.5 if half_pixel else 0.0
    x0, y0, x1, y1 = (float(v) * scale - shift for v in roi)
    roi_w, roi_h = x1 - x0, y1 - y0
    if not half_pixel:
        roi_w, roi_h = max(roi_w, 1.0), max(roi_h, 1.0)
    grid_h = ratio if ratio > 0 else int(np.ceil(roi_h / heights))
    grid_w = ratio if ratio > 0 else int(np.ceil(roi_w / widths))
    c, h, w = image.shape
    if grid_h <= 0 or grid_w <= 0:
        return np.zeros((c, heights, widths), dtype=acc)
    ylo, yhi, ly, yok = _roi_axis(y0, roi_h, heights, grid_h, h)
    xlo, xhi, lx, xok = _roi_axis(x0, roi_w, widths, grid_w, w)
    valid = yok[:, :, None, None] & xok[None, None, :, :]
    terms = []
    for yi, wy in ((ylo, 1 - ly), (yhi, ly)):
        for xi, wx in ((xlo, 1 - lx), (xhi, lx)):
            weight = np.where(valid, wy[:, :, None, None] * wx[None, None, :, :], 0.0)
            values = image[:, yi[:, :, None, None], xi[None, None, :, :]]
            terms.append(values * weight.astype(acc))
    # Axes: (C, bin y, sample y, bin x, sample x).
    if mode == "avg":
        pooled = sum(terms[1:], terms[0]).sum(axis=(2, 4)) / max(grid_h * grid_w, 1)
    else:
        pooled = np.max(np.stack(terms), axis=0).max(axis=(2, 4))
    return pooled.astype(acc)


def roi_align_compute(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    x, rois, batch = inputs[0], inputs[1], inputs[2]
    assert x is not None and rois is not None and batch is not None
    acc = _work_dtype(x)
    images = x.astype(acc)
    index = batch.reshape(-1).astype(np.int64)
    if index.size and (index.min() < 0 or index.max() >= x.shape[0]):
        raise CompileError(
            "invalid_model",
            f"RoiAlign: a batch index is outside 0..{x.shape[0] - 1}",
            node=node.name,
        )
    out = np.empty(node.out_shapes[0], dtype=acc)
    for r in range(out.shape[0]):
        out[r] = _roi_align_one(images[index[r]], rois[r], node, acc)
    return [out.astype(np.dtype(node.out_dtypes[0]))]


register(
    "RoiAlign",
    roi_align_compute,
    since=10,
    dtypes=FLOATS,
    kernel="roi_align",
    split_axes=_roi_align_split,
    macs=lambda node: 4 * int(np.prod(node.out_shapes[0], dtype=np.int64)),
    doc="Average or max RoI pooling of bilinear samples; half_pixel or output_half_pixel "
    "coordinates, fixed or adaptive sampling_ratio.",
)


# --- DeformConv -----------------------------------------------------------------------------


def _deform_attrs(node: NodeInfo) -> tuple[list[int], list[int], list[int], list[int], int, int]:
    """Kernel shape, strides, dilations, begin pads, group and offset_group, checked against
    the input, weight and offset shapes."""
    x_shape, w_shape, off_shape = node.in_shapes[0], node.in_shapes[1], node.in_shapes[2]
    assert x_shape is not None and w_shape is not None and off_shape is not None
    rank = len(x_shape) - 2
    kernel = [int(k) for k in node.attr("kernel_shape", w_shape[2:])]
    strides = [int(s) for s in node.attr("strides", [1] * rank)]
    dilations = [int(d) for d in node.attr("dilations", [1] * rank)]
    pads = [int(p) for p in node.attr("pads", [0] * 2 * rank)]
    group, offset_group = int(node.attr("group", 1)), int(node.attr("offset_group", 1))
    taps = int(np.prod(kernel, dtype=np.int64))
    channels = int(x_shape[1])
    problem = ""
    if rank < 1 or len(w_shape) != rank + 2 or list(w_shape[2:]) != kernel:
        problem = f"weight shape {w_shape} does not fit kernel_shape {kernel}"
    elif len(strides) != rank or len(dilations) != rank or len(pads) != 2 * rank:
        problem = f"strides, dilations or pads do not have {rank} axes"
    elif min(strides + dilations) < 1:
        problem = "strides and dilations must be positive"
    elif group < 1 or channels != w_shape[1] * group or w_shape[0] % group:
        problem = f"group {group} does not split {channels} input, {w_shape[0]} output channels"
    elif offset_group < 1 or channels % offset_group:
        problem = f"offset_group {offset_group} does not divide {channels} channels"
    elif off_shape[1] != offset_group * taps * rank:
        problem = f"offset shape {off_shape} does not fit offset_group {offset_group}, kernel"
    elif tuple(off_shape[2:]) != tuple(node.out_shapes[0][2:]) or list(off_shape[2:]) != [
        (x_shape[2 + i] + pads[i] + pads[rank + i] - dilations[i] * (kernel[i] - 1) - 1)
        // strides[i]
        + 1
        for i in range(rank)
    ]:
        problem = f"offset and output spatial shapes {off_shape[2:]} do not fit the convolution"
    if problem:
        raise CompileError("invalid_model", f"DeformConv: {problem}", node=node.name)
    return kernel, strides, dilations, pads[:rank], group, offset_group


def _deform_split(node: NodeInfo) -> list[int]:
    """Runs whole; checked here so that bad attributes fail at compile time."""
    _deform_attrs(node)
    return []


def _deform_columns(x: Array, offset: Array, mask: Array | None, node: NodeInfo) -> Array:
    """The sampled input under every kernel tap: (N, C, taps, output positions).

    Tap k of output position p reads x at p * stride - pad + k * dilation + offset by
    multilinear interpolation; corners outside the image read zero."""
    kernel, strides, dilations, begins, _, groups = _deform_attrs(node)
    n, c, dims = x.shape[0], x.shape[1], x.shape[2:]
    out_dims = node.out_shapes[0][2:]
    rank, taps = len(dims), int(np.prod(kernel, dtype=np.int64))
    shifts = offset.reshape(n, groups, taps, rank, -1)
    corners: list[list[Tap]] = []
    for axis in range(rank):
        out_pos = np.arange(out_dims[axis]) * strides[axis] - begins[axis]
        tap_pos = np.arange(kernel[axis]) * dilations[axis]
        base = (
            _broadcast_axis(out_pos, out_dims, axis)[None, :]
            + _broadcast_axis(tap_pos, kernel, axis)[:, None]
        )
        pos = base[None, None] + shifts[:, :, :, axis]
        low = np.floor(pos)
        frac = pos - low
        corners.append(
            [
                _pad_index(low.astype(np.int64) + step, dims[axis], "zeros", 0.0, 0.0)
                + ((frac if step else 1 - frac),)
                for step in (0, 1)
            ]
        )
    strides_flat = [int(np.prod(dims[k + 1 :], dtype=np.int64)) for k in range(rank)]
    flat = x.reshape(n, groups, c // groups, -1)
    positions = shifts.shape[-1]
    cols = np.zeros((n, groups, c // groups, taps * positions), dtype=x.dtype)
    for combo in itertools.product(*corners):
        index = np.zeros((n, groups, taps, positions), dtype=np.int64)
        weight = np.ones((n, groups, taps, positions), dtype=x.dtype)
        for (read, valid, w), stride in zip(combo, strides_flat, strict=True):
            index += read * stride
            weight = weight * w * valid
        values = np.take_along_axis(flat, index.reshape(n, groups, 1, -1), axis=3)
        cols += values * weight.reshape(n, groups, 1, -1).astype(x.dtype)
    cols = cols.reshape(n, groups, c // groups, taps, positions)
    if mask is not None:
        cols = cols * mask.reshape(n, groups, 1, taps, positions).astype(x.dtype)
    return cols.reshape(n, c, taps, positions)


def _broadcast_axis(values: Array, dims: Sequence[int], axis: int) -> Array:
    """values laid along `axis` of a grid of shape dims, flattened: shape (prod(dims),)."""
    shape = [1] * len(dims)
    shape[axis] = len(values)
    return np.broadcast_to(values.reshape(shape), tuple(dims)).reshape(-1)


def deform_conv_compute(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    x, w, offset = inputs[0], inputs[1], inputs[2]
    bias = inputs[3] if len(inputs) > 3 else None
    mask = inputs[4] if len(inputs) > 4 else None
    assert x is not None and w is not None and offset is not None
    _, _, _, _, group, _ = _deform_attrs(node)
    acc = _work_dtype(x)
    cols = _deform_columns(x.astype(acc), offset.astype(acc), mask, node)
    n, c, taps, positions = cols.shape
    out_channels = w.shape[0]
    grouped = cols.reshape(n, group, (c // group) * taps, positions)
    weights = w.astype(acc).reshape(group, out_channels // group, -1)
    y = np.einsum("gok,ngkp->ngop", weights, grouped).reshape(n, out_channels, positions)
    if bias is not None:
        y = y + bias.astype(acc).reshape(1, -1, 1)
    return [y.reshape(node.out_shapes[0]).astype(np.dtype(node.out_dtypes[0]))]


register(
    "DeformConv",
    deform_conv_compute,
    since=19,
    dtypes=FLOATS,
    kernel="deform_conv",
    split_axes=_deform_split,
    macs=lambda node: (
        int(np.prod(node.out_shapes[0], dtype=np.int64))
        * int(np.prod((node.in_shapes[1] or (1,))[1:], dtype=np.int64))
    ),
    doc="N-D deformable convolution with offsets, optional mask and bias, groups and "
    "offset groups; bilinear sampling, zero outside the input.",
)
