"""Elementwise ops: unary math, broadcasting binary and variadic arithmetic, logic, Where, Cast.

Every op here maps output element i to element i of each broadcast input, so a tile needs only
the broadcast image of its output box (`broadcast_boxes`) and the kernels ignore the tile.
Results are cast to the node's output dtype, which keeps integer wrap-around and float16
rounding the same as ONNX Runtime (float16 math runs in float32, then rounds once).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import reduce
from typing import Any

import numpy as np

from compiler_core.errors import CompileError
from compiler_core.ops._tiling import broadcast_boxes, elementwise_split
from compiler_core.ops.registry import (
    ALL,
    BOOL,
    FLOATS,
    INTS,
    NUMERIC,
    SIGNED,
    Box,
    NodeInfo,
    OpDef,
    TileCtx,
    full_box,
    register,
)

Array = np.ndarray
UnaryFn = Callable[[Array], Array]
BinaryFn = Callable[[Array, Array], Array]


def out_dtype(node: NodeInfo, index: int = 0) -> np.dtype[Any]:
    return np.dtype(node.out_dtypes[index])


def widen(x: Array) -> Array:
    """float16 math runs in float32 (as ONNX Runtime does); other types stay as they are."""
    return x.astype(np.float32) if x.dtype == np.float16 else x


def register_elementwise(op_type: str, compute: Callable[..., list[Array]], **kwargs: Any) -> OpDef:
    """Register an op whose inputs all broadcast to its output and that may be fused."""
    kwargs.setdefault("split_axes", elementwise_split)
    kwargs.setdefault("input_boxes", broadcast_boxes)
    kwargs.setdefault("elementwise", True)
    return register(op_type, compute, **kwargs)


def register_unary(
    op_type: str, fn: UnaryFn, *, since: int, dtypes: frozenset[str] = FLOATS, **kwargs: Any
) -> OpDef:
    """One line per unary op: `fn` maps the (float16-widened) input to the output."""

    def compute(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
        x = _required(node, inputs, 0)
        with np.errstate(all="ignore"):
            return [np.asarray(fn(widen(x))).astype(out_dtype(node), copy=False)]

    return register_elementwise(op_type, compute, since=since, dtypes=dtypes, **kwargs)


def register_binary(
    op_type: str, fn: BinaryFn, *, since: int, dtypes: frozenset[str] = NUMERIC, **kwargs: Any
) -> OpDef:
    """One line per broadcasting binary op; the output dtype comes from the node."""

    def compute(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
        a, b = _required(node, inputs, 0), _required(node, inputs, 1)
        with np.errstate(all="ignore"):
            return [np.asarray(fn(widen(a), widen(b))).astype(out_dtype(node), copy=False)]

    return register_elementwise(op_type, compute, since=since, dtypes=dtypes, **kwargs)


def register_variadic(
    op_type: str, fn: BinaryFn, *, since: int, mean: bool = False, **kwargs: Any
) -> OpDef:
    """Max, Min, Sum, Mean: a left fold of `fn` over any number of broadcast inputs."""

    def compute(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
        args = [widen(x) for x in inputs if x is not None]
        with np.errstate(all="ignore"):
            result = np.asarray(reduce(fn, args))
            if mean:
                result = result / len(args)
        return [np.broadcast_to(result, _tile_shape(tile)).astype(out_dtype(node))]

    kwargs.setdefault("dtypes", NUMERIC)
    return register_elementwise(op_type, compute, since=since, **kwargs)


def _tile_shape(tile: TileCtx) -> tuple[int, ...]:
    return tuple(stop - start for start, stop in tile.out_box)


def _required(node: NodeInfo, inputs: list[Array | None], index: int) -> Array:
    x = inputs[index] if index < len(inputs) else None
    if x is None:
        raise CompileError(
            "missing_input", f"{node.op_type} needs input {index}", node=node.name or None
        )
    return x


# --- arithmetic with ONNX integer semantics ---------------------------------------------------


def int_div(a: Array, b: Array) -> Array:
    """Integer division truncating toward zero (C semantics), not numpy's floor division."""
    if a.dtype.kind in "fc":
        return np.divide(a, b)
    if a.dtype.kind == "u":
        return np.floor_divide(a, b)
    quotient = np.floor_divide(a, b)
    inexact = (np.remainder(a, b) != 0) & ((a < 0) != (b < 0))
    return quotient + inexact.astype(quotient.dtype)


