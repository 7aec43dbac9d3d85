"""Pad, Resize and Upsample: ops that map output positions to input positions per axis.

Both tile along any axis whose mapping is known at compile time (pads, scales or sizes given as
constants): a tile's input box is the range of source positions its outputs read. Resize is
separable, so each axis becomes a small table of source indices and weights (1 tap for
nearest, 2 for linear, 4 for cubic), computed in float32 as ONNX Runtime does.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np

from compiler_core.errors import CompileError
from compiler_core.ops.conv import accumulator, clip_range, crop_or_pad, tile_box
from compiler_core.ops.registry import (
    ALL,
    FLOATS,
    Box,
    NodeInfo,
    Shape,
    TileCtx,
    full_box,
    register,
)

F32 = np.float32


def _x_shape(node: NodeInfo) -> Shape:
    shape = node.in_shapes[0]
    assert shape is not None
    return shape


def _given(node: NodeInfo, inputs: list[np.ndarray | None]) -> dict[int, np.ndarray]:
    return {i: v for i, v in enumerate(inputs) if i > 0 and v is not None}


def _other_boxes(node: NodeInfo) -> list[Box | None]:
    return [None if s is None else full_box(s) for s in node.in_shapes[1:]]


# ---------------------------------------------------------------------------------------------
# Pad


def _pad_amounts(node: NodeInfo, values: Mapping[int, np.ndarray]) -> list[tuple[int, int]] | None:
    """(begin, end) per axis (negative crops), or None when the pads are not known."""
    rank = len(_x_shape(node))
    if node.opset < 11:
        pads = node.attr("pads", node.attr("paddings"))
        flat = [int(p) for p in pads]
        return [(flat[i], flat[i + rank]) for i in range(rank)]
    if 1 not in values:
        return None
    flat = [int(p) for p in np.asarray(values[1]).reshape(-1)]
    axes = list(range(rank))
    if node.has_input(3):
        if 3 not in values:
            return None
        axes = [int(a) % rank for a in np.asarray(values[3]).reshape(-1)]
    amounts = [(0, 0)] * rank
    for i, axis in enumerate(axes):
        amounts[axis] = (flat[i], flat[i + len(axes)])
    return amounts


_NUMPY_PAD_MODES: dict[str, Literal["reflect", "edge", "wrap"]] = {
    "reflect": "reflect",
    "edge": "edge",
    "wrap": "wrap",
}


def _pad_mode(node: NodeInfo) -> str:
    return str(node.attr("mode", "constant"))


def pad_split_axes(node: NodeInfo) -> list[int]:
    amounts = _pad_amounts(node, node.consts)
    if amounts is None:
        return []
    if _pad_mode(node) == "constant":
        return list(range(len(amounts)))
    return [a for a, pads in enumerate(amounts) if pads == (0, 0)]


def pad_input_boxes(node: NodeInfo, out_box: Box) -> list[Box | None]:
    shape = _x_shape(node)
    amounts = _pad_amounts(node, node.consts)
    if amounts is None:
        return [full_box(shape), *_other_boxes(node)]
    constant = _pad_mode(node) == "constant"
    box = []
    for axis, ((o0, o1), (begin, end)) in enumerate(zip(out_box, amounts, strict=True)):
        if constant or (begin, end) == (0, 0):
            box.append(clip_range(o0 - begin, o1 - begin, shape[axis]))
        else:
            box.append((0, shape[axis]))
    return [tuple(box), *_other_boxes(node)]


def _pad_value(node: NodeInfo, inputs: list[np.ndarray | None]) -> float:
    if node.opset < 11:
        return float(node.attr("value", 0.0))
    value = inputs[2] if len(inputs) > 2 else None
    if value is None or value.size == 0:
        return 0.0
    return value.reshape(-1)[0].item()


def pad_compute(node: NodeInfo, inputs: list[np.ndarray | None], tile: TileCtx) -> list[np.ndarray]:
    x = inputs[0]
    assert x is not None
    amounts = _pad_amounts(node, _given(node, inputs))
    assert amounts is not None
    mode = _pad_mode(node)
    if mode not in ("constant", "reflect", "edge", "wrap"):
        raise CompileError("unsupported_attribute", f"Pad mode {mode!r}", node=node.name)
    in_box = tile_box(tile, node, 0)
    if mode == "constant":
        fill = _pad_value(node, inputs)
        for axis, ((o0, o1), (begin, _)) in enumerate(zip(tile.out_box, amounts, strict=True)):
            start = in_box[axis][0]
            x = crop_or_pad(x, axis, o0 - begin - start, o1 - begin - start, fill)
        return [x]
    # Edge modes: padded axes come whole (they are never split), the others as their tile.
    for axis, ((o0, o1), (begin, end)) in enumerate(zip(tile.out_box, amounts, strict=True)):
        start = in_box[axis][0]
        if (begin, end) == (0, 0):
            x = crop_or_pad(x, axis, o0 - start, o1 - start, 0)
            continue
        n = x.shape[axis]
        index = [slice(None)] * x.ndim
        index[axis] = slice(max(0, -begin), n - max(0, -end))
        x = x[tuple(index)]
        widths = [(0, 0)] * x.ndim
        widths[axis] = (max(0, begin), max(0, end))
        x = np.pad(x, widths, mode=_NUMPY_PAD_MODES[mode])
        index[axis] = slice(o0, o1)
        x = x[tuple(index)]
    return [np.ascontiguousarray(x)]


def _pad_elements(node: NodeInfo) -> int:
    return int(np.prod(node.out_shapes[0], dtype=np.int64))


for _since, _until in ((1, 10), (11, None)):
    register(
        "Pad",
        pad_compute,
        since=_since,
        until=_until,
        dtypes=ALL,
        kernel="pad",
        split_axes=pad_split_axes,
        input_boxes=pad_input_boxes,
        macs=_pad_elements,
        doc="constant, reflect, edge and wrap modes; negative pads crop; pads as attribute "
        "(opset < 11) or input (11+, with axes from 18).",
    )


# ---------------------------------------------------------------------------------------------
# Resize and Upsample


@dataclass(frozen=True)
class AxisMap:
    """How one axis resizes: sizes, the scale used in coordinate transforms, and the roi."""

    in_size: int
    out_size: int
    scale: np.float32
    roi_start: float = 0.0
    roi_end: float = 1.0


@dataclass(frozen=True)
class ResizeMode:
    mode: str
    coordinates: str
    nearest: str
    cubic_a: float
    exclude_outside: bool
    extrapolation: float
    antialias: bool = False


def _resize_mode(node: NodeInfo) -> ResizeMode:
    legacy = node.op_type == "Upsample" or node.opset < 11
    mode = str(node.attr("mode", "nearest"))
    if mode == "bilinear":
        mode = "linear"
    return ResizeMode(
        mode=mode,
        coordinates="asymmetric"
        if legacy
        else str(node.attr("coordinate_transformation_mode", "half_pixel")),
        nearest="simple" if legacy else str(node.attr("nearest_mode", "round_prefer_floor")),
        cubic_a=float(node.attr("cubic_coeff_a", -0.75)),
        exclude_outside=bool(int(node.attr("exclude_outside", 0))),
        extrapolation=float(node.attr("extrapolation_value", 0.0)),
        antialias=bool(int(node.attr("antialias", 0))) and mode in ("linear", "cubic"),
    )


def _resize_inputs(node: NodeInfo) -> tuple[int | None, int | None, int | None]:
    """Input indices of (roi, scales, sizes) for this op and opset."""
    if node.op_type == "Upsample":
        return None, (1 if node.opset >= 9 else None), None
    if node.opset < 11:
        return None, 1, None
    return 1, 2, 3


def _axis_maps(node: NodeInfo, values: Mapping[int, np.ndarray]) -> list[AxisMap] | None:
    """Per-axis resize geometry, or None when scales/sizes/roi are not known."""
    in_shape, out_shape = _x_shape(node), node.out_shapes[0]
    rank = len(in_shape)
    roi_i, scales_i, sizes_i = _resize_inputs(node)

    def known(index: int | None) -> np.ndarray | None:
        if index is None or not node.has_input(index):
            return None
        if index not in values:
            raise LookupError
        value = np.asarray(values[index]).reshape(-1)
        return value if value.size else None

    try:
        roi, scales, sizes = known(roi_i), known(scales_i), known(sizes_i)
    except LookupError:
        return None
    axes = [int(a) % rank for a in node.attr("axes", range(rank))]
    scale_of = {a: F32(1.0) for a in range(rank)}
    if scales is None and node.op_type == "Upsample" and node.opset < 9:
        scales = np.asarray(node.attr("scales"), dtype=F32)
    if sizes is not None:
        # The requested sizes, not the output's: not_larger/not_smaller round them.
        ratios = {a: F32(int(n)) / F32(in_shape[a]) for a, n in zip(axes, sizes, strict=True)}
        policy = str(node.attr("keep_aspect_ratio_policy", "stretch"))
        if policy == "not_larger":
            ratios = dict.fromkeys(axes, min(ratios.values()))
        elif policy == "not_smaller":
            ratios = dict.fromkeys(axes, max(ratios.values()))
        scale_of.update(ratios)
    elif scales is not None:
        scale_of.update({a: F32(s) for a, s in zip(axes, scales, strict=True)})
    starts, ends = [0.0] * rank, [1.0] * rank
    if roi is not None and roi.size == 2 * len(axes):
        for i, a in enumerate(axes):
            starts[a], ends[a] = float(roi[i]), float(roi[i + len(axes)])
    return [
        AxisMap(int(in_shape[a]), int(out_shape[a]), scale_of[a], starts[a], ends[a])
        for a in range(rank)
    ]


def _source_coordinates(m: AxisMap, mode: ResizeMode, out: np.ndarray) -> np.ndarray:
    x = out.astype(F32)
    scale, n, size = m.scale, F32(m.in_size), F32(m.out_size)
    half = F32(0.5)
    kind = mode.coordinates
    if kind == "half_pixel":
        return (x + half) / scale - half
    if kind == "half_pixel_symmetric":
        adjustment = size / (scale * n)
        offset = n / F32(2) * (F32(1) - adjustment)
        return offset + (x + half) / scale - half
    if kind == "pytorch_half_pixel":
        return (x + half) / scale - half if m.out_size > 1 else np.zeros_like(x)
    if kind == "align_corners":
        # The resized length is in_size * scale, unrounded (a 0.6 scale of 4 is 2.4 long).
        return x * (n - 1) / (n * scale - 1) if m.out_size > 1 else np.zeros_like(x)
    if kind == "asymmetric":
        return x / scale
    if kind == "tf_half_pixel_for_nn":
        return (x + half) / scale
    if kind == "tf_crop_and_resize":
        start, end = F32(m.roi_start), F32(m.roi_end)
        if m.out_size > 1:
            return start * (n - 1) + x * (end - start) * (n - 1) / (size - 1)
        return np.full_like(x, half * (start + end) * (n - 1))
    raise CompileError("unsupported_attribute", f"coordinate_transformation_mode {kind!r}")


def _nearest_index(coord: np.ndarray, mode: ResizeMode, downsample: bool) -> np.ndarray:
    away = np.sign(coord) * np.floor(np.abs(coord) + F32(0.5))  # std::round
    trunc = np.trunc(coord)
    if mode.nearest == "round_prefer_floor":
        index = np.where(coord == trunc + F32(0.5), trunc, away)
    elif mode.nearest == "round_prefer_ceil":
        index = away
    elif mode.nearest == "floor":
        index = np.floor(coord)
    elif mode.nearest == "ceil":
        index = np.ceil(coord)
    elif mode.nearest == "simple":
        index = np.ceil(coord) if downsample else trunc
    else:
        raise CompileError("unsupported_attribute", f"nearest_mode {mode.nearest!r}")
    return index.astype(np.int64)


def _cubic_weights(s: np.ndarray, a: float) -> np.ndarray:
    a32 = F32(a)
    s = s.astype(F32)
    one, two = F32(1), F32(2)

    def far(t: np.ndarray) -> np.ndarray:
        return ((a32 * t - 5 * a32) * t + 8 * a32) * t - 4 * a32

    def near(t: np.ndarray) -> np.ndarray:
        return ((a32 + 2) * t - (a32 + 3)) * t * t + 1

    return np.stack([far(s + one), near(s), near(one - s), far(two - s)], axis=-1)


def _antialias_taps(
    coord: np.ndarray, m: AxisMap, mode: ResizeMode
) -> tuple[np.ndarray, np.ndarray]:
    """Downsampling with the interpolation filter stretched by 1/scale, so every input pixel
    under the footprint contributes (weights renormalised to sum to one).

    The taps are the n input positions nearest the source coordinate: base + start ... where an
    exact integer coordinate counts as the far end of the cell below it (ratio 1), as ONNX does.
    """
    scale = F32(m.scale)
    reach = 1.0 if mode.mode == "linear" else 2.0
    start = int(np.floor(-reach / float(scale))) + 1
    count = 2 - 2 * start
    base = np.floor(coord)
    ratio = coord - base
    whole = ratio == 0
    base = np.where(whole, base - 1, base).astype(np.int64)
    ratio = np.where(whole, F32(1), ratio).astype(F32)
    offsets = np.arange(start, start + count)
    args = np.abs((offsets[None, :] - ratio[:, None]) * scale).astype(F32)
    if mode.mode == "linear":
        weights = np.clip(F32(1) - args, F32(0), F32(1))
    else:
        a = F32(mode.cubic_a)
        near = ((a + 2) * args - (a + 3)) * args * args + 1
        far = ((a * args - 5 * a) * args + 8 * a) * args - 4 * a
        weights = np.where(args <= 1, near, np.where(args < 2, far, F32(0))).astype(F32)
    index = base[:, None] + offsets[None, :]
    if mode.exclude_outside:
        weights = np.where((index >= 0) & (index < m.in_size), weights, F32(0))
    weights = weights / weights.sum(axis=1, keepdims=True)
    return np.clip(index, 0, m.in_size - 1), weights.astype(F32)


def _taps(
    m: AxisMap, mode: ResizeMode, o0: int, o1: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(source indices [o, taps], weights [o, taps], inside-roi mask [o]) for outputs [o0, o1)."""
    last = m.in_size - 1
    if m.scale == 1 and m.in_size == m.out_size and mode.coordinates != "tf_crop_and_resize":
        # Unscaled axes are copied, whatever the coordinate mode says (ONNX Runtime does so;
        # tf_half_pixel_for_nn with ceil would otherwise shift them by one).
        index = np.arange(o0, o1, dtype=np.int64)[:, None]
        return index, np.ones(index.shape, dtype=F32), np.ones(o1 - o0, dtype=bool)
    coord = _source_coordinates(m, mode, np.arange(o0, o1))
    inside = (
        (coord >= 0) & (coord <= F32(last)) if mode.coordinates == "tf_crop_and_resize" else None
    )
    if mode.antialias and m.scale < 1:
        index, weights = _antialias_taps(coord, m, mode)
    elif mode.mode == "nearest":
        index = np.clip(_nearest_index(coord, mode, bool(m.scale < 1)), 0, last)[:, None]
        weights = np.ones(index.shape, dtype=F32)
    elif mode.mode == "linear":
        c = np.clip(coord, F32(0), F32(last))
        low = np.minimum(np.trunc(c).astype(np.int64), last)
        high = np.minimum(low + 1, last)
        d = c - low.astype(F32)
        index = np.stack([low, high], axis=-1)
        weights = np.stack([F32(1) - d, d], axis=-1)
    elif mode.mode == "cubic":
        base = np.floor(coord)
        index = base.astype(np.int64)[:, None] + np.arange(-1, 3)
        weights = _cubic_weights(coord - base, mode.cubic_a)
        if mode.exclude_outside:
            weights = np.where((index >= 0) & (index <= last), weights, F32(0))
            weights = weights / weights.sum(axis=1, keepdims=True)
        index = np.clip(index, 0, last)
    else:
        raise CompileError("unsupported_attribute", f"Resize mode {mode.mode!r}")
    if inside is None:
        inside = np.ones(coord.shape, dtype=bool)
    return index, weights, inside


