"""Normalisations and softmax-like ops: each reduces over some axes and tiles along the rest.

BatchNormalization is per-channel affine (tiles along every axis); LRN needs a channel halo.
Statistics are computed in fp32 (fp64 for fp64 inputs) and cast back, as ONNX Runtime does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from compiler_core.errors import CompileError
from compiler_core.ops.conv import accumulator, clip_range, crop_or_pad, tile_box
from compiler_core.ops.matmul import broadcast_box, narrow
from compiler_core.ops.registry import (
    FLOATS,
    Box,
    NodeInfo,
    Shape,
    TileCtx,
    full_box,
    register,
)


def _x_shape(node: NodeInfo) -> Shape:
    shape = node.in_shapes[0]
    assert shape is not None
    return shape


def _axis(node: NodeInfo, default: int) -> int:
    axis = int(node.attr("axis", default))
    return axis + len(_x_shape(node)) if axis < 0 else axis


def _reduced_box(node: NodeInfo, out_box: Box, reduced: Sequence[int]) -> Box:
    shape = _x_shape(node)
    return tuple((0, shape[a]) if a in reduced else out_box[a] for a in range(len(shape)))


def _x_tile(
    node: NodeInfo, inputs: list[np.ndarray | None], tile: TileCtx, reduced: Sequence[int]
) -> np.ndarray:
    x = inputs[0]
    assert x is not None
    return narrow(x, tile_box(tile, node, 0), _reduced_box(node, tile.out_box, reduced))


def _along(
    reduced_axes: Callable[[NodeInfo], list[int]], single_output: bool = True
) -> tuple[Callable[[NodeInfo], list[int]], Callable[[NodeInfo, Box], list[Box | None]]]:
    """Tiling rules of an op that reduces over `reduced_axes`: split along every other axis;
    every input other than X (scale, bias...) is given whole."""

    def split_axes(node: NodeInfo) -> list[int]:
        if single_output and len(node.out_shapes) > 1:
            return []
        reduced = reduced_axes(node)
        return [a for a in range(len(_x_shape(node))) if a not in reduced]

    def input_boxes(node: NodeInfo, out_box: Box) -> list[Box | None]:
        boxes: list[Box | None] = [_reduced_box(node, out_box, reduced_axes(node))]
        boxes += [None if s is None else full_box(s) for s in node.in_shapes[1:]]
        return boxes

    return split_axes, input_boxes


def _input_elements(node: NodeInfo) -> int:
    return int(np.prod(_x_shape(node), dtype=np.int64))


# ---------------------------------------------------------------------------------------------
# Softmax, LogSoftmax, Hardmax: opset < 13 flattens [axis:] (default 1), 13+ uses one axis
# (default -1).


def _softmax_axes_old(node: NodeInfo) -> list[int]:
    return list(range(_axis(node, 1), len(_x_shape(node))))


def _softmax_axes_new(node: NodeInfo) -> list[int]:
    return [_axis(node, -1)]


def _softmax_axes(node: NodeInfo) -> list[int]:
    return _softmax_axes_old(node) if node.opset < 13 else _softmax_axes_new(node)


def softmax_compute(
    node: NodeInfo, inputs: list[np.ndarray | None], tile: TileCtx
) -> list[np.ndarray]:
    x = _x_tile(node, inputs, tile, _softmax_axes(node))
    axes = tuple(_softmax_axes(node))
    e = x.astype(accumulator(x.dtype))  # a copy, worked on in place
    e -= e.max(axis=axes, keepdims=True)
    np.exp(e, out=e)
    e /= e.sum(axis=axes, keepdims=True)
    return [e.astype(x.dtype, copy=False)]


def log_softmax_compute(
    node: NodeInfo, inputs: list[np.ndarray | None], tile: TileCtx
) -> list[np.ndarray]:
    x = _x_tile(node, inputs, tile, _softmax_axes(node))
    axes = tuple(_softmax_axes(node))
    xa = x.astype(accumulator(x.dtype), copy=False)
    shifted = xa - xa.max(axis=axes, keepdims=True)
    y = shifted - np.log(np.exp(shifted).sum(axis=axes, keepdims=True))
    return [y.astype(x.dtype, copy=False)]


def hardmax_compute(
    node: NodeInfo, inputs: list[np.ndarray | None], tile: TileCtx
) -> list[np.ndarray]:
    x = _x_tile(node, inputs, tile, _softmax_axes(node))
    axes = _softmax_axes(node)
    moved = np.moveaxis(x, axes, list(range(x.ndim - len(axes), x.ndim)))
    flat = moved.reshape(*moved.shape[: x.ndim - len(axes)], -1)
    one_hot = np.zeros_like(flat)
    np.put_along_axis(one_hot, flat.argmax(axis=-1)[..., None], 1, axis=-1)
    back = one_hot.reshape(moved.shape)
    return [np.moveaxis(back, list(range(x.ndim - len(axes), x.ndim)), axes)]


for _op, _compute in (
    ("Softmax", softmax_compute),
    ("LogSoftmax", log_softmax_compute),
    ("Hardmax", hardmax_compute),
):
    for _since, _until, _axes in ((1, 12, _softmax_axes_old), (13, None, _softmax_axes_new)):
        _split, _boxes = _along(_axes)
        register(
            _op,
            _compute,
            since=_since,
            until=_until,
            kernel=_op.lower(),
            split_axes=_split,
            input_boxes=_boxes,
            doc="Over axis (opset 13+) or the flattened axes from axis on (opset < 13).",
        )


# ---------------------------------------------------------------------------------------------
# BatchNormalization (inference)


def _training(node: NodeInfo) -> bool:
    return node.opset >= 14 and int(node.attr("training_mode", 0)) == 1


def _check_batch_norm(node: NodeInfo) -> None:
    if len(node.out_shapes) > 1 and not _training(node):
        raise CompileError(
            "unsupported_attribute",
            "BatchNormalization with running-statistics outputs needs training_mode=1 "
            "(opset 14+); the opset<14 training outputs are not supported",
            node=node.name,
        )


def _batch_norm_training(node: NodeInfo, inputs: list[np.ndarray | None]) -> list[np.ndarray]:
    """Normalise with the batch's own statistics (population variance over every axis but the
    channel) and return the running statistics updated with `momentum`, as ONNX 14+ defines."""
    x, scale, bias, mean, var = inputs[:5]
    assert x is not None and scale is not None and bias is not None
    assert mean is not None and var is not None
    acc = accumulator(x.dtype)
    axes = tuple(a for a in range(x.ndim) if a != 1)
    trailing = (1,) * (x.ndim - 2)
    xa = x.astype(acc, copy=False)
    batch_mean = xa.mean(axis=axes)
    batch_var = xa.var(axis=axes)
    factor = scale.astype(acc) / np.sqrt(batch_var + acc(node.attr("epsilon", 1e-5)))
    y = (xa - batch_mean.reshape(-1, *trailing)) * factor.reshape(-1, *trailing)
    y = y + bias.astype(acc).reshape(-1, *trailing)
    momentum = acc(node.attr("momentum", 0.9))
    running_mean = mean.astype(acc) * momentum + batch_mean * (1 - momentum)
    running_var = var.astype(acc) * momentum + batch_var * (1 - momentum)
    results = [y, running_mean, running_var][: len(node.out_dtypes)]
    return [r.astype(np.dtype(d)) for r, d in zip(results, node.out_dtypes, strict=True)]


def _param_box(shape: Shape | None, out_box: Box) -> Box | None:
    """Per-channel (C,) parameters, or (C, D1, ...) ones when spatial=0 (opset < 9)."""
    if shape is None:
        return None
    return broadcast_box(shape, out_box[1 : 1 + len(shape)])


def batch_norm_split_axes(node: NodeInfo) -> list[int]:
    if len(node.out_shapes) > 1 or _training(node):
        return []  # batch statistics need every element
    return list(range(len(node.out_shapes[0])))


def batch_norm_input_boxes(node: NodeInfo, out_box: Box) -> list[Box | None]:
    return [out_box, *(_param_box(s, out_box) for s in node.in_shapes[1:])]


def batch_norm_compute(
    node: NodeInfo, inputs: list[np.ndarray | None], tile: TileCtx
) -> list[np.ndarray]:
    _check_batch_norm(node)
    if _training(node):
        return _batch_norm_training(node, inputs)
    x = inputs[0]
    assert x is not None
    acc = accumulator(x.dtype)
    wanted = batch_norm_input_boxes(node, tile.out_box)
    params = []
    for i in range(1, 5):
        value = inputs[i]
        assert value is not None
        part = narrow(value, tile_box(tile, node, i), wanted[i]).astype(acc, copy=False)
        trailing = x.ndim - 1 - part.ndim
        params.append(part.reshape(part.shape + (1,) * trailing))
    scale, bias, mean, var = params
    x = narrow(x, tile_box(tile, node, 0), tile.out_box)
    factor = scale / np.sqrt(var + acc(node.attr("epsilon", 1e-5)))
    y = (x.astype(acc, copy=False) - mean) * factor + bias
    return [y.astype(x.dtype, copy=False)]


register(
    "BatchNormalization",
    batch_norm_compute,
    since=1,
    kernel="batch_norm",
    split_axes=batch_norm_split_axes,
    input_boxes=batch_norm_input_boxes,
    macs=_input_elements,
    doc="Inference, and training_mode=1 (batch statistics, updated running mean and var).",
)


# ---------------------------------------------------------------------------------------------
# InstanceNormalization, LayerNormalization, MeanVarianceNormalization, LpNormalization


def _spatial_axes(node: NodeInfo) -> list[int]:
    return list(range(2, len(_x_shape(node))))


def instance_norm_input_boxes(node: NodeInfo, out_box: Box) -> list[Box | None]:
    return [_reduced_box(node, out_box, _spatial_axes(node)), (out_box[1],), (out_box[1],)]


def instance_norm_compute(
    node: NodeInfo, inputs: list[np.ndarray | None], tile: TileCtx
) -> list[np.ndarray]:
    axes = _spatial_axes(node)
    x = _x_tile(node, inputs, tile, axes)
    acc = accumulator(x.dtype)
    wanted = instance_norm_input_boxes(node, tile.out_box)
    params = []
    for i in (1, 2):
        value = inputs[i]
        assert value is not None
        part = narrow(value, tile_box(tile, node, i), wanted[i]).astype(acc, copy=False)
        params.append(part.reshape((-1,) + (1,) * len(axes)))
    scale, bias = params
    xa = x.astype(acc, copy=False)
    mean = xa.mean(axis=tuple(axes), keepdims=True)
    var = ((xa - mean) ** 2).mean(axis=tuple(axes), keepdims=True)
    y = (xa - mean) / np.sqrt(var + acc(node.attr("epsilon", 1e-5))) * scale + bias
    return [y.astype(x.dtype, copy=False)]


register(
    "InstanceNormalization",
    instance_norm_compute,
    since=1,
    kernel="instance_norm",
    split_axes=lambda node: [0, 1],
    input_boxes=instance_norm_input_boxes,
    macs=_input_elements,
    doc="Per (batch, channel) normalisation over the spatial axes.",
)


def _layer_norm_axes(node: NodeInfo) -> list[int]:
    return list(range(_axis(node, -1), len(_x_shape(node))))


def layer_norm_compute(
    node: NodeInfo, inputs: list[np.ndarray | None], tile: TileCtx
) -> list[np.ndarray]:
    axes = tuple(_layer_norm_axes(node))
    x = _x_tile(node, inputs, tile, axes)
    acc = np.float64 if x.dtype == np.float64 else np.float32
    xa = x.astype(acc, copy=False)
    count = math.prod(xa.shape[a] for a in axes)
    mean = _mean(xa, axes, count)
    centred = xa - mean
    var = _mean(centred**2, axes, count)
    inv_std = 1.0 / np.sqrt(var + acc(node.attr("epsilon", 1e-5)))
    y = np.multiply(centred, inv_std, out=centred)
    scale, bias = inputs[1], inputs[2] if len(inputs) > 2 else None
    assert scale is not None
    y = _into(np.multiply, y, scale.astype(acc, copy=False))
    if bias is not None:
        y = _into(np.add, y, bias.astype(acc, copy=False))
    outputs = [y.astype(x.dtype, copy=False)]
    for value, dtype in zip((mean, inv_std), node.out_dtypes[1:], strict=False):
        outputs.append(value.astype(dtype, copy=False))
    return outputs


def _mean(x: np.ndarray, axes: tuple[int, ...], count: int) -> np.ndarray:
    """`x.mean(axis=axes, keepdims=True)` as numpy computes it (the sum, then a division by
    the count as an intp, in place), without its argument handling: the same bytes."""
    total = np.add.reduce(x, axis=axes, keepdims=True)
    return np.true_divide(total, np.intp(count), out=total, casting="unsafe")


def _into(ufunc: np.ufunc, y: np.ndarray, v: np.ndarray) -> np.ndarray:
    """`ufunc(y, v)`, into `y` (a fresh array of the result's dtype) when `v` broadcasts to
    it: the same values without another array, which a tile pays for in cache misses."""
    if v.dtype == y.dtype and v.ndim <= y.ndim:
        if all(n in (1, m) for n, m in zip(v.shape[::-1], y.shape[::-1], strict=False)):
            return ufunc(y, v, out=y)  # type: ignore[no-any-return]
    return ufunc(y, v)  # type: ignore[no-any-return]


def rms_norm_compute(
    node: NodeInfo, inputs: list[np.ndarray | None], tile: TileCtx
) -> list[np.ndarray]:
    """x / sqrt(mean(x^2) + epsilon) * scale over the axes from `axis` on."""
    axes = tuple(_layer_norm_axes(node))
    x = _x_tile(node, inputs, tile, axes)
    acc = np.float64 if x.dtype == np.float64 else np.float32
    xa = x.astype(acc, copy=False)
    rms = np.sqrt(np.square(xa).mean(axis=axes, keepdims=True) + acc(node.attr("epsilon", 1e-5)))
    scale = inputs[1]
    assert scale is not None
    y = xa / rms * scale.astype(acc, copy=False)
    return [y.astype(np.dtype(node.out_dtypes[0]), copy=False)]


_ln_split, _ln_boxes = _along(_layer_norm_axes)
register(
    "RMSNormalization",
    rms_norm_compute,
    since=23,
    kernel="rms_norm",
    split_axes=_ln_split,
    input_boxes=_ln_boxes,
    macs=_input_elements,
    doc="Root-mean-square normalisation over the axes from axis on, times scale.",
)
register(
    "LayerNormalization",
    layer_norm_compute,
    since=17,
    kernel="layer_norm",
    split_axes=_ln_split,
    input_boxes=_ln_boxes,
    macs=_input_elements,
    doc="Over the axes from axis on; optional Mean/InvStdDev outputs (then computed whole).",
)


def _mvn_axes(node: NodeInfo) -> list[int]:
    rank = len(_x_shape(node))
    return sorted(int(a) % rank for a in node.attr("axes", [0, 2, 3]))


def mvn_compute(node: NodeInfo, inputs: list[np.ndarray | None], tile: TileCtx) -> list[np.ndarray]:
    axes = tuple(_mvn_axes(node))
    x = _x_tile(node, inputs, tile, axes)
    xa = x.astype(accumulator(x.dtype), copy=False)
    centred = xa - xa.mean(axis=axes, keepdims=True)
    std = np.sqrt((centred**2).mean(axis=axes, keepdims=True))
    return [(centred / (std + 1e-9)).astype(x.dtype, copy=False)]


_mvn_split, _mvn_boxes = _along(_mvn_axes)
register(
    "MeanVarianceNormalization",
    mvn_compute,
    since=9,
    kernel="mvn",
    split_axes=_mvn_split,
    input_boxes=_mvn_boxes,
    macs=_input_elements,
    doc="(X - mean) / (std + 1e-9) over axes (default [0, 2, 3]).",
)


def _lp_axes(node: NodeInfo) -> list[int]:
    return [_axis(node, -1)]


def lp_norm_compute(
    node: NodeInfo, inputs: list[np.ndarray | None], tile: TileCtx
) -> list[np.ndarray]:
    axis = _lp_axes(node)[0]
    x = _x_tile(node, inputs, tile, [axis])
    xa = x.astype(accumulator(x.dtype), copy=False)
    p = int(node.attr("p", 2))
    norm = (
        np.abs(xa).sum(axis=axis, keepdims=True)
        if p == 1
        else np.sqrt((xa * xa).sum(axis=axis, keepdims=True))
    )
    # A zero vector stays zero (0/0 would be NaN), as the ONNX reference defines it.
    safe = np.where(norm == 0, 1, norm)
    return [(xa / safe).astype(x.dtype, copy=False)]


_lp_split, _lp_boxes = _along(_lp_axes)
register(
    "LpNormalization",
    lp_norm_compute,
    since=1,
    kernel="lp_norm",
    split_axes=_lp_split,
    input_boxes=_lp_boxes,
    macs=_input_elements,
    doc="X / ||X||_p along axis, p in {1, 2}.",
)


# ---------------------------------------------------------------------------------------------
# LRN: a sum of squares over a channel window, so channel tiles need a halo.


def _lrn_reach(node: NodeInfo) -> tuple[int, int]:
    size = int(node.attr("size"))
    return (size - 1) // 2, size - 1 - (size - 1) // 2


def lrn_input_boxes(node: NodeInfo, out_box: Box) -> list[Box | None]:
    before, after = _lrn_reach(node)
    c0, c1 = out_box[1]
    channels = clip_range(c0 - before, c1 + after, _x_shape(node)[1])
    return [(out_box[0], channels, *out_box[2:])]


def lrn_compute(node: NodeInfo, inputs: list[np.ndarray | None], tile: TileCtx) -> list[np.ndarray]:
    x = inputs[0]
    assert x is not None
    box = tile_box(tile, node, 0)
    out_box = tile.out_box
    wanted = (out_box[0], box[1], *out_box[2:])
    x = narrow(x, box, wanted).astype(accumulator(x.dtype), copy=False)
    before, after = _lrn_reach(node)
    size = before + after + 1
    c0, c1 = out_box[1]
    squares = crop_or_pad(x * x, 1, c0 - before - box[1][0], c1 + after - box[1][0], 0.0)
    total = sliding_window_view(squares, size, axis=1).sum(axis=-1)
    centre = x[:, c0 - box[1][0] : c1 - box[1][0]]
    alpha, beta = float(node.attr("alpha", 1e-4)), float(node.attr("beta", 0.75))
    y = centre / (float(node.attr("bias", 1.0)) + alpha / size * total) ** beta
    dtype = np.dtype(node.out_dtypes[0])
    return [y.astype(dtype, copy=False)]


register(
    "LRN",
    lrn_compute,
    since=1,
    dtypes=FLOATS,
    kernel="lrn",
    split_axes=lambda node: [0, *range(2, len(_x_shape(node))), 1],
    input_boxes=lrn_input_boxes,
    macs=_input_elements,
    doc="Local response normalisation across channels.",
)
