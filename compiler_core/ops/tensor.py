"""Tensor manipulation: views, copies, gathers and scatters, shape arithmetic and generators.

Views (Reshape, Flatten, Squeeze, Unsqueeze, Identity) are `alias` entries: the
lowering reuses the input's bytes; their kernels exist for constant folding. Copies that move
whole rows (Transpose, Concat, Slice, Gather, Expand, Tile, Trilu) can be cut along their
output axes; ops whose output depends on data or that have several outputs run whole.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from compiler_core.errors import CompileError
from compiler_core.ops._tiling import (
    all_axes,
    broadcast_input_box,
    elementwise_split,
    normalize_axis,
    permute_box,
    replace_axis,
)
from compiler_core.ops.elementwise import Array, out_dtype
from compiler_core.ops.registry import (
    ALL,
    NUMERIC,
    Box,
    NodeInfo,
    TileCtx,
    full_box,
    no_macs,
    register,
)

Compute = Callable[[NodeInfo, list[Array | None], TileCtx], list[Array]]


def _x(node: NodeInfo, inputs: list[Array | None], index: int = 0) -> Array:
    x = inputs[index] if index < len(inputs) else None
    if x is None:
        raise CompileError(
            "missing_input", f"{node.op_type} needs input {index}", node=node.name or None
        )
    return x


def _opt(inputs: list[Array | None], index: int) -> Array | None:
    return inputs[index] if index < len(inputs) else None


def _ints(value: Any) -> list[int]:
    return [int(v) for v in np.asarray(value).reshape(-1).tolist()]


def _rank(node: NodeInfo, index: int = 0) -> int:
    return len(node.in_shapes[index] or ())


def _given_whole(node: NodeInfo, first: int) -> list[Box | None]:
    return [None if s is None else full_box(s) for s in node.in_shapes[first:]]


# --- views --------------------------------------------------------------------------------------


def reshape_target(shape: Sequence[int], in_shape: Sequence[int], allowzero: bool) -> list[int]:
    """Resolve Reshape's 0 (copy the input dim, unless allowzero) and -1 (infer)."""
    dims = [int(d) for d in shape]
    if not allowzero:
        dims = [int(in_shape[i]) if d == 0 else d for i, d in enumerate(dims)]
    if -1 in dims:
        known = int(np.prod([d for d in dims if d != -1], dtype=np.int64))
        total = int(np.prod(in_shape, dtype=np.int64))
        dims[dims.index(-1)] = total // known if known else 0
    return dims