def resize_split_axes(node: NodeInfo) -> list[int]:
    if _axis_maps(node, node.consts) is None:
        return []
    return list(range(len(node.out_shapes[0])))


def resize_input_boxes(node: NodeInfo, out_box: Box) -> list[Box | None]:
    maps = _axis_maps(node, node.consts)
    shape = _x_shape(node)
    if maps is None:
        return [full_box(shape), *_other_boxes(node)]
    mode = _resize_mode(node)
    box = []
    for m, (o0, o1) in zip(maps, out_box, strict=True):
        index, _, _ = _taps(m, mode, o0, o1)
        box.append(clip_range(int(index.min()), int(index.max()) + 1, m.in_size))
    return [tuple(box), *_other_boxes(node)]


def resize_compute(
    node: NodeInfo, inputs: list[np.ndarray | None], tile: TileCtx
) -> list[np.ndarray]:
    x = inputs[0]
    assert x is not None
    maps = _axis_maps(node, _given(node, inputs))
    if maps is None:
        raise CompileError("unsupported_attribute", "Resize needs scales or sizes", node=node.name)
    mode = _resize_mode(node)
    in_box = tile_box(tile, node, 0)
    exact = mode.mode == "nearest"
    y = x if exact else x.astype(accumulator(x.dtype), copy=False)
    outside = np.zeros((), dtype=bool)
    for axis, (m, (o0, o1)) in enumerate(zip(maps, tile.out_box, strict=True)):
        index, weights, inside = _taps(m, mode, o0, o1)
        local = index - in_box[axis][0]
        if exact:
            y = np.take(y, local[:, 0], axis=axis)
        else:
            shape = [1] * y.ndim
            shape[axis] = -1
            total = None
            for t in range(local.shape[1]):
                term = np.take(y, local[:, t], axis=axis) * weights[:, t].reshape(shape).astype(
                    y.dtype
                )
                total = term if total is None else total + term
            assert total is not None
            y = total
        outside = np.logical_or.outer(outside, ~inside)
    if mode.coordinates == "tf_crop_and_resize":
        y = np.where(outside, y.dtype.type(mode.extrapolation), y)
    return [np.ascontiguousarray(y).astype(x.dtype, copy=False)]


def _resize_macs(node: NodeInfo) -> int:
    return int(np.prod(node.out_shapes[0], dtype=np.int64))


for _since, _until in ((10, 10), (11, 12), (13, 17), (18, 18), (19, None)):
    register(
        "Resize",
        resize_compute,
        since=_since,
        until=_until,
        dtypes=FLOATS | {"int8", "uint8"},
        kernel="resize",
        split_axes=resize_split_axes,
        input_boxes=resize_input_boxes,
        macs=_resize_macs,
        doc="nearest, linear and cubic modes with every coordinate_transformation_mode; "
        "axes and keep_aspect_ratio_policy (18+); antialias (18+) for linear and cubic.",
    )
register(
    "Upsample",
    resize_compute,
    since=7,
    until=9,
    dtypes=FLOATS | {"int8", "uint8"},
    kernel="resize",
    split_axes=resize_split_axes,
    input_boxes=resize_input_boxes,
    macs=_resize_macs,
    doc="nearest or (bi)linear upsampling with asymmetric coordinates (scales attribute in "
    "opset 7, input in 9).",
)
