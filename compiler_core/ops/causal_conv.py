"""ONNX CausalConvWithState (opset 27): a causal depthwise 1-D convolution that carries its last
k - 1 input positions from one call to the next (Mamba, Gated DeltaNet).

Runs whole (one tile): the node has two outputs, and the carry state is the tail of the
sequence. The kernel prepends the past state (zeros when absent) to the input and takes, for
each position, the k-tap dot product ending there; the new state is the last k - 1 positions
of that padded sequence, copied exactly. Products accumulate in float32 (float16 inputs) and
the convolution is rounded to the output type before the optional SiLU, which runs in float32
and rounds again, as the ONNX function body does (Conv, then Cast-Sigmoid-Mul-CastLike).

Attributes and shapes are checked when the node is lowered (from `split_axes`, which lowering
asks first), so a bad model fails at compile time with a message naming the problem.
"""

from __future__ import annotations

import numpy as np

from compiler_core.ops.registry import NodeInfo, TileCtx, invalid_model, register

Array = np.ndarray

_ACTIVATIONS = ("none", "silu", "swish")
_BIAS, _PAST = 2, 3
"""Input positions of the optional inputs."""


def _activation(node: NodeInfo) -> str:
    return node.choice("activation", "none", _ACTIVATIONS)


def _validate(node: NodeInfo) -> None:
    """Every attribute and shape the kernel relies on; raises a CompileError naming the fault."""
    _activation(node)
    x, w = node.in_shapes[0], node.in_shapes[1]
    assert x is not None and w is not None
    if len(x) != 3:
        raise invalid_model(node, f"input must be 3-D (batch, channels, length), got shape {x}")
    channels = x[1]
    if len(w) != 3 or w[0] != channels or w[1] != 1 or w[2] < 1:
        raise invalid_model(node, f"weight shape {w} is not ({channels}, 1, k) with k >= 1")
    bias = node.in_shapes[_BIAS] if node.has_input(_BIAS) else None
    if bias is not None and tuple(bias) != (channels,):
        raise invalid_model(node, f"bias shape {bias} is not ({channels},)")
    past = node.in_shapes[_PAST] if node.has_input(_PAST) else None
    if past is not None and tuple(past) != (x[0], channels, w[2] - 1):
        raise invalid_model(node, f"past_state shape {past} is not {(x[0], channels, w[2] - 1)}")


def _split_axes(node: NodeInfo) -> list[int]:
    """Runs whole; lowering asks this first, so it is where the node is validated."""
    _validate(node)
    return []


def _optional(inputs: list[Array | None], index: int) -> Array | None:
    return inputs[index] if index < len(inputs) else None


def causal_conv_compute(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    _validate(node)
    x, weight = inputs[0], inputs[1]
    assert x is not None and weight is not None
    bias, past = _optional(inputs, _BIAS), _optional(inputs, _PAST)
    batch, channels, length = x.shape
    taps = weight.shape[2]
    if past is None:
        past = np.zeros((batch, channels, taps - 1), x.dtype)
    padded = np.concatenate([past.astype(x.dtype), x], axis=2)
    acc = np.float64 if x.dtype == np.float64 else np.float32
    w = weight.astype(acc).reshape(channels, taps)
    y = np.zeros((batch, channels, length), acc)
    if bias is not None:
        y += bias.astype(acc)[None, :, None]
    for j in range(taps):
        y += w[None, :, j, None] * padded[:, :, j : j + length].astype(acc)
    out_dtype = np.dtype(node.out_dtypes[0])
    y = y.astype(out_dtype).astype(acc)
    if _activation(node) != "none":
        y = y / (acc(1) + np.exp(-y))
    present = padded[:, :, length:]
    return [y.astype(out_dtype), np.ascontiguousarray(present, np.dtype(node.out_dtypes[1]))]


register(
    "CausalConvWithState",
    causal_conv_compute,
    since=27,
    dtypes=frozenset({"float16", "float32"}),
    kernel="causal_conv_with_state",
    split_axes=_split_axes,
    macs=lambda node: (
        int(np.prod(node.out_shapes[0], dtype=np.int64)) * int((node.in_shapes[1] or (0, 0, 1))[2])
    ),
    doc="Causal depthwise 1-D convolution with carry state, optional bias and fused SiLU.",
)
