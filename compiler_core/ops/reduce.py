"""Reductions (Reduce*, ArgMax/ArgMin) and CumSum.

A reduction's output can be cut along any axis it keeps: each tile reads the same range of that
axis and the whole of every reduced axis, so the kernel just reduces whatever it is given.
The axes come from the `axes` attribute (before opset 13 for ReduceSum, 18 for the others) or
the optional second input; without them the op either reduces everything or, with
`noop_with_empty_axes`, passes its input through.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from compiler_core.ops._tiling import normalize_axis, replace_axis
from compiler_core.ops.elementwise import Array, out_dtype, widen
from compiler_core.ops.registry import (
    BOOL,
    FLOATS,
    NUMERIC,
    Box,
    NodeInfo,
    OpDef,
    TileCtx,
    full_box,
    register,
)

Reducer = Callable[[Array, tuple[int, ...], bool], Array]


def reduce_axes(node: NodeInfo, axes_input: Array | None) -> tuple[int, ...] | None:
    """The reduced input axes, sorted; None when the op passes its input through unchanged."""
    rank = len(node.in_shapes[0] or ())
    axes: Any = node.attrs.get("axes")
    if axes is None and axes_input is not None and axes_input.size > 0:
        axes = axes_input.reshape(-1).tolist()
    if axes is None or len(axes) == 0:
        if int(node.attr("noop_with_empty_axes", 0)):
            return None
        return tuple(range(rank))
    return tuple(sorted({normalize_axis(int(a), rank) for a in axes}))


def _static_axes(node: NodeInfo) -> tuple[bool, tuple[int, ...] | None]:
    """(known, axes) from attributes or the constant axes input, for tiling rules."""
    if "axes" not in node.attrs and node.has_input(1):
        if 1 not in node.consts:
            return False, None
        return True, reduce_axes(node, np.asarray(node.consts[1]))
    return True, reduce_axes(node, None)


def _kept_out_axes(node: NodeInfo, axes: tuple[int, ...]) -> list[tuple[int, int]]:
    """(output axis, input axis) for every axis the reduction keeps."""
    rank = len(node.in_shapes[0] or ())
    keepdims = bool(node.attr("keepdims", 1))
    pairs: list[tuple[int, int]] = []
    out_axis = 0
    for in_axis in range(rank):
        if in_axis in axes:
            out_axis += 1 if keepdims else 0
            continue
        pairs.append((out_axis, in_axis))
        out_axis += 1
    return pairs


def reduce_split_axes(node: NodeInfo) -> list[int]:
    known, axes = _static_axes(node)
    if not known:
        return []
    if axes is None:
        return list(range(len(node.out_shapes[0])))
    return [out_axis for out_axis, _ in _kept_out_axes(node, axes)]


def reduce_input_boxes(node: NodeInfo, out_box: Box) -> list[Box | None]:
    in_shape = node.in_shapes[0] or ()
    known, axes = _static_axes(node)
    rest: list[Box | None] = [None if s is None else full_box(s) for s in node.in_shapes[1:]]
    if not known:
        return [full_box(in_shape), *rest]
    if axes is None:
        return [out_box, *rest]
    box = full_box(in_shape)
    for out_axis, in_axis in _kept_out_axes(node, axes):
        box = replace_axis(box, in_axis, out_box[out_axis])
    return [box, *rest]


def _sum(x: Array, axes: tuple[int, ...], keep: bool) -> Array:
    return np.sum(x, axis=axes, keepdims=keep, dtype=x.dtype)


def _mean(x: Array, axes: tuple[int, ...], keep: bool) -> Array:
    count = int(np.prod([x.shape[a] for a in axes], dtype=np.int64))
    total = _sum(x, axes, keep)
    if x.dtype.kind in "iu":
        return np.trunc(total / max(count, 1)).astype(x.dtype)
    return total / count


def _extreme(reduce: np.ufunc, lowest: bool) -> Reducer:
    """Max or min; over an empty set they give their identity (ONNX: the lowest value for
    ReduceMax, the highest for ReduceMin: -inf/+inf, the integer limits, False/True)."""

    def run(x: Array, axes: tuple[int, ...], keep: bool) -> Array:
        if x.dtype == np.bool_:
            initial: object = not lowest
        elif x.dtype.kind == "f":
            initial = -np.inf if lowest else np.inf
        else:
            limits = np.iinfo(x.dtype)
            initial = limits.min if lowest else limits.max
        return reduce.reduce(x, axis=axes, keepdims=keep, initial=initial)

    return run


def _log_sum_exp(x: Array, axes: tuple[int, ...], keep: bool) -> Array:
    # The shift only keeps exp() in range; over an empty set the sum is 0 and the result -inf.
    peak = np.max(x, axis=axes, keepdims=True, initial=-np.inf)
    peak = np.where(np.isfinite(peak), peak, 0)
    total = np.sum(np.exp(x - peak), axis=axes, keepdims=True)
    result = np.log(total) + peak
    return result if keep else np.squeeze(result, axis=axes)


REDUCERS: dict[str, tuple[Reducer, int, frozenset[str]]] = {
    # op: (reducer, first opset with `axes` as an input, element types)
    "ReduceSum": (_sum, 13, NUMERIC),
    "ReduceMean": (_mean, 18, NUMERIC),
    "ReduceMax": (_extreme(np.maximum, lowest=True), 18, NUMERIC | BOOL),
    "ReduceMin": (_extreme(np.minimum, lowest=False), 18, NUMERIC | BOOL),
    "ReduceProd": (lambda x, a, k: np.prod(x, axis=a, keepdims=k, dtype=x.dtype), 18, NUMERIC),
    "ReduceL1": (lambda x, a, k: _sum(np.abs(x), a, k), 18, NUMERIC),
    "ReduceL2": (lambda x, a, k: np.sqrt(_sum(x * x, a, k)), 18, NUMERIC),
    "ReduceLogSum": (lambda x, a, k: np.log(_sum(x, a, k)), 18, FLOATS),
    "ReduceLogSumExp": (_log_sum_exp, 18, FLOATS),
    "ReduceSumSquare": (lambda x, a, k: _sum(x * x, a, k), 18, NUMERIC),
}


def _reduce_compute(reducer: Reducer) -> Callable[..., list[Array]]:
    def compute(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
        x = inputs[0]
        assert x is not None, f"{node.op_type} needs data"
        axes = reduce_axes(node, inputs[1] if len(inputs) > 1 else None)
        if axes is None:
            return [x.copy()]
        keep = bool(node.attr("keepdims", 1))
        with np.errstate(all="ignore"):
            result = reducer(widen(x), axes, keep)
        return [np.asarray(result).astype(out_dtype(node), copy=False)]

    return compute


for _name, (_reducer, _input_since, _dtypes) in REDUCERS.items():
    register(
        _name,
        _reduce_compute(_reducer),
        since=1,
        dtypes=_dtypes,
        split_axes=reduce_split_axes,
        input_boxes=reduce_input_boxes,
        macs=lambda node: int(np.prod(node.in_shapes[0] or (), dtype=np.int64)),
        doc=f"`axes` is an attribute before opset {_input_since} and an input from it on.",
    )


# --- ArgMax / ArgMin ----------------------------------------------------------------------------


def _arg_axis(node: NodeInfo) -> int:
    return normalize_axis(int(node.attr("axis", 0)), len(node.in_shapes[0] or ()))


def _arg_split_axes(node: NodeInfo) -> list[int]:
    return [out_axis for out_axis, _ in _kept_out_axes(node, (_arg_axis(node),))]


def _arg_input_boxes(node: NodeInfo, out_box: Box) -> list[Box | None]:
    box = full_box(node.in_shapes[0] or ())
    for out_axis, in_axis in _kept_out_axes(node, (_arg_axis(node),)):
        box = replace_axis(box, in_axis, out_box[out_axis])
    return [box]


def _arg_compute(pick: Callable[..., Array]) -> Callable[..., list[Array]]:
    def compute(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
        x = inputs[0]
        assert x is not None, f"{node.op_type} needs data"
        axis = _arg_axis(node)
        if int(node.attr("select_last_index", 0)):
            index = x.shape[axis] - 1 - pick(np.flip(x, axis=axis), axis=axis)
        else:
            index = pick(x, axis=axis)
        if int(node.attr("keepdims", 1)):
            index = np.expand_dims(index, axis)
        return [np.asarray(index).astype(np.int64)]

    return compute


def _register_arg(op_type: str, pick: Callable[..., Array]) -> OpDef:
    return register(
        op_type,
        _arg_compute(pick),
        since=1,
        dtypes=NUMERIC,
        split_axes=_arg_split_axes,
        input_boxes=_arg_input_boxes,
        macs=lambda node: int(np.prod(node.in_shapes[0] or (), dtype=np.int64)),
    )


_register_arg("ArgMax", np.argmax)
_register_arg("ArgMin", np.argmin)


# --- CumSum -------------------------------------------------------------------------------------


def _cumsum_axis(node: NodeInfo, axis_input: Array | None) -> int | None:
    if axis_input is None:
        return None
    return normalize_axis(int(np.asarray(axis_input).reshape(-1)[0]), len(node.out_shapes[0]))


def _cumsum_split_axes(node: NodeInfo) -> list[int]:
    axis = _cumsum_axis(node, node.consts.get(1))
    if axis is None:
        return []
    return [a for a in range(len(node.out_shapes[0])) if a != axis]


def _cumsum_input_boxes(node: NodeInfo, out_box: Box) -> list[Box | None]:
    axis = _cumsum_axis(node, node.consts.get(1))
    if axis is None:
        return [None if s is None else full_box(s) for s in node.in_shapes]
    box = replace_axis(out_box, axis, (0, node.out_shapes[0][axis]))
    return [box, full_box(node.in_shapes[1] or ())]


def _cumsum(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    x = inputs[0]
    assert x is not None, "CumSum needs data"
    axis = _cumsum_axis(node, inputs[1])
    assert axis is not None, "CumSum needs an axis"
    work = widen(x)
    if int(node.attr("reverse", 0)):
        work = np.flip(work, axis=axis)
    product = node.op_type == "CumProd"
    accumulate = np.cumprod if product else np.cumsum
    total = accumulate(work, axis=axis, dtype=work.dtype)
    if int(node.attr("exclusive", 0)):
        first = np.take(total, [0], axis=axis)
        identity = np.ones_like(first) if product else np.zeros_like(first)
        total = np.concatenate(
            [identity, np.delete(total, -1, axis=axis)],
            axis=axis,
        )
    if int(node.attr("reverse", 0)):
        total = np.flip(total, axis=axis)
    return [np.ascontiguousarray(total).astype(out_dtype(node), copy=False)]


for _name, _since in (("CumSum", 11), ("CumProd", 26)):
    register(
        _name,
        _cumsum,
        since=_since,
        dtypes=NUMERIC,
        split_axes=_cumsum_split_axes,
        input_boxes=_cumsum_input_boxes,
    )
