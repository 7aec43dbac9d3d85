"""Activation functions: elementwise ops whose only parameters are attributes (or PRelu's slope
and Clip's scalar bounds), so each can be fused as an epilogue of the op producing its input.

Each formula applies the ONNX attribute defaults itself; float16 runs in float32 and rounds once.
SwiGLU (two same-shape inputs, gate and value) is the exception: it rounds the Swish of the gate
to the input type before the product, as its ONNX function body (Swish, then Mul) does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from compiler_core.errors import CompileError
from compiler_core.ops._tiling import elementwise_split
from compiler_core.ops.elementwise import (
    Array,
    erf,
    out_dtype,
    register_elementwise,
    widen,
)
from compiler_core.ops.registry import FLOATS, NUMERIC, SIGNED, NodeInfo, OpDef, TileCtx

Activation = Callable[[Array, NodeInfo], Array]


def register_activation(
    op_type: str, fn: Activation, *, since: int, dtypes: frozenset[str] = FLOATS, **kwargs: Any
) -> OpDef:
    """One line per activation: `fn(x, node)` reads its attributes from the node."""

    def compute(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
        x = inputs[0]
        assert x is not None, f"{op_type} needs an input"
        with np.errstate(all="ignore"):
            return [np.asarray(fn(widen(x), node)).astype(out_dtype(node), copy=False)]

    return register_elementwise(op_type, compute, since=since, dtypes=dtypes, **kwargs)


def _f(node: NodeInfo, name: str, default: float) -> float:
    return float(node.attr(name, default))


def sigmoid(x: Array) -> Array:
    return 1.0 / (1.0 + np.exp(-x))


def softplus(x: Array) -> Array:
    return np.logaddexp(np.zeros((), x.dtype), x)


def _relu(x: Array, node: NodeInfo) -> Array:
    return np.maximum(x, np.zeros((), x.dtype))


def _leaky_relu(x: Array, node: NodeInfo) -> Array:
    return np.where(x < 0, x * _f(node, "alpha", 0.01), x)


def _hard_sigmoid(x: Array, node: NodeInfo) -> Array:
    return np.clip(x * _f(node, "alpha", 0.2) + _f(node, "beta", 0.5), 0.0, 1.0)


def _hard_swish(x: Array, node: NodeInfo) -> Array:
    return x * np.clip(x * (1.0 / 6.0) + 0.5, 0.0, 1.0)


def _elu(x: Array, node: NodeInfo) -> Array:
    return np.where(x < 0, _f(node, "alpha", 1.0) * np.expm1(x), x)


def _selu(x: Array, node: NodeInfo) -> Array:
    alpha = _f(node, "alpha", 1.67326319217681884765625)
    gamma = _f(node, "gamma", 1.05070102214813232421875)
    return np.where(x <= 0, gamma * alpha * np.expm1(x), gamma * x)


def _celu(x: Array, node: NodeInfo) -> Array:
    alpha = _f(node, "alpha", 1.0)
    return np.maximum(x, 0) + np.minimum(0, alpha * np.expm1(x / alpha))


def _gelu(x: Array, node: NodeInfo) -> Array:
    if node.attr("approximate", "none") == "tanh":
        inner = np.sqrt(2.0 / np.pi) * (x + 0.044715 * x * x * x)
        return 0.5 * x * (1.0 + np.tanh(inner))
    return 0.5 * x * (1.0 + erf(x * np.float64(1.0 / np.sqrt(2.0)).astype(x.dtype)))


def _mish(x: Array, node: NodeInfo) -> Array:
    return x * np.tanh(softplus(x))


def _softsign(x: Array, node: NodeInfo) -> Array:
    return x / (1.0 + np.abs(x))


def _thresholded_relu(x: Array, node: NodeInfo) -> Array:
    return np.where(x > _f(node, "alpha", 1.0), x, 0)


def _swish(x: Array, node: NodeInfo) -> Array:
    return x * sigmoid(x * _f(node, "alpha", 1.0))


def _shrink(x: Array, node: NodeInfo) -> Array:
    lambd, bias = _f(node, "lambd", 0.5), _f(node, "bias", 0.0)
    if x.dtype.kind in "iu":
        lambd_x, bias_x = np.asarray(lambd), np.asarray(bias)
        high = (x.astype(np.float64) - bias_x).astype(x.dtype)
        low = (x.astype(np.float64) + bias_x).astype(x.dtype)
        xf = x.astype(np.float64)
        return np.where(xf < -lambd_x, low, np.where(xf > lambd_x, high, 0))
    return np.where(x < -lambd, x + bias, np.where(x > lambd, x - bias, 0))


def _prelu(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    x, slope = inputs[0], inputs[1]
    assert x is not None and slope is not None, "PRelu needs X and slope"
    x, slope = widen(x), widen(slope)
    return [np.where(x < 0, x * slope, x).astype(out_dtype(node), copy=False)]


def _clip(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    """Clip: bounds are attributes before opset 11 and optional scalar inputs from 11 on."""
    x = inputs[0]
    assert x is not None, "Clip needs an input"
    lo: Any = inputs[1] if len(inputs) > 1 else None
    hi: Any = inputs[2] if len(inputs) > 2 else None
    if "min" in node.attrs:
        lo = np.asarray(node.attrs["min"], dtype=x.dtype)
    if "max" in node.attrs:
        hi = np.asarray(node.attrs["max"], dtype=x.dtype)
    result = x
    if lo is not None:
        result = np.maximum(result, np.asarray(lo).astype(x.dtype).reshape(()))
    if hi is not None:
        result = np.minimum(result, np.asarray(hi).astype(x.dtype).reshape(()))
    return [np.asarray(result).astype(out_dtype(node), copy=False)]


def _swiglu_split(node: NodeInfo) -> list[int]:
    """Elementwise tiling; lowering asks this first, so it is where the shapes are checked."""
    if node.in_shapes[0] != node.in_shapes[1]:
        raise CompileError(
            "invalid_model",
            f"SwiGLU gate A {node.in_shapes[0]} and value B {node.in_shapes[1]} must have the "
            "same shape (no broadcasting)",
            node=node.name,
        )
    return elementwise_split(node)


def _swiglu(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    """Y = Swish_alpha(A) * B, the Swish rounded to the output type before the product."""
    a, b = inputs[0], inputs[1]
    assert a is not None and b is not None, "SwiGLU needs A and B"
    dtype = out_dtype(node)
    with np.errstate(all="ignore"):
        gate = _swish(widen(a), node).astype(dtype, copy=False)
        return [(widen(gate) * widen(b)).astype(dtype, copy=False)]


register_activation("Relu", _relu, since=6, dtypes=FLOATS | SIGNED)
register_activation("LeakyRelu", _leaky_relu, since=6)
register_elementwise("PRelu", _prelu, since=7, dtypes=FLOATS | frozenset({"int32", "int64"}))
register_activation("Sigmoid", lambda x, node: sigmoid(x), since=6)
register_activation("HardSigmoid", _hard_sigmoid, since=6)
register_activation("HardSwish", _hard_swish, since=14)
register_activation("Tanh", lambda x, node: np.tanh(x), since=6)
register_activation("Elu", _elu, since=6)
register_activation("Selu", _selu, since=6)
register_activation("Celu", _celu, since=12)
register_activation("Gelu", _gelu, since=20)
register_activation("Mish", _mish, since=18)
register_activation("Softplus", lambda x, node: softplus(x), since=1)
register_activation("Softsign", _softsign, since=1)
register_activation("ThresholdedRelu", _thresholded_relu, since=10)
register_activation("Swish", _swish, since=24)
register_activation("Shrink", _shrink, since=9, dtypes=NUMERIC)
register_elementwise("Clip", _clip, since=6, dtypes=NUMERIC)
register_elementwise("SwiGLU", _swiglu, since=28, split_axes=_swiglu_split)
