"""ONNX LinearAttention (opset 27): the recurrent state update of linear attention, DeltaNet and
Gated DeltaNet, for prefill (T > 1) and decode (T = 1), with GQA.

Runs whole (one tile): every output token depends on the state left by all earlier tokens,
and the present state covers every head. The kernel runs the recurrence token by token, as
the specification defines it (the chunk_size attribute is only a tuning hint and does not
change the result). The state and every product are kept in float32 whatever the input type,
and each output is rounded once to its type, as the ONNX function body does.

Attributes and input shapes are checked when the node is lowered (from `split_axes`, which
lowering asks first), so a bad model fails at compile time with a message naming the problem.
"""

from __future__ import annotations

import numpy as np

from compiler_core.ops.registry import NodeInfo, Shape, TileCtx, invalid_model, register

Array = np.ndarray

_RULES = ("linear", "gated", "delta", "gated_delta")
_GATED = frozenset({"gated", "gated_delta"})
_DELTA = frozenset({"delta", "gated_delta"})
_PAST, _DECAY, _BETA = 3, 4, 5
"""Input positions of the optional inputs."""


def _shape(node: NodeInfo, index: int) -> Shape | None:
    return node.in_shapes[index] if node.has_input(index) else None


def _rule(node: NodeInfo) -> str:
    return node.choice("update_rule", "gated_delta", _RULES)


def _heads(node: NodeInfo) -> tuple[int, int]:
    q_heads, kv_heads = node.attr("q_num_heads"), node.attr("kv_num_heads")
    if q_heads is None or kv_heads is None:
        raise invalid_model(node, "q_num_heads and kv_num_heads are required")
    q_heads, kv_heads = int(q_heads), int(kv_heads)
    if q_heads <= 0 or kv_heads <= 0 or q_heads % kv_heads:
        raise invalid_model(
            node, f"q_num_heads {q_heads} must be a positive multiple of kv_num_heads {kv_heads}"
        )
    return q_heads, kv_heads


def _per_head(node: NodeInfo, total: int, heads: int, what: str) -> int:
    if total % heads:
        raise invalid_model(
            node, f"{what} last dimension {total} is not a multiple of {heads} heads"
        )
    return total // heads


def _validate(node: NodeInfo) -> None:
    """Every attribute and shape the kernel relies on; raises a CompileError naming the fault."""
    rule = _rule(node)
    q_heads, kv_heads = _heads(node)
    q, k, v = node.in_shapes[0], node.in_shapes[1], node.in_shapes[2]
    assert q is not None and k is not None and v is not None
    if len(q) != 3 or len(k) != 3 or len(v) != 3:
        raise invalid_model(
            node, f"query, key and value must be 3-D, got {len(q)}-D, {len(k)}-D, {len(v)}-D"
        )
    if k[:2] != q[:2] or v[:2] != q[:2]:
        raise invalid_model(
            node, f"query {q}, key {k} and value {v} differ in batch or sequence length"
        )
    d_k = _per_head(node, q[2], q_heads, "query")
    if _per_head(node, k[2], kv_heads, "key") != d_k:
        raise invalid_model(
            node, f"key head size {k[2] // kv_heads} differs from query head size {d_k}"
        )
    d_v = _per_head(node, v[2], kv_heads, "value")
    past = _shape(node, _PAST)
    if past is not None and tuple(past) != (q[0], kv_heads, d_k, d_v):
        raise invalid_model(node, f"past_state shape {past} is not {(q[0], kv_heads, d_k, d_v)}")
    decay, beta = _shape(node, _DECAY), _shape(node, _BETA)
    if rule in _GATED and decay is None:
        raise invalid_model(node, f"update_rule {rule!r} needs the decay input")
    if rule in _DELTA and beta is None:
        raise invalid_model(node, f"update_rule {rule!r} needs the beta input")
    if decay is not None and (
        tuple(decay[:2]) != q[:2] or decay[2] not in (kv_heads, kv_heads * d_k)
    ):
        raise invalid_model(
            node, f"decay shape {decay} is not (B, T, {kv_heads}) or (B, T, {kv_heads * d_k})"
        )
    if beta is not None and (tuple(beta[:2]) != q[:2] or beta[2] not in (kv_heads, 1)):
        raise invalid_model(node, f"beta shape {beta} is not (B, T, {kv_heads}) or (B, T, 1)")


