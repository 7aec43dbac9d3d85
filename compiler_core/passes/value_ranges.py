"""Interval bounds of a graph's float values, from what is known without running it.

Known: constants, integer graph inputs of 16 bits or less, and ops whose result is bounded
whatever their input (Sigmoid, Tanh, Softmax, Erf, LayerNormalization...). Carried through
arithmetic (Add, Mul, Div by what cannot be 0, Relu, Clip...), data movement and pooling
(within their input's range) and products: a MatMul/Gemm/Conv with constant weights is
bounded by its input's magnitude times its largest sum of absolute weights over one output;
a MatMul of Softmax rows by the magnitude of its other operand; a MatMul of two activations
whose vector norms are known (`VectorNorm`: after a LayerNormalization and constant
projections) by the product of the norms (Cauchy-Schwarz). A float graph input, and
whatever only it determines, is unknown (None). The checked ops (`ACCUMULATING`) report their
bound.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from compiler_core.passes.base import const_array, static_dims
from compiler_core.tensors import release_mapping

Interval = tuple[float, float]
LINEAR_MOVES = frozenset({"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Identity"})
"""Ops that move values without changing them (and commute with a scale)."""


_TYPE_RANGES: dict[ir.DataType, Interval] = {
    ir.DataType.BOOL: (0.0, 1.0),
    ir.DataType.INT8: (-128.0, 127.0),
    ir.DataType.UINT8: (0.0, 255.0),
    ir.DataType.INT16: (-32768.0, 32767.0),
    ir.DataType.UINT16: (0.0, 65535.0),
}
"""Integer types narrow enough for their range to bound what a Cast to float holds."""
_FLOATS = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.DOUBLE})
_BOUNDED: dict[str, Interval] = {
    "Sigmoid": (0.0, 1.0),
    "HardSigmoid": (0.0, 1.0),
    "Softmax": (0.0, 1.0),
    "Tanh": (-1.0, 1.0),
    "Erf": (-1.0, 1.0),
    "Sin": (-1.0, 1.0),
    "Cos": (-1.0, 1.0),
    "Softsign": (-1.0, 1.0),
}
"""Ops whose result is bounded whatever their input."""
_SAME = frozenset(
    {
        *LINEAR_MOVES,
        "Expand",
        "Slice",
        "Gather",
        "GatherElements",
        "GatherND",
        "Tile",
        "Split",
        "MaxPool",
        "AveragePool",
        "GlobalAveragePool",
        "GlobalMaxPool",
        "ReduceMean",
        "ReduceMax",
        "ReduceMin",
        "DepthToSpace",
        "SpaceToDepth",
        "Dropout",
    }
)
"""Ops whose float results lie within their first input's range."""
_UNION = frozenset({"Concat", "Max", "Min", "Where", "Sum", "Mean"})
"""Ops whose result lies within the union of their float inputs' ranges (Sum adds them)."""
ACCUMULATING = frozenset({"MatMul", "Gemm", "Conv", "ConvTranspose", "ReduceSum"})
"""Ops whose result can outgrow every operand: the ones checked."""


@dataclass(frozen=True)
class VectorNorm:
    """Every vector of a value along `axis` (counted from the end) has an L2 norm of at most
    `bound`. With `squares` (the last axis only): the vectors are y @ W + `bias` with
    |y| <= `source`, so a slice S of one has a norm of at most
    source * sqrt(sum(squares[S])) + |bias[S]| (`squares`: W's squared column norms, so that
    sqrt(sum) is the Frobenius norm of W[:, S], at least its spectral norm)."""

    axis: int
    bound: float
    source: float = 0.0
    squares: np.ndarray | None = None
    bias: np.ndarray | None = None


