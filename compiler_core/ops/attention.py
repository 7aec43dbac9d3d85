"""ONNX Attention (opset 23-25): scaled dot-product attention with masks, GQA and a KV cache.

Runs whole (one tile): the softmax couples every key of a row and the optional present/QK
outputs cover the whole tensor. Products accumulate in float32 (float64 for float64 inputs)
and each output is rounded once to its type. A query row whose every key is masked out
yields zeros, as the ONNX specification asks.
"""

from __future__ import annotations

import numpy as np

from compiler_core.errors import CompileError
from compiler_core.ops.registry import FLOATS, NodeInfo, TileCtx, register

Array = np.ndarray

_QK_RAW, _QK_SOFTCAPPED, _QK_BIASED, _QK_SOFTMAX = 0, 1, 2, 3
"""qk_matmul_output_mode values, as ONNX Runtime and the ONNX reference number them: the raw
(scaled) QK product, after softcap, after softcap plus mask bias, after softmax."""


def _heads(x: Array, heads: int) -> Array:
    """(B, S, heads * size) -> (B, heads, S, size)."""
    b, s, hidden = x.shape
    return x.reshape(b, s, heads, hidden // heads).transpose(0, 2, 1, 3)


def _input(inputs: list[Array | None], index: int) -> Array | None:
    return inputs[index] if index < len(inputs) else None


def _additive_mask(mask: Array, total: int, acc: type[np.floating]) -> Array:
    """A bool (True: attend) or float mask as an additive bias, its key axis padded to
    `total` with "masked" (the mask may cover fewer keys than past + new)."""
    pad = total - mask.shape[-1]
    if mask.dtype == np.bool_:
        bias = np.where(mask, acc(0), acc(-np.inf))
    else:
        bias = mask.astype(acc)
    if pad > 0:
        widths = [(0, 0)] * (bias.ndim - 1) + [(0, pad)]
        bias = np.pad(bias, widths, constant_values=-np.inf)
    return bias


def _causal(q_len: int, total: int, offset: Array, acc: type[np.floating]) -> Array:
    """Bottom-right aligned causal bias: query i sees key j iff j <= i + offset.
    `offset` is a scalar or one per batch (then the result is (B, 1, q, total))."""
    i = np.arange(q_len)[:, None]
    j = np.arange(total)[None, :]
    if offset.ndim == 0:
        allowed = j <= i + int(offset)
    else:
        allowed = (j <= i + offset.reshape(-1, 1, 1))[:, None]
    return np.where(allowed, acc(0), acc(-np.inf))


def _window(
    q_len: int, total: int, offset: Array, left: int, right: int, acc: type[np.floating]
) -> Array:
    """Sliding-window bias (opset 25): query i, at position i + offset, sees key j iff
    j is at most `left` before and `right` after it; -1 leaves that side open."""
    i = np.arange(q_len)[:, None]
    j = np.arange(total)[None, :]
    diff = i + offset.reshape(-1, 1, 1) - j if offset.ndim else i + int(offset) - j
    allowed = np.ones(diff.shape, bool)
    if left >= 0:
        allowed &= diff <= left
    if right >= 0:
        allowed &= -diff <= right
    bias = np.where(allowed, acc(0), acc(-np.inf))
    return bias[:, None] if offset.ndim else bias


def _round(x: Array, dtype: np.dtype) -> Array:
    """x rounded to `dtype` and back: the intermediate roundings of a float16 computation."""
    return x if dtype.itemsize >= x.dtype.itemsize else x.astype(dtype).astype(x.dtype)


def _check(node: NodeInfo, q: Array) -> None:
    if q.ndim not in (3, 4):
        raise CompileError(
            "unsupported_shape", f"Attention Q must be 3-D or 4-D, got {q.ndim}-D", node=node.name
        )
    if q.ndim == 3 and (node.attr("q_num_heads") is None or node.attr("kv_num_heads") is None):
        raise CompileError(
            "invalid_model",
            "Attention with 3-D inputs needs q_num_heads and kv_num_heads",
            node=node.name,
        )


def attention_compute(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    q, k, v = inputs[0], inputs[1], inputs[2]
    assert q is not None and k is not None and v is not None
    _check(node, q)
    mask, past_k, past_v = _input(inputs, 3), _input(inputs, 4), _input(inputs, 5)
    nonpad = _input(inputs, 6)
    acc = np.float64 if q.dtype == np.float64 else np.float32
    rank3 = q.ndim == 3
    if rank3:
        q = _heads(q, int(node.attr("q_num_heads")))
        k = _heads(k, int(node.attr("kv_num_heads")))
        v = _heads(v, int(node.attr("kv_num_heads")))
    if past_k is not None:
        k = np.concatenate([past_k, k], axis=2)
    if past_v is not None:
        v = np.concatenate([past_v, v], axis=2)
    present_k, present_v = k, v
    batch, q_heads, q_len, head_size = q.shape
    total = k.shape[2]

    bias = np.zeros((q_len, total), acc)
    if mask is not None:
        bias = bias + _additive_mask(mask, total, acc)
    if past_k is None and nonpad is not None:
        offset = nonpad.astype(np.int64) - q_len
    else:
        offset = np.asarray(0 if past_k is None else past_k.shape[2])
    if int(node.attr("is_causal", 0)):
        bias = bias + _causal(q_len, total, offset, acc)
    left, right = int(node.attr("left_window_size", -1)), int(node.attr("right_window_size", -1))
    if left >= 0 or right >= 0:
        bias = bias + _window(q_len, total, offset, left, right, acc)
    if nonpad is not None:
        keep = np.arange(total)[None, :] < nonpad.astype(np.int64)[:, None]
        bias = bias + np.where(keep, acc(0), acc(-np.inf)).reshape(batch, 1, 1, total)

    if q_heads != k.shape[1]:
        k = np.repeat(k, q_heads // k.shape[1], axis=1)
        v = np.repeat(v, q_heads // v.shape[1], axis=1)
    scale = node.attr("scale")
    scale = 1.0 / np.sqrt(head_size) if scale is None else float(scale)
    # Q and K are each scaled by sqrt(scale) in the input type, as the ONNX function body does;
    # for float16 this rounding is visible, so the product is rounded back to float16 too.
    root = q.dtype.type(np.sqrt(scale))
    qk = _round((q * root).astype(acc) @ np.swapaxes((k * root).astype(acc), -1, -2), q.dtype)
    raw = qk
    softcap = float(node.attr("softcap", 0.0))
    if softcap > 0:
        qk = softcap * np.tanh(qk / softcap)
    softcapped = qk
    scores = np.broadcast_to(qk + bias, qk.shape)

    masked_rows = np.isneginf(bias.max(axis=-1, keepdims=True))
    row_max = scores.max(axis=-1, keepdims=True)
    e = np.exp(scores - np.where(np.isfinite(row_max), row_max, 0))
    total_e = e.sum(axis=-1, keepdims=True)
    probs = np.where(masked_rows, acc(0), e / np.where(total_e == 0, 1, total_e))
    probs = probs.astype(q.dtype).astype(acc)
    y = probs @ v.astype(acc)
    if rank3:
        y = y.transpose(0, 2, 1, 3).reshape(batch, q_len, -1)

    outputs = [y.astype(np.dtype(node.out_dtypes[0]))]
    if len(node.out_dtypes) > 1:
        outputs.append(present_k.astype(np.dtype(node.out_dtypes[1])))
    if len(node.out_dtypes) > 2:
        outputs.append(present_v.astype(np.dtype(node.out_dtypes[2])))
    if len(node.out_dtypes) > 3:
        mode = int(node.attr("qk_matmul_output_mode", _QK_RAW))
        chosen = {
            _QK_RAW: raw,
            _QK_SOFTCAPPED: softcapped,
            _QK_BIASED: scores,
            _QK_SOFTMAX: probs,
        }[mode]
        outputs.append(np.broadcast_to(chosen, node.out_shapes[3]).astype(node.out_dtypes[3]))
    return outputs


def attention_macs(node: NodeInfo) -> int:
    """Two batched matmuls: QK^T and PV, over every head."""
    y_shape = node.out_shapes[0]
    q_shape, k_shape = node.in_shapes[0], node.in_shapes[1]
    assert q_shape is not None and k_shape is not None
    total = k_shape[-2] if len(k_shape) == 4 else k_shape[1]
    past = node.in_shapes[4] if len(node.in_shapes) > 4 else None
    if past is not None:
        total += past[2]
    q_elems = int(np.prod(q_shape, dtype=np.int64))
    y_elems = int(np.prod(y_shape, dtype=np.int64))
    return (q_elems + y_elems) * int(total)


register(
    "Attention",
    attention_compute,
    since=23,
    until=25,
    dtypes=FLOATS,
    kernel="attention",
    unit="hmx",
    split_axes=lambda node: [],
    macs=attention_macs,
    doc="Scaled dot-product attention: 3-D/4-D, GQA, masks, causal, window, softcap, KV cache.",
)