def _pow(a: Array, b: Array) -> Array:
    if a.dtype.kind == "f":
        return np.power(a, b.astype(a.dtype))
    if b.dtype.kind == "f" or (b.dtype.kind == "i" and b.size and b.min() < 0):
        # Through double like C's pow: an integer to a negative power truncates toward zero.
        return np.trunc(np.power(a.astype(np.float64), b.astype(np.float64)))
    return np.power(a.astype(np.int64), b.astype(np.int64))


def _mod(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    a, b = _required(node, inputs, 0), _required(node, inputs, 1)
    fmod = int(node.attr("fmod", 0))
    with np.errstate(all="ignore"):
        if fmod:
            result = np.fmod(widen(a), widen(b))
        elif a.dtype.kind == "f":
            result = np.mod(widen(a), widen(b))  # the sign of the divisor, as Python's %
        else:
            result = np.mod(a, b)
    return [np.asarray(result).astype(out_dtype(node), copy=False)]


def erf(x: Array) -> Array:
    """The error function. float32 and below use the odd rational approximation ONNX Runtime
    uses (Eigen's, accurate to ~1e-7 relative); float64 uses the exact libm value."""
    if x.dtype == np.float64:
        return np.frompyfunc(math.erf, 1, 1)(x).astype(np.float64)
    flat = x.reshape(-1)
    if flat.size <= _ERF_CHUNK:
        return _erf_rational(flat).reshape(x.shape)
    out = np.empty(flat.shape, x.dtype)
    for start in range(0, flat.size, _ERF_CHUNK):
        out[start : start + _ERF_CHUNK] = _erf_rational(flat[start : start + _ERF_CHUNK])
    return out.reshape(x.shape)


_ERF_CHUNK = 16384
"""Elements per pass of the rational erf: its float64 temporaries stay in cache."""


def _erf_rational(x: Array) -> Array:
    t = np.clip(x, -4.0, 4.0, out=np.empty(x.shape, np.float64))
    t2 = t * t
    num = t2 * -2.72614225801306e-10  # Horner's rule, in place: the same operations
    for c in (
        2.77068142495902e-08,
        -2.10102402082508e-06,
        -5.69250639462346e-05,
        -7.34990630326855e-04,
        -2.95459980854025e-03,
    ):
        num += c
        num *= t2
    num += -1.60960333262415e-02
    den = t2 * -1.45660718464996e-05
    for c in (-2.13374055278905e-04, -1.68282697438203e-03):
        den += c
        den *= t2
    den += -7.37332916720468e-03
    den *= t2
    den -= 1.42647390514189e-02
    num *= t
    num /= den
    return num.astype(x.dtype)


def _sign(x: Array) -> Array:
    return np.sign(x) if x.dtype.kind != "u" else (x != 0).astype(x.dtype)


# --- logic, selection, casting ----------------------------------------------------------------


def _where(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    cond, x, y = (_required(node, inputs, i) for i in range(3))
    return [np.where(cond.astype(bool), x, y).astype(out_dtype(node), copy=False)]


def _cast(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    """Cast through numpy: floats truncate toward zero into integers, non-zero is True."""
    x = _required(node, inputs, 0)
    target = out_dtype(node)
    if x.dtype.kind == "f" and target.kind in "iu":
        with np.errstate(invalid="ignore"):
            return [np.trunc(x).astype(target)]
    return [x.astype(target)]


def _is_nan(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    return [np.isnan(_required(node, inputs, 0))]


def _is_inf(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    x = _required(node, inputs, 0)
    negative = bool(node.attr("detect_negative", 1))
    positive = bool(node.attr("detect_positive", 1))
    return [(np.isneginf(x) & negative) | (np.isposinf(x) & positive)]


def _bit_shift(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    a, b = _required(node, inputs, 0), _required(node, inputs, 1)
    bits = a.dtype.itemsize * 8
    # Shifting by the type width or more is undefined in C; ONNX Runtime yields 0.
    too_far = b >= bits
    safe = np.where(too_far, 0, b).astype(a.dtype)
    if node.attr("direction") == "LEFT":
        shifted = np.left_shift(a, safe)
    elif node.attr("direction") == "RIGHT" and a.dtype.kind == "i":
        # Arithmetic shift: by the width or more, only the sign is left (0 or -1).
        return [np.right_shift(a, np.minimum(b, bits - 1).astype(a.dtype)).astype(out_dtype(node))]
    elif node.attr("direction") == "RIGHT":
        shifted = np.right_shift(a, safe)
    else:
        raise CompileError(
            "invalid_attribute",
            f"BitShift direction must be LEFT or RIGHT, got {node.attr('direction')!r}",
            node=node.name or None,
        )
    return [np.where(too_far, 0, shifted).astype(out_dtype(node))]


def _first_input_box(node: NodeInfo, out_box: Box) -> list[Box | None]:
    """Input 0 maps one to one; the rest (CastLike's type donor) are given whole."""
    return [out_box] + [None if s is None else full_box(s) for s in node.in_shapes[1:]]


# --- registrations ----------------------------------------------------------------------------

SIGNED_NUMERIC = FLOATS | SIGNED

register_binary("Add", np.add, since=7)
register_binary("Sub", np.subtract, since=7)
register_binary("Mul", np.multiply, since=7)
register_binary("Div", int_div, since=7)
register_binary("Pow", _pow, since=7, dtypes=FLOATS | frozenset({"int32", "int64"}))
register_elementwise("Mod", _mod, since=10, dtypes=NUMERIC)
register_variadic("Max", np.maximum, since=8)
register_variadic("Min", np.minimum, since=8)
register_variadic("Sum", np.add, since=8, dtypes=FLOATS)
register_variadic("Mean", np.add, since=8, mean=True, dtypes=FLOATS)

register_unary("Neg", np.negative, since=6, dtypes=SIGNED_NUMERIC)
register_unary("Abs", np.abs, since=6, dtypes=NUMERIC)
register_unary("Sqrt", np.sqrt, since=6)
register_unary("Reciprocal", np.reciprocal, since=6)
register_unary("Exp", np.exp, since=6)
register_unary("Log", np.log, since=6)
register_unary("Erf", erf, since=9)
register_unary("Floor", np.floor, since=6)
register_unary("Ceil", np.ceil, since=6)
register_unary("Round", np.round, since=11)
register_unary("Sign", _sign, since=9, dtypes=NUMERIC)
register_unary("Sin", np.sin, since=7)
register_unary("Cos", np.cos, since=7)
register_unary("Tan", np.tan, since=7)
register_unary("Asin", np.arcsin, since=7)
register_unary("Acos", np.arccos, since=7)
register_unary("Atan", np.arctan, since=7)
register_unary("Sinh", np.sinh, since=9)
register_unary("Cosh", np.cosh, since=9)
register_unary("Asinh", np.arcsinh, since=9)
register_unary("Acosh", np.arccosh, since=9)
register_unary("Atanh", np.arctanh, since=9)

register_unary("Not", np.logical_not, since=1, dtypes=BOOL)
register_binary("And", np.logical_and, since=7, dtypes=BOOL)
register_binary("Or", np.logical_or, since=7, dtypes=BOOL)
register_binary("Xor", np.logical_xor, since=7, dtypes=BOOL)
register_binary("Equal", np.equal, since=7, dtypes=ALL)
register_binary("Less", np.less, since=7)
register_binary("LessOrEqual", np.less_equal, since=12)
register_binary("Greater", np.greater, since=7)
register_binary("GreaterOrEqual", np.greater_equal, since=12)
register_elementwise("Where", _where, since=9, dtypes=ALL)

register_elementwise("Cast", _cast, since=6, dtypes=ALL)
register_elementwise("CastLike", _cast, since=15, dtypes=ALL, input_boxes=_first_input_box)
register_elementwise("IsNaN", _is_nan, since=9)
register_elementwise("IsInf", _is_inf, since=10)
register_elementwise("BitShift", _bit_shift, since=11, dtypes=INTS)
register_binary("BitwiseAnd", np.bitwise_and, since=18, dtypes=INTS)
register_binary("BitwiseOr", np.bitwise_or, since=18, dtypes=INTS)
register_binary("BitwiseXor", np.bitwise_xor, since=18, dtypes=INTS)
register_unary("BitwiseNot", np.invert, since=18, dtypes=INTS)