def _split_axes(node: NodeInfo) -> list[int]:
    """Runs whole; lowering asks this first, so it is where the node is validated."""
    _validate(node)
    return []


def _scale(node: NodeInfo, d_k: int) -> np.float32:
    scale = float(node.attr("scale", 0.0))
    if scale == 0.0:
        return np.float32(1.0) / np.sqrt(np.float32(d_k))
    return np.float32(scale)


def _optional(inputs: list[Array | None], index: int) -> Array | None:
    return inputs[index] if index < len(inputs) else None


def linear_attention_compute(
    node: NodeInfo, inputs: list[Array | None], tile: TileCtx
) -> list[Array]:
    _validate(node)
    rule = _rule(node)
    q_heads, kv_heads = _heads(node)
    query, key, value = inputs[0], inputs[1], inputs[2]
    assert query is not None and key is not None and value is not None
    batch, steps = query.shape[0], query.shape[1]
    f32 = np.float32
    # Token-major views: (T, B, heads, size).
    q = query.astype(f32).reshape(batch, steps, kv_heads, q_heads // kv_heads, -1)
    k = key.astype(f32).reshape(batch, steps, kv_heads, -1)
    v = value.astype(f32).reshape(batch, steps, kv_heads, -1)
    d_k, d_v = k.shape[-1], v.shape[-1]
    past, decay, beta = (_optional(inputs, i) for i in (_PAST, _DECAY, _BETA))
    state = np.zeros((batch, kv_heads, d_k, d_v), f32) if past is None else past.astype(f32)
    gate = None
    if rule in _GATED:
        assert decay is not None
        # (B, T, H_kv, d_k or 1, 1): scales the rows (key axis) of each head's state.
        gate = np.exp(decay.astype(f32).reshape(batch, steps, kv_heads, -1))[..., None]
    rate = None
    if rule in _DELTA:
        assert beta is not None
        rate = beta.astype(f32).reshape(batch, steps, -1, 1)
    scale = _scale(node, d_k)
    out = np.empty((batch, steps, kv_heads, q_heads // kv_heads, d_v), f32)
    for t in range(steps):
        if gate is not None:
            state = state * gate[:, t]
        k_t = k[:, t]
        write = v[:, t]
        if rate is not None:
            retrieved = np.einsum("bhkv,bhk->bhv", state, k_t)
            write = rate[:, t] * (write - retrieved)
        state = state + k_t[..., :, None] * write[..., None, :]
        out[:, t] = scale * np.einsum("bhgk,bhkv->bhgv", q[:, t], state)
    output = out.reshape(batch, steps, -1).astype(np.dtype(node.out_dtypes[0]))
    return [output, state.astype(np.dtype(node.out_dtypes[1]))]


def linear_attention_macs(node: NodeInfo) -> int:
    """Per token and head: the state update (d_k * d_v, twice for the delta rules) and the
    read (d_k * d_v per query head)."""
    q, v = node.in_shapes[0], node.in_shapes[2]
    assert q is not None and v is not None
    q_heads, kv_heads = int(node.attr("q_num_heads", 1)), int(node.attr("kv_num_heads", 1))
    d_k = q[2] // max(q_heads, 1)
    d_v = v[2] // max(kv_heads, 1)
    per_token = (2 * kv_heads + q_heads) * d_k * d_v
    return int(q[0]) * int(q[1]) * per_token


register(
    "LinearAttention",
    linear_attention_compute,
    since=27,
    dtypes=frozenset({"float16", "float32"}),
    kernel="linear_attention",
    unit="hmx",
    split_axes=_split_axes,
    macs=linear_attention_macs,
    doc="Linear attention recurrence: linear, gated, delta and gated_delta rules, GQA, past state.",
)