class ValueRanges:
    """Interval bounds of float values, None where nothing is known."""

    def __init__(self) -> None:
        self.known: dict[int, Interval | None] = {}
        self.abs_sums: dict[tuple[int, str], float] = {}
        self.norms: dict[int, VectorNorm] = {}
        self.squares: dict[int, np.ndarray] = {}
        """Vector norm bounds: what bounds a product of two activations (attention scores
        |q . k| <= |q| |k|) far tighter than elementwise intervals."""

    def of(self, value: ir.Value | None) -> Interval | None:
        if value is None:
            return None
        key = id(value)
        if key not in self.known:
            self.known[key] = self._leaf(value)
        return self.known[key]

    def _leaf(self, value: ir.Value) -> Interval | None:
        if value.const_value is not None:
            return _const_interval(value)
        if value.is_graph_input() and value.dtype in _TYPE_RANGES:
            return _TYPE_RANGES[value.dtype]
        return None

    def visit(self, node: ir.Node) -> float | None:
        """Set the intervals of `node`'s results; for a checked op, return its result bound."""
        if node.domain not in ("", "ai.onnx"):
            return None
        handler = _HANDLERS.get(node.op_type)
        found: Interval | None = None
        if node.op_type in _BOUNDED:
            found = _BOUNDED[node.op_type]
        elif node.op_type in _SAME:
            found = self.of(node.inputs[0]) if node.inputs else None
        elif node.op_type in _UNION:
            found = self._union(node)
        elif handler is not None:
            found = handler(self, node)
        norm = _NORM_RULES[node.op_type](self, node) if node.op_type in _NORM_RULES else None
        if norm is not None and node.outputs:
            self.norms[id(node.outputs[0])] = norm
        if node.op_type == "MatMul":
            found = _narrower(found, self._cauchy_schwarz(node))
        for out in node.outputs:
            if out.dtype in _FLOATS:
                self.known[id(out)] = found
            elif out.dtype in _TYPE_RANGES and node.op_type in _SAME:
                self.known[id(out)] = found
        if node.op_type in ACCUMULATING and found is not None:
            return _magnitude(found)
        return None

    def _cauchy_schwarz(self, node: ir.Node) -> float | None:
        """|A row . B column| <= |A row| |B column| when both norms are known."""
        a, b = node.inputs[0], node.inputs[1]
        if a is None or b is None:
            return None
        a_norm, b_norm = self.norms.get(id(a)), self.norms.get(id(b))
        if a_norm is None or b_norm is None or a_norm.axis != -1 or b_norm.axis != -2:
            return None
        return a_norm.bound * b_norm.bound

    def _union(self, node: ir.Node) -> Interval | None:
        floats = [v for v in node.inputs if v is not None and v.dtype in _FLOATS]
        if node.op_type == "Where":
            floats = [v for v in node.inputs[1:] if v is not None]
        parts = [self.of(v) for v in floats]
        if not parts or any(p is None for p in parts):
            return None
        known = [p for p in parts if p is not None]
        if node.op_type == "Sum":
            return (sum(p[0] for p in known), sum(p[1] for p in known))
        return (min(p[0] for p in known), max(p[1] for p in known))

    def abs_sum(self, value: ir.Value, axis: int | tuple[int, ...], key: str) -> float | None:
        """The largest sum of |value| over `axis` (a constant's worst-case row or column)."""
        cache = (id(value), key)
        if cache not in self.abs_sums:
            tensor = value.const_value
            array = const_array(value)
            if array is None or array.dtype.kind != "f" or array.ndim == 0:
                return None
            sums = np.abs(array).sum(axis=axis)  # in the array's type: 4x faster than float64
            # a sum of n terms rounds by at most (n - 1) units of 2^-24 of it (float32)
            slack = 1.0 + (array.size // max(sums.size, 1)) * float(np.finfo(array.dtype).eps)
            self.abs_sums[cache] = float(sums.max()) * slack if sums.size else 0.0
            if array.ndim == 2 and key == "columns":  # read once for the norm rule too
                self.squares[id(value)] = _column_squares(array)
            del array, sums
            release_mapping(tensor)
        return self.abs_sums[cache]

    def column_squares(self, value: ir.Value) -> np.ndarray | None:
        """The squared L2 norm of each column of a 2-D constant (rounded up)."""
        if id(value) not in self.squares:
            tensor = value.const_value
            array = const_array(value)
            if array is None or array.ndim != 2 or array.dtype.kind != "f":
                return None
            self.squares[id(value)] = _column_squares(array)
            del array
            release_mapping(tensor)
        return self.squares[id(value)]


def _const_interval(value: ir.Value) -> Interval | None:
    tensor = value.const_value
    array = const_array(value)
    if array is None or array.size == 0 or array.dtype.kind not in "fiub":
        return None
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        return None
    found = (float(array.min()), float(array.max()))
    del array
    release_mapping(tensor)
    return found


def _magnitude(interval: Interval) -> float:
    return max(abs(interval[0]), abs(interval[1]))


def _symmetric(bound: float) -> Interval:
    return (-bound, bound)


def _add(a: Interval, b: Interval) -> Interval:
    return (a[0] + b[0], a[1] + b[1])


def _mul(a: Interval, b: Interval) -> Interval:
    products = [x * y for x in a for y in b]
    return (min(products), max(products))


def _binary(ranges: ValueRanges, node: ir.Node) -> Interval | None:
    if len(node.inputs) != 2:
        return None
    a, b = ranges.of(node.inputs[0]), ranges.of(node.inputs[1])
    if a is None or b is None:
        return None
    op = node.op_type
    if op == "Add":
        return _add(a, b)
    if op == "Sub":
        return (a[0] - b[1], a[1] - b[0])
    if op == "Mul":
        return _mul(a, b)
    if b[0] <= 0.0 <= b[1]:  # Div by something that may be 0
        return None
    return _mul(a, (1.0 / b[1], 1.0 / b[0]))


def _unary(ranges: ValueRanges, node: ir.Node) -> Interval | None:
    x = ranges.of(node.inputs[0]) if node.inputs else None
    if x is None:
        return None
    lo, hi = x
    op = node.op_type
    if op == "Relu":
        return (max(lo, 0.0), max(hi, 0.0))
    if op == "Neg":
        return (-hi, -lo)
    if op == "Abs":
        return (0.0 if lo <= 0.0 <= hi else min(abs(lo), abs(hi)), _magnitude(x))
    if op == "LeakyRelu":
        alpha = node.attributes.get("alpha")
        a = alpha.as_float() if alpha is not None else 0.01
        return (min(lo, a * lo, 0.0), max(hi, a * hi, 0.0))
    if op == "Gelu":
        return (min(lo, -0.17), max(hi, 0.0))
    if op == "Exp":
        return (math.exp(min(lo, 709.0)), math.exp(min(hi, 709.0)))
    if op == "Sqrt" and lo >= 0.0:
        return (math.sqrt(lo), math.sqrt(hi))
    return None


def _cast(ranges: ValueRanges, node: ir.Node) -> Interval | None:
    source = node.inputs[0] if node.inputs else None
    if source is None:
        return None
    if source.dtype in _TYPE_RANGES:
        return ranges.of(source) or _TYPE_RANGES[source.dtype]
    return ranges.of(source) if source.dtype in _FLOATS else None


def _clip(ranges: ValueRanges, node: ir.Node) -> Interval | None:
    x = ranges.of(node.inputs[0]) if node.inputs else None
    lo, hi = -math.inf, math.inf
    if "min" in node.attributes:
        lo = node.attributes["min"].as_float()
    if "max" in node.attributes:
        hi = node.attributes["max"].as_float()
    for index, pick in ((1, max), (2, min)):
        bound = const_array(node.inputs[index]) if len(node.inputs) > index else None
        if bound is not None and bound.size == 1:
            if index == 1:
                lo = pick(lo, float(bound.reshape(())))
            else:
                hi = pick(hi, float(bound.reshape(())))
    if x is not None:
        lo, hi = max(lo, x[0]), min(hi, x[1])
    if math.isinf(lo) or math.isinf(hi):
        return None
    return (lo, hi)


def _pad(ranges: ValueRanges, node: ir.Node) -> Interval | None:
    x = ranges.of(node.inputs[0]) if node.inputs else None
    if x is None:
        return None
    fill = 0.0
    constant = const_array(node.inputs[2]) if len(node.inputs) > 2 else None
    if constant is not None and constant.size == 1:
        fill = float(constant.reshape(()))
    elif "value" in node.attributes:
        fill = node.attributes["value"].as_float()
    mode = node.attributes.get("mode")
    if mode is not None and mode.as_string() != "constant":
        return x
    return (min(x[0], fill), max(x[1], fill))


def _layer_norm(ranges: ValueRanges, node: ir.Node) -> Interval | None:
    """|normalized| <= sqrt(N - 1) over N elements (Samuelson), then scale and bias."""
    dims = static_dims(node.inputs[0])
    gamma = ranges.of(node.inputs[1]) if len(node.inputs) > 1 else None
    if dims is None or gamma is None:
        return None
    attr = node.attributes.get("axis")
    axis = attr.as_int() if attr is not None else -1
    count = math.prod(dims[axis % len(dims) :])
    beta = ranges.of(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] else (0.0, 0.0)
    if beta is None:
        return None
    return _add(_mul(_symmetric(math.sqrt(max(count - 1, 1))), gamma), beta)


def _matmul(ranges: ValueRanges, node: ir.Node) -> Interval | None:
    a_value, b_value = node.inputs[0], node.inputs[1]
    if a_value is None or b_value is None:
        return None
    if _rows_sum_to_one(a_value.producer()):
        b = ranges.of(b_value)  # each result a weighted mean of B's values
        return None if b is None else _symmetric(_magnitude(b))
    if b_value.const_value is not None:  # |A row| . |B column|, the largest column
        a = ranges.of(a_value)
        axis = -2 if len(b_value.shape or ()) > 1 else 0
        column = ranges.abs_sum(b_value, axis, "columns")
        return None if a is None or column is None else _symmetric(_magnitude(a) * column)
    if a_value.const_value is not None:
        b = ranges.of(b_value)
        row = ranges.abs_sum(a_value, -1, "rows")
        return None if b is None or row is None else _symmetric(_magnitude(b) * row)
    a, b = ranges.of(a_value), ranges.of(b_value)
    dims = static_dims(a_value)
    if a is None or b is None or dims is None:
        return None
    bound = dims[-1] * _magnitude(a) * _magnitude(b)
    return (0.0, bound) if a[0] >= 0 and b[0] >= 0 else _symmetric(bound)


def _rows_sum_to_one(producer: ir.Node | None) -> bool:
    """A Softmax over the last axis (opset 13+, or a 2-D input): each row a weighting."""
    if producer is None or producer.op_type != "Softmax" or not producer.inputs:
        return False
    dims = static_dims(producer.inputs[0])
    attr = producer.attributes.get("axis")
    axis = attr.as_int() if attr is not None else -1
    return dims is not None and axis % len(dims) == len(dims) - 1


def _gemm(ranges: ValueRanges, node: ir.Node) -> Interval | None:
    a, b_value = ranges.of(node.inputs[0]), node.inputs[1]
    if a is None or b_value is None:
        return None
    trans_a = node.attributes.get("transA")
    trans_b = node.attributes.get("transB")
    alpha = node.attributes.get("alpha")
    beta = node.attributes.get("beta")
    if b_value.const_value is not None:
        axis = 1 if trans_b is not None and trans_b.as_int() else 0
        column = ranges.abs_sum(b_value, axis, f"gemm{axis}")
        if column is None:
            return None
        bound = _magnitude(a) * column
    else:
        b = ranges.of(b_value)
        dims = static_dims(node.inputs[0])
        if b is None or dims is None:
            return None
        k = dims[0] if trans_a is not None and trans_a.as_int() else dims[1]
        bound = k * _magnitude(a) * _magnitude(b)
    bound *= abs(alpha.as_float()) if alpha is not None else 1.0
    if len(node.inputs) > 2 and node.inputs[2] is not None:
        c = ranges.of(node.inputs[2])
        if c is None:
            return None
        bound += (abs(beta.as_float()) if beta is not None else 1.0) * _magnitude(c)
    return _symmetric(bound)


def _conv(ranges: ValueRanges, node: ir.Node) -> Interval | None:
    """Per output channel, the sum of |w| over what it reads times the input's magnitude,
    plus the bias. Conv weights are [M, C/g, k...]: output channel m reads all of w[m].
    ConvTranspose weights are [C, M/g, k...]: an output gathers at most every tap of every
    input channel, w[:, m]."""
    x, w = ranges.of(node.inputs[0]), node.inputs[1]
    if x is None or w is None:
        return None
    transposed = node.op_type == "ConvTranspose"
    if w.const_value is not None:
        dims = static_dims(w)
        if dims is None or len(dims) < 2:
            return None
        reduce = (0, *range(2, len(dims))) if transposed else tuple(range(1, len(dims)))
        taps = ranges.abs_sum(w, reduce, "transposed" if transposed else "conv")
        if taps is None:
            return None
        bound = _magnitude(x) * taps
    else:
        weights, dims = ranges.of(w), static_dims(w)
        if weights is None or dims is None:
            return None
        count = math.prod(dims[1:]) * (dims[0] if transposed else 1)
        bound = count * _magnitude(x) * _magnitude(weights)
    if len(node.inputs) > 2 and node.inputs[2] is not None:
        bias = ranges.of(node.inputs[2])
        if bias is None:
            return None
        bound += _magnitude(bias)
    return _symmetric(bound)


def _reduce_sum(ranges: ValueRanges, node: ir.Node) -> Interval | None:
    x = ranges.of(node.inputs[0]) if node.inputs else None
    dims = static_dims(node.inputs[0]) if node.inputs else None
    out = static_dims(node.outputs[0])
    if x is None or dims is None or out is None:
        return None
    count = max(math.prod(dims) // max(math.prod(out), 1), 1)
    return (count * x[0], count * x[1])


def _batch_norm(ranges: ValueRanges, node: ir.Node) -> Interval | None:
    if len(node.inputs) < 5:
        return None
    x = ranges.of(node.inputs[0])
    params = [const_array(v) for v in node.inputs[1:5]]
    if x is None or any(p is None for p in params):
        return None
    gamma, beta, mean, var = (np.asarray(p, np.float64) for p in params)
    eps = node.attributes.get("epsilon")
    scale = gamma / np.sqrt(var + (eps.as_float() if eps is not None else 1e-5))
    shift = beta - mean * scale
    return _symmetric(_magnitude(x) * float(np.abs(scale).max()) + float(np.abs(shift).max()))


_HANDLERS: dict[str, Callable[[ValueRanges, ir.Node], Interval | None]] = {
    "Add": _binary,
    "Sub": _binary,
    "Mul": _binary,
    "Div": _binary,
    "Relu": _unary,
    "Neg": _unary,
    "Abs": _unary,
    "LeakyRelu": _unary,
    "Gelu": _unary,
    "Exp": _unary,
    "Sqrt": _unary,
    "Cast": _cast,
    "Clip": _clip,
    "Pad": _pad,
    "LayerNormalization": _layer_norm,
    "MatMul": _matmul,
    "Gemm": _gemm,
    "Conv": _conv,
    "ConvTranspose": _conv,
    "ReduceSum": _reduce_sum,
    "BatchNormalization": _batch_norm,
}


def _narrower(found: Interval | None, bound: float | None) -> Interval | None:
    if bound is None:
        return found
    if found is None:
        return _symmetric(bound)
    return (max(found[0], -bound), min(found[1], bound))


def _norm_layer_norm(ranges: ValueRanges, node: ir.Node) -> VectorNorm | None:
    """The normalized vector n has sum(n^2) = N var / (var + eps) <= N; then scale and bias."""
    dims = static_dims(node.inputs[0])
    gamma = const_array(node.inputs[1]) if len(node.inputs) > 1 else None
    if dims is None or gamma is None or not dims:
        return None
    attr = node.attributes.get("axis")
    if (attr.as_int() if attr is not None else -1) % len(dims) != len(dims) - 1:
        return None
    beta = const_array(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] else None
    if len(node.inputs) > 2 and node.inputs[2] is not None and beta is None:
        return None
    shift = float(np.linalg.norm(np.broadcast_to(beta, (dims[-1],)))) if beta is not None else 0.0
    scale = float(np.abs(gamma).max()) if gamma.size else 0.0
    return VectorNorm(-1, scale * math.sqrt(dims[-1]) + shift)


def _norm_matmul(ranges: ValueRanges, node: ir.Node) -> VectorNorm | None:
    """y @ W (W constant, 2-D): |slice S of y W| <= |y| |W[:, S]|_F."""
    y, w = ranges.norms.get(id(node.inputs[0])), node.inputs[1]
    if y is None or y.axis != -1 or w is None or w.const_value is None:
        return None
    squares = ranges.column_squares(w)
    if squares is None:
        return None
    return VectorNorm(-1, y.bound * math.sqrt(float(squares.sum())), y.bound, squares)


def _column_squares(array: np.ndarray) -> np.ndarray:
    squares = np.square(array).sum(axis=0).astype(np.float64)
    return squares * (1.0 + (array.shape[0] + 1) * float(np.finfo(array.dtype).eps))


def _norm_add(ranges: ValueRanges, node: ir.Node) -> VectorNorm | None:
    """y @ W + b, b a constant vector over the last axis."""
    for index in (0, 1):
        x = ranges.norms.get(id(node.inputs[index]))
        bias = const_array(node.inputs[1 - index])
        if x is None or x.squares is None or bias is None or bias.dtype.kind != "f":
            continue
        length = x.squares.shape[0]
        if bias.size not in (1, length) or (bias.size > 1 and bias.shape[-1] != length):
            return None
        total = (x.bias if x.bias is not None else 0.0) + np.broadcast_to(
            bias.reshape(-1).astype(np.float64), (length,)
        )
        bound = x.source * math.sqrt(float(x.squares.sum())) + float(np.linalg.norm(total))
        return VectorNorm(-1, bound, x.source, x.squares, total)
    return None


def _norm_mul(ranges: ValueRanges, node: ir.Node) -> VectorNorm | None:
    """A vector times a scalar constant."""
    for index in (0, 1):
        x = ranges.norms.get(id(node.inputs[index]))
        factor = const_array(node.inputs[1 - index])
        if x is None or factor is None or factor.size != 1 or factor.dtype.kind != "f":
            continue
        c = float(factor.reshape(()))
        bias = x.bias * c if x.bias is not None else None
        return VectorNorm(x.axis, x.bound * abs(c), x.source * abs(c), x.squares, bias)
    return None


def _norm_reshape(ranges: ValueRanges, node: ir.Node) -> VectorNorm | None:
    """The last axis kept, or split into heads: each head's slice bounded on its own."""
    x = ranges.norms.get(id(node.inputs[0]))
    before, after = static_dims(node.inputs[0]), static_dims(node.outputs[0])
    if x is None or x.axis != -1 or before is None or after is None or not before or not after:
        return None
    if after[-1] == before[-1] and math.prod(after[:-1]) == math.prod(before[:-1]):
        return x
    if len(after) < 2 or after[:-2] != before[:-1] or after[-2] * after[-1] != before[-1]:
        return None
    if x.squares is None:
        return VectorNorm(-1, x.bound)  # a slice is no longer than the vector
    heads = x.squares.reshape(after[-2], after[-1]).sum(axis=1)
    bias = x.bias if x.bias is not None else np.zeros(before[-1])
    shifts = np.linalg.norm(bias.reshape(after[-2], after[-1]), axis=1)
    return VectorNorm(-1, float((x.source * np.sqrt(heads) + shifts).max()))


def _norm_transpose(ranges: ValueRanges, node: ir.Node) -> VectorNorm | None:
    x = ranges.norms.get(id(node.inputs[0]))
    dims = static_dims(node.inputs[0])
    if x is None or dims is None:
        return None
    attr = node.attributes.get("perm")
    perm = list(attr.as_ints()) if attr is not None else list(reversed(range(len(dims))))
    where = perm.index(len(dims) + x.axis) - len(dims)
    if where == -1:
        return VectorNorm(-1, x.bound, x.source, x.squares, x.bias)
    return VectorNorm(where, x.bound)


_NORM_RULES: dict[str, Callable[[ValueRanges, ir.Node], VectorNorm | None]] = {
    "LayerNormalization": _norm_layer_norm,
    "MatMul": _norm_matmul,
    "Add": _norm_add,
    "Mul": _norm_mul,
    "Reshape": _norm_reshape,
    "Transpose": _norm_transpose,
}
