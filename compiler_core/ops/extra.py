"""GroupNormalization and CenterCropPad.

GroupNormalization normalises each (batch, group) over its channels and spatial axes, so it
tiles along the batch axis only. CenterCropPad is data movement with a static output shape
(its shape input is a constant) and runs whole.
"""

from __future__ import annotations

import numpy as np

from compiler_core.errors import CompileError
from compiler_core.ops.conv import tile_box
from compiler_core.ops.matmul import narrow
from compiler_core.ops.registry import ALL, FLOATS, Box, NodeInfo, TileCtx, full_box, register

Array = np.ndarray


def _group_norm_boxes(node: NodeInfo, out_box: Box) -> list[Box | None]:
    x_shape = node.in_shapes[0]
    assert x_shape is not None
    x_box = (out_box[0], *full_box(x_shape)[1:])
    return [x_box, *(None if s is None else full_box(s) for s in node.in_shapes[1:])]


def group_norm_compute(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    """Statistics per (batch, group) in float32 (float64 for float64 inputs); scale and bias
    are per group before opset 21 and per channel from it on."""
    x, scale, bias = inputs[0], inputs[1], inputs[2]
    assert x is not None and scale is not None and bias is not None
    x = narrow(x, tile_box(tile, node, 0), _group_norm_boxes(node, tile.out_box)[0])
    groups = int(node.attr("num_groups"))
    n, channels = x.shape[0], x.shape[1]
    if groups <= 0 or channels % groups:
        raise CompileError(
            "invalid_model",
            f"GroupNormalization: {channels} channels do not split into {groups} groups",
            node=node.name,
        )
    acc = np.float64 if x.dtype == np.float64 else np.float32
    grouped = x.astype(acc).reshape(n, groups, -1)
    mean = grouped.mean(axis=2, keepdims=True)
    var = ((grouped - mean) ** 2).mean(axis=2, keepdims=True)
    normal = ((grouped - mean) / np.sqrt(var + acc(node.attr("epsilon", 1e-5)))).reshape(x.shape)
    if scale.shape[0] != channels:
        scale = np.repeat(scale, channels // groups)
        bias = np.repeat(bias, channels // groups)
    trailing = (1,) * (x.ndim - 2)
    y = normal * scale.astype(acc).reshape(-1, *trailing) + bias.astype(acc).reshape(-1, *trailing)
    return [y.astype(np.dtype(node.out_dtypes[0]))]


register(
    "GroupNormalization",
    group_norm_compute,
    since=18,
    dtypes=FLOATS,
    kernel="group_norm",
    split_axes=lambda node: [0],
    input_boxes=_group_norm_boxes,
    macs=lambda node: 2 * int(np.prod(node.out_shapes[0], dtype=np.int64)),
    doc="Per (batch, group) normalisation; per-group (18) or per-channel (21) scale and bias.",
)


def center_crop_pad_compute(
    node: NodeInfo, inputs: list[Array | None], tile: TileCtx
) -> list[Array]:
    """Crop (centred, extra element taken from the end) or zero-pad (extra element at the
    end) each listed axis to the requested size."""
    x, shape = inputs[0], inputs[1]
    assert x is not None and shape is not None
    targets = [int(s) for s in shape.reshape(-1)]
    axes = [int(a) % x.ndim for a in node.attr("axes", list(range(x.ndim)))]
    if len(axes) != len(targets):
        raise CompileError(
            "invalid_model",
            f"CenterCropPad: {len(targets)} sizes for {len(axes)} axes",
            node=node.name,
        )
    y = x
    for axis, target in zip(axes, targets, strict=True):
        size = y.shape[axis]
        if target < size:
            start = (size - target) // 2
            y = np.take(y, np.arange(start, start + target), axis=axis)
        elif target > size:
            before = (target - size) // 2
            widths = [(0, 0)] * y.ndim
            widths[axis] = (before, target - size - before)
            y = np.pad(y, widths)
    return [np.ascontiguousarray(y, dtype=np.dtype(node.out_dtypes[0]))]


register(
    "CenterCropPad",
    center_crop_pad_compute,
    since=18,
    dtypes=ALL,
    kernel="center_crop_pad",
    doc="Centred crop or zero pad of the listed axes to a constant shape.",
)