def _reshape(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    x = _x(node, inputs)
    shape = _opt(inputs, 1)
    dims = _ints(node.attr("shape")) if shape is None else _ints(shape)
    target = reshape_target(dims, x.shape, bool(node.attr("allowzero", 0)))
    return [x.reshape(target)]


def _flatten(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    x = _x(node, inputs)
    axis = int(node.attr("axis", 1))
    axis = axis + x.ndim if axis < 0 else axis
    outer = int(np.prod(x.shape[:axis], dtype=np.int64))
    return [x.reshape(outer, int(np.prod(x.shape[axis:], dtype=np.int64)))]


def _axes(node: NodeInfo, inputs: list[Array | None]) -> list[int] | None:
    """The `axes` attribute (older opsets) or the optional second input (opset 13 on)."""
    if "axes" in node.attrs:
        return _ints(node.attrs["axes"])
    axes = _opt(inputs, 1)
    return None if axes is None else _ints(axes)


def _squeeze(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    x = _x(node, inputs)
    axes = _axes(node, inputs)
    if axes is None:
        return [x.reshape([d for d in x.shape if d != 1])]
    return [np.squeeze(x, axis=tuple(normalize_axis(a, x.ndim) for a in axes))]


def _unsqueeze(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    x = _x(node, inputs)
    axes = _axes(node, inputs) or []
    rank = x.ndim + len(axes)
    return [np.expand_dims(x, axis=tuple(sorted(normalize_axis(a, rank) for a in axes)))]


def _identity(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    return [_x(node, inputs)]


def _dropout(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    """Identity at inference. In training mode (opset 12+: the `training_mode` input is True)
    each element is dropped with probability `ratio` and the rest scaled by 1 / (1 - ratio).

    The draw is numpy's MT19937 stream (RandomState) seeded by `seed` (0 when absent), one
    uniform per element over the whole tensor in C order: every run of a QPC drops the same
    elements, and the ONNX reference's seeded expectations hold. The kernel runs whole so that
    tiling cannot change which element gets which draw.
    """
    x = _x(node, inputs)
    training = _opt(inputs, 2)
    ratio_in = _opt(inputs, 1)
    ratio = float(np.asarray(ratio_in).reshape(-1)[0]) if ratio_in is not None else 0.5
    if node.opset < 12:
        ratio = float(node.attr("ratio", 0.5))
    active = training is not None and bool(np.asarray(training).reshape(-1)[0])
    if not active or ratio == 0:
        mask = np.ones(x.shape, dtype=bool)
        y = x
    else:
        if not 0 <= ratio < 1:
            raise CompileError(
                "invalid_model", f"Dropout ratio {ratio} is outside [0, 1)", node=node.name
            )
        draws = np.random.RandomState(int(node.attr("seed", 0))).uniform(0.0, 1.0, x.shape)
        mask = draws >= ratio
        y = (mask * x * (1.0 / (1.0 - ratio))).astype(x.dtype)
    return [y, mask][: len(node.out_shapes)]


register(
    "Dropout",
    _dropout,
    since=7,
    dtypes=ALL,
    kernel="dropout",
    doc="Identity at inference (removed by canonicalisation); training mode with a seeded, "
    "reproducible mask.",
)


for _name, _fn, _since in (
    ("Reshape", _reshape, 5),
    ("Flatten", _flatten, 1),
    ("Squeeze", _squeeze, 1),
    ("Unsqueeze", _unsqueeze, 1),
    ("Identity", _identity, 1),
):
    register(_name, _fn, since=_since, dtypes=ALL, alias=True, macs=no_macs)


# --- Transpose, Concat --------------------------------------------------------------------------


def _perm(node: NodeInfo) -> list[int]:
    perm = node.attr("perm")
    return list(reversed(range(_rank(node)))) if perm is None else _ints(perm)


def _transpose(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    return [np.ascontiguousarray(np.transpose(_x(node, inputs), _perm(node)))]


register(
    "Transpose",
    _transpose,
    since=1,
    dtypes=ALL,
    split_axes=elementwise_split,
    input_boxes=lambda node, box: [permute_box(box, _perm(node))],
)


def _concat_axis(node: NodeInfo) -> int:
    return normalize_axis(int(node.attr("axis", 0)), len(node.out_shapes[0]))


def _concat(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    parts = [x for x in inputs if x is not None]
    return [np.concatenate(parts, axis=_concat_axis(node)).astype(out_dtype(node), copy=False)]


def _concat_boxes(node: NodeInfo, out_box: Box) -> list[Box | None]:
    axis = _concat_axis(node)
    return [
        None if s is None else replace_axis(out_box, axis, (0, s[axis])) for s in node.in_shapes
    ]


register(
    "Concat",
    _concat,
    since=4,
    dtypes=ALL,
    split_axes=lambda node: [
        a for a in all_axes(len(node.out_shapes[0])) if a != _concat_axis(node)
    ],
    input_boxes=_concat_boxes,
)


# --- Split --------------------------------------------------------------------------------------


def _split(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    """Split sizes from the `split` input (13+) or attribute, else equal parts: with
    `num_outputs` (18+) the last part may be smaller."""
    x = _x(node, inputs)
    axis = normalize_axis(int(node.attr("axis", 0)), x.ndim)
    sizes_input = _opt(inputs, 1)
    if sizes_input is not None:
        sizes = _ints(sizes_input)
    elif "split" in node.attrs:
        sizes = _ints(node.attrs["split"])
    else:
        count = int(node.attr("num_outputs", len(node.out_shapes)))
        chunk = -(-x.shape[axis] // count)
        sizes = [min(chunk, max(x.shape[axis] - i * chunk, 0)) for i in range(count)]
    bounds = np.cumsum([0, *sizes])
    return [
        np.ascontiguousarray(np.take(x, np.arange(bounds[i], bounds[i + 1]), axis=axis))
        for i in range(len(sizes))
    ]


def _split_axis(node: NodeInfo) -> int:
    return normalize_axis(int(node.attr("axis", 0)), len(node.out_shapes[0]))


def _split_input_boxes(node: NodeInfo, out_box: Box) -> list[Box | None]:
    """The tile's rows of every output need the same rows of the input, whole along the
    split axis (and the split sizes, whole)."""
    axis = _split_axis(node)
    x = node.in_shapes[0]
    assert x is not None
    boxes: list[Box | None] = [out_box[:axis] + ((0, x[axis]),) + out_box[axis + 1 :]]
    boxes += [None if s is None else full_box(s) for s in node.in_shapes[1:]]
    return boxes


def _split_output_boxes(node: NodeInfo, out_box: Box) -> list[Box]:
    axis = _split_axis(node)
    return [out_box[:axis] + ((0, s[axis]),) + out_box[axis + 1 :] for s in node.out_shapes]


register(
    "Split",
    _split,
    since=2,
    dtypes=ALL,
    split_axes=lambda node: [
        a for a in all_axes(len(node.out_shapes[0])) if a != _split_axis(node)
    ],
    input_boxes=_split_input_boxes,
    output_boxes=_split_output_boxes,
)


# --- Slice --------------------------------------------------------------------------------------


def _slice_params(
    node: NodeInfo, values: Callable[[int], Array | None]
) -> list[tuple[int, int, int]] | None:
    """(first input index, step, count) per input axis, ONNX clamping applied; None if unknown.

    `values(i)` gives input i's value (starts, ends, axes, steps from opset 10; attributes before).
    """
    in_shape = node.in_shapes[0] or ()
    if "starts" in node.attrs:
        starts, ends = _ints(node.attrs["starts"]), _ints(node.attrs["ends"])
        axes_v: Any = node.attrs.get("axes")
        steps_v: Any = None
    else:
        raw = [values(i) for i in (1, 2)]
        if raw[0] is None or raw[1] is None:
            return None
        starts, ends = _ints(raw[0]), _ints(raw[1])
        axes_v, steps_v = values(3), values(4)
        if (node.has_input(3) and axes_v is None) or (node.has_input(4) and steps_v is None):
            return None
    axes = list(range(len(starts))) if axes_v is None else _ints(axes_v)
    steps = [1] * len(starts) if steps_v is None else _ints(steps_v)
    params = [(0, 1, int(d)) for d in in_shape]
    for start, end, axis, step in zip(starts, ends, axes, steps, strict=True):
        axis = normalize_axis(axis, len(in_shape))
        dim = int(in_shape[axis])
        start = start + dim if start < 0 else start
        end = end + dim if end < 0 else end
        if step > 0:
            start, end = min(max(start, 0), dim), min(max(end, 0), dim)
            count = max(0, -(-(end - start) // step))
        else:
            start, end = min(max(start, 0), dim - 1), min(max(end, -1), dim - 1)
            count = max(0, -(-(start - end) // -step))
        params[axis] = (start, step, count)
    return params


def _axis_range(first: int, step: int, lo: int, hi: int) -> tuple[int, int]:
    """The input index range read by output indices [lo, hi) of a strided axis."""
    if hi <= lo:
        return (0, 0)
    a, b = first + lo * step, first + (hi - 1) * step
    return (min(a, b), max(a, b) + 1)


def _slice(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    x = _x(node, inputs)
    params = _slice_params(node, lambda i: _opt(inputs, i))
    assert params is not None, "Slice needs starts and ends"
    in_box = tile.in_boxes[0] or full_box(x.shape)
    index: list[slice] = []
    for (first, step, _), (lo, hi), (base, _) in zip(params, tile.out_box, in_box, strict=True):
        start = first + lo * step - base
        stop: int | None = start + (hi - lo) * step
        index.append(slice(start, None if stop is not None and stop < 0 else stop, step))
    return [np.ascontiguousarray(x[tuple(index)])]


def _slice_split(node: NodeInfo) -> list[int]:
    if _slice_params(node, node.consts.get) is None:
        return []
    return all_axes(len(node.out_shapes[0]))


def _slice_boxes(node: NodeInfo, out_box: Box) -> list[Box | None]:
    params = _slice_params(node, node.consts.get)
    if params is None:  # not constant: only the whole output is ever asked for
        return _given_whole(node, 0)
    box = tuple(
        _axis_range(first, step, lo, hi)
        for (first, step, _), (lo, hi) in zip(params, out_box, strict=True)
    )
    return [box, *_given_whole(node, 1)]


register(
    "Slice",
    _slice,
    since=1,
    dtypes=ALL,
    split_axes=_slice_split,
    input_boxes=_slice_boxes,
    doc="starts/ends/axes are attributes before opset 10 and inputs (plus steps) from it on.",
)


# --- Gather family ------------------------------------------------------------------------------


def _fix_indices(indices: Array, dim: int) -> Array:
    indices = indices.astype(np.int64)
    return np.where(indices < 0, indices + dim, indices)


def _gather_axis(node: NodeInfo) -> int:
    return normalize_axis(int(node.attr("axis", 0)), _rank(node))


def _gather(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    data, indices = _x(node, inputs), _x(node, inputs, 1)
    axis = _gather_axis(node)
    return [np.take(data, _fix_indices(indices, data.shape[axis]), axis=axis)]


def _gather_split(node: NodeInfo) -> list[int]:
    axis, q = _gather_axis(node), _rank(node, 1)
    outer = list(range(axis))
    inner = list(range(axis + q, len(node.out_shapes[0])))
    return outer + inner + list(range(axis, axis + q))


def _gather_boxes(node: NodeInfo, out_box: Box) -> list[Box | None]:
    axis, q = _gather_axis(node), _rank(node, 1)
    data_shape = node.in_shapes[0] or ()
    data_box = out_box[:axis] + ((0, int(data_shape[axis])),) + out_box[axis + q :]
    return [data_box, out_box[axis : axis + q]]


register(
    "Gather",
    _gather,
    since=1,
    dtypes=ALL,
    split_axes=_gather_split,
    input_boxes=_gather_boxes,
    indexed_inputs=frozenset({0}),
)


def _gather_elements(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    data, indices = _x(node, inputs), _x(node, inputs, 1)
    axis = _gather_axis(node)
    fixed = _fix_indices(indices, data.shape[axis])
    # Data may be larger than indices on the other axes: only the leading part is read.
    window = tuple(
        slice(None) if a == axis else slice(0, indices.shape[a]) for a in range(data.ndim)
    )
    return [np.take_along_axis(data[window], fixed, axis=axis)]


def _gather_elements_boxes(node: NodeInfo, out_box: Box) -> list[Box | None]:
    axis = _gather_axis(node)
    data_shape = node.in_shapes[0] or ()
    return [replace_axis(out_box, axis, (0, int(data_shape[axis]))), out_box]


register(
    "GatherElements",
    _gather_elements,
    since=11,
    dtypes=ALL,
    split_axes=lambda node: [a for a in all_axes(_rank(node)) if a != _gather_axis(node)],
    input_boxes=_gather_elements_boxes,
)


def _gather_nd(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    data, indices = _x(node, inputs), _x(node, inputs, 1).astype(np.int64)
    b = int(node.attr("batch_dims", 0))
    batch_shape = data.shape[:b]
    k = indices.shape[-1]
    batch = int(np.prod(batch_shape, dtype=np.int64))
    flat_data = data.reshape((batch, *data.shape[b:]))
    flat_idx = indices.reshape((batch, -1, k))
    flat_idx = np.where(flat_idx < 0, flat_idx + np.array(data.shape[b : b + k]), flat_idx)
    picked = [flat_data[i][tuple(flat_idx[i].T)] for i in range(batch)]
    out_shape = (*indices.shape[:-1], *data.shape[b + k :])
    return [np.stack(picked).reshape(out_shape) if batch else np.zeros(out_shape, data.dtype)]


register("GatherND", _gather_nd, since=11, dtypes=ALL)


_SCATTER_REDUCE: dict[str, Callable[..., Any] | None] = {
    "none": None,
    "add": np.add.at,
    "mul": np.multiply.at,
    "max": np.maximum.at,
    "min": np.minimum.at,
}


def _scatter_reduction(node: NodeInfo) -> Callable[..., Any] | None:
    name = str(node.attr("reduction", "none"))
    if name not in _SCATTER_REDUCE:
        raise CompileError(
            "invalid_attribute", f"unknown reduction {name!r}", node=node.name or None
        )
    return _SCATTER_REDUCE[name]


def _scatter_elements(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    data, indices, updates = (_x(node, inputs, i) for i in range(3))
    axis = _gather_axis(node)
    fixed = _fix_indices(indices, data.shape[axis])
    where: list[Array] = list(np.indices(indices.shape, sparse=True))
    where[axis] = fixed
    out = data.copy()
    reduction = _scatter_reduction(node)
    if reduction is None:
        out[tuple(where)] = updates
    else:
        reduction(out, tuple(np.broadcast_arrays(*where)), updates)
    return [out]


def _scatter_nd(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    data, indices, updates = (_x(node, inputs, i) for i in range(3))
    k = indices.shape[-1]
    flat_idx = indices.astype(np.int64).reshape(-1, k)
    flat_idx = np.where(flat_idx < 0, flat_idx + np.array(data.shape[:k]), flat_idx)
    flat_updates = updates.reshape((flat_idx.shape[0], *data.shape[k:]))
    out = data.copy()
    reduction = _scatter_reduction(node)
    where = tuple(flat_idx.T)
    if reduction is None:
        out[where] = flat_updates
    else:
        reduction(out, where, flat_updates)
    return [out]


register("ScatterElements", _scatter_elements, since=11, dtypes=ALL)
register("ScatterND", _scatter_nd, since=11, dtypes=ALL)
# Scatter (opset 9-10) is ScatterElements without `reduction` under its deprecated name.
register("Scatter", _scatter_elements, since=9, until=10, dtypes=ALL, kernel="scatterelements")


# --- Expand, Tile, Trilu ------------------------------------------------------------------------


def _tile_shape(tile: TileCtx) -> tuple[int, ...]:
    return tuple(stop - start for start, stop in tile.out_box)


def _expand(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    x, shape = _x(node, inputs), _x(node, inputs, 1)
    # The whole output is broadcast(x.shape, shape); a tile is its output box.
    target = np.broadcast_shapes(x.shape, _tile_shape(tile), tuple(_ints(shape))[:0])
    return [np.ascontiguousarray(np.broadcast_to(x, target))]


def _expand_boxes(node: NodeInfo, out_box: Box) -> list[Box | None]:
    in_shape = node.in_shapes[0] or ()
    return [broadcast_input_box(in_shape, node.out_shapes[0], out_box), *_given_whole(node, 1)]


register(
    "Expand",
    _expand,
    since=8,
    dtypes=ALL,
    split_axes=elementwise_split,
    input_boxes=_expand_boxes,
)


def _tile_axis_range(dim: int, lo: int, hi: int) -> tuple[int, int]:
    """The input range output indices [lo, hi) of a repeated axis read."""
    if hi - lo >= dim or lo // dim != (hi - 1) // dim:
        return (0, dim)
    return (lo % dim, (hi - 1) % dim + 1)


def _tile(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    x = _x(node, inputs)
    in_shape = node.in_shapes[0] or x.shape
    in_box = tile.in_boxes[0] or full_box(x.shape)
    index = [
        np.arange(lo, hi) % int(dim) - base
        for (lo, hi), dim, (base, _) in zip(tile.out_box, in_shape, in_box, strict=True)
    ]
    return [x[np.ix_(*index)] if index else x.copy()]


register(
    "Tile",
    _tile,
    since=6,
    dtypes=ALL,
    split_axes=elementwise_split,
    input_boxes=lambda node, box: [
        tuple(
            _tile_axis_range(int(d), lo, hi)
            for d, (lo, hi) in zip(node.in_shapes[0] or (), box, strict=True)
        ),
        *_given_whole(node, 1),
    ],
)


def _trilu(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    """Keep the upper or lower triangle; positions come from the tile so any cut works."""
    x = _x(node, inputs)
    k_input = _opt(inputs, 1)
    k = 0 if k_input is None else int(np.asarray(k_input).reshape(-1)[0])
    (r0, r1), (c0, c1) = tile.out_box[-2], tile.out_box[-1]
    diff = np.arange(c0, c1)[None, :] - np.arange(r0, r1)[:, None]
    keep = diff >= k if int(node.attr("upper", 1)) else diff <= k
    return [np.where(keep, x, np.zeros((), x.dtype))]


register(
    "Trilu",
    _trilu,
    since=14,
    dtypes=ALL,
    split_axes=elementwise_split,
    input_boxes=lambda node, box: [box, *_given_whole(node, 1)],
)


# --- shape arithmetic and generators ------------------------------------------------------------


def _constant(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    dtype = out_dtype(node)
    for name in ("value", "value_float", "value_floats", "value_int", "value_ints"):
        if name in node.attrs:
            return [np.asarray(node.attrs[name]).astype(dtype, copy=False)]
    raise CompileError("unsupported_op", "Constant without a numeric value", node=node.name or None)


def _constant_of_shape(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    shape = _ints(_x(node, inputs))
    value = node.attr("value")
    fill = np.zeros((), np.float32) if value is None else np.asarray(value).reshape(-1)[0]
    return [np.full(shape, fill, dtype=out_dtype(node))]


def _shape(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    dims = list(_x(node, inputs).shape)
    start, end = int(node.attr("start", 0)), node.attr("end")
    stop = len(dims) if end is None else int(end)
    return [np.array(dims[slice(start, stop)], dtype=np.int64)]


def _size(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    return [np.array(_x(node, inputs).size, dtype=np.int64)]


def _range(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    start, limit, delta = (_x(node, inputs, i).reshape(()) for i in range(3))
    if start.dtype.kind in "iu":
        count = max(-(-(int(limit) - int(start)) // int(delta)), 0)
    else:
        count = max(int(np.ceil((float(limit) - float(start)) / float(delta))), 0)
    # Accumulate like the ONNX definition (and ONNX Runtime) do: value += delta each step.
    steps = np.full(count, delta, dtype=start.dtype)
    if count:
        steps[0] = start
    return [np.cumsum(steps, dtype=start.dtype).astype(out_dtype(node), copy=False)]


def _one_hot(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    indices, depth_v, values = (_x(node, inputs, i) for i in range(3))
    depth = int(np.asarray(depth_v).reshape(-1)[0])
    rank = indices.ndim + 1
    axis = normalize_axis(int(node.attr("axis", -1)), rank)
    idx = indices.astype(np.int64)
    idx = np.where(idx < 0, idx + depth, idx)
    positions = np.arange(depth).reshape([depth if a == axis else 1 for a in range(rank)])
    hot = np.expand_dims(idx, axis) == positions
    off, on = values.reshape(-1)[0], values.reshape(-1)[1]
    return [np.where(hot, on, off).astype(values.dtype)]


def _eye_like(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    rows, cols = node.out_shapes[0]
    return [np.eye(rows, cols, k=int(node.attr("k", 0)), dtype=out_dtype(node))]


def _non_zero(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    x = _x(node, inputs)
    if x.ndim == 0:
        return [np.zeros((0, int(x != 0)), dtype=np.int64)]
    return [np.array(np.nonzero(x), dtype=np.int64).reshape(x.ndim, -1)]


def _compress(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    x, condition = _x(node, inputs), _x(node, inputs, 1).astype(bool).reshape(-1)
    axis = node.attr("axis")
    if axis is None:
        return [np.compress(condition, x.reshape(-1))]
    return [np.compress(condition, x, axis=normalize_axis(int(axis), x.ndim))]


register("Constant", _constant, since=1, dtypes=ALL, macs=no_macs)
register("ConstantOfShape", _constant_of_shape, since=9, dtypes=ALL)
register("Shape", _shape, since=1, dtypes=ALL, macs=no_macs)
register("Size", _size, since=1, dtypes=ALL, macs=no_macs)
register("Range", _range, since=11, dtypes=NUMERIC)
register("OneHot", _one_hot, since=9, dtypes=NUMERIC)
register("EyeLike", _eye_like, since=9, dtypes=ALL)
register("NonZero", _non_zero, since=9, dtypes=ALL)
register("Compress", _compress, since=9, dtypes=ALL)


# --- rearrangements and selections that run whole ----------------------------------------------


def _depth_to_space(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    x = _x(node, inputs)
    b = int(node.attr("blocksize"))
    n, c, h, w = x.shape
    if node.attr("mode", "DCR") == "CRD":
        y = x.reshape(n, c // (b * b), b, b, h, w).transpose(0, 1, 4, 2, 5, 3)
    else:
        y = x.reshape(n, b, b, c // (b * b), h, w).transpose(0, 3, 4, 1, 5, 2)
    return [np.ascontiguousarray(y).reshape(n, c // (b * b), h * b, w * b)]


def _space_to_depth(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    x = _x(node, inputs)
    b = int(node.attr("blocksize"))
    n, c, h, w = x.shape
    order = (0, 1, 3, 5, 2, 4) if node.attr("mode", "DCR") == "CRD" else (0, 3, 5, 1, 2, 4)
    y = x.reshape(n, c, h // b, b, w // b, b).transpose(order)
    return [np.ascontiguousarray(y).reshape(n, c * b * b, h // b, w // b)]


def _batch_split(node: NodeInfo) -> list[int]:
    return [0]


def _batch_boxes(node: NodeInfo, out_box: Box) -> list[Box | None]:
    return [replace_axis(full_box(node.in_shapes[0] or ()), 0, out_box[0])]


for _name, _fn in (("DepthToSpace", _depth_to_space), ("SpaceToDepth", _space_to_depth)):
    register(
        _name,
        _fn,
        since=1,
        dtypes=ALL,
        split_axes=_batch_split,
        input_boxes=_batch_boxes,
    )


def _descending_key(x: Array) -> Array:
    """A key whose ascending order is x's descending order, without overflow."""
    return np.invert(x) if x.dtype.kind in "iu" else np.negative(x)


def _top_k(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    """Largest or smallest k along an axis; ties keep the lower index first."""
    x = _x(node, inputs)
    k = int(np.asarray(_x(node, inputs, 1)).reshape(-1)[0])
    axis = normalize_axis(int(node.attr("axis", -1)), x.ndim)
    key = _descending_key(x) if int(node.attr("largest", 1)) else x
    order = np.argsort(key, axis=axis, kind="stable")
    indices = np.take(order, np.arange(k), axis=axis)
    return [np.take_along_axis(x, indices, axis=axis), indices.astype(np.int64)]


def _reverse_sequence(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    x, lengths = _x(node, inputs), _ints(_x(node, inputs, 1))
    batch_axis = int(node.attr("batch_axis", 1))
    time_axis = int(node.attr("time_axis", 0))
    out = x.copy()
    for b, length in enumerate(lengths):
        index: list[Any] = [slice(None)] * x.ndim
        index[batch_axis] = b
        index[time_axis] = slice(0, length)
        # With the batch axis indexed away, the time axis is axis 0 of the (rank-1) view.
        out[tuple(index)] = np.flip(x[tuple(index)], axis=time_axis - int(time_axis > batch_axis))
    return [out]


register("TopK", _top_k, since=10, dtypes=NUMERIC)
register("ReverseSequence", _reverse_sequence, since=10, dtypes=ALL)
