"""FlexAttention (ai.onnx.preview opset 1): rank-4 attention with graph-valued modifiers.

Runs whole (one tile) like Attention: the softmax couples every key of a row, and the
`score_mod` / `prob_mod` subgraphs see the whole (B, Hq, L, S) tensor. The modifiers run on
our own kernels through `control_flow.Body`. The arithmetic follows the op's function body:
Q and K are each scaled by sqrt(scale) in the input type and their product is rounded to the
input type, then cast to the softmax precision (float32 unless the inputs are float64 or
`softmax_precision` says otherwise), where the modifiers, the softmax and P @ V run; Y is
rounded once to the input type.
"""

from __future__ import annotations

import numpy as np
import onnx

from compiler_core.ops.attention import _round
from compiler_core.ops.control_flow import Body, split_outer
from compiler_core.ops.registry import FLOATS, NodeInfo, TileCtx, invalid_model, register

Array = np.ndarray

_PRECISIONS: dict[int, type[np.floating]] = {
    int(onnx.TensorProto.FLOAT): np.float32,
    int(onnx.TensorProto.DOUBLE): np.float64,
    int(onnx.TensorProto.FLOAT16): np.float16,
}


def _precision(node: NodeInfo, q: Array) -> type[np.floating]:
    value = node.attr("softmax_precision")
    if value is None:
        return np.float64 if q.dtype == np.float64 else np.float32
    if int(value) not in _PRECISIONS:
        raise invalid_model(node, f"softmax_precision {value} is not float16, float32 or float64")
    return _PRECISIONS[int(value)]


def _check(node: NodeInfo, q: Array, k: Array, v: Array) -> None:
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise invalid_model(
            node, f"Q, K and V must be rank 4, got ranks {q.ndim}, {k.ndim}, {v.ndim}"
        )
    if k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise invalid_model(node, f"Q {q.shape}, K {k.shape} and V {v.shape} do not match")
    if q.shape[1] % k.shape[1]:
        raise invalid_model(
            node, f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} kv heads"
        )


def _modify(node: NodeInfo, name: str, x: Array, outer: dict) -> Array:
    """Apply the `name` modifier subgraph, if any, to the (B, Hq, L, S) tensor `x`."""
    blob = node.attr(name)
    if blob is None:
        return x
    body = Body.decode(blob, node)
    if len(body.graph.input) != 1 or len(body.graph.output) != 1:
        raise invalid_model(node, f"{name} must have one input and one output")
    (result,) = body.run([x], outer)
    if result.shape != x.shape:
        raise invalid_model(node, f"{name} turned shape {x.shape} into {result.shape}")
    return result.astype(x.dtype, copy=False)


def _softmax(x: Array) -> Array:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def flex_attention_compute(
    node: NodeInfo, inputs: list[Array | None], tile: TileCtx
) -> list[Array]:
    own, outer = split_outer(node, inputs)
    q, k, v = own[0], own[1], own[2]
    assert q is not None and k is not None and v is not None
    _check(node, q, k, v)
    sp = _precision(node, q)
    acc = np.float64 if q.dtype == np.float64 else np.float32
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scale = node.attr("scale")
    scale = 1.0 / np.sqrt(q.shape[3]) if scale is None else float(scale)
    root = q.dtype.type(np.sqrt(scale))
    qk = (q * root).astype(acc) @ np.swapaxes((k * root).astype(acc), -1, -2)
    scores = _round(qk, q.dtype).astype(sp)
    scores = _modify(node, "score_mod", scores, outer)
    with np.errstate(invalid="ignore"):  # a fully masked row is NaN, as in Softmax
        probs = _softmax(scores)
    probs = _modify(node, "prob_mod", probs, outer)
    y = probs @ v.astype(sp)
    return [y.astype(np.dtype(node.out_dtypes[0]))]


def flex_attention_macs(node: NodeInfo) -> int:
    """QK^T and PV over every head: (|Q| + |Y|) * S."""
    q_shape, k_shape = node.in_shapes[0], node.in_shapes[1]
    assert q_shape is not None and k_shape is not None
    q_elems = int(np.prod(q_shape, dtype=np.int64))
    y_elems = int(np.prod(node.out_shapes[0], dtype=np.int64))
    return (q_elems + y_elems) * int(k_shape[2])


register(
    "FlexAttention",
    flex_attention_compute,
    since=1,
    domain="ai.onnx.preview",
    dtypes=FLOATS,
    kernel="flex_attention",
    unit="hmx",
    macs=flex_attention_macs,
    doc="Rank-4 attention with GQA, scale, softmax_precision and score_mod/prob_mod subgraphs.",
)
