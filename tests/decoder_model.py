"""A tiny decoder-only transformer language model with a KV cache, built with onnx.helper, for
testing LLM-style compiles (prefill/decode specializations, retained state) end to end.

Its interface follows QEfficient's exported models, the form qaic compiles: `input_ids` and
`position_ids` of shape [batch_size, seq_len] (both symbolic), one `past_key.{i}` /
`past_value.{i}` cache of fixed length `ctx_len` per layer, and outputs `logits` plus the
updated caches named `past_key.{i}_RetainedState` / `past_value.{i}_RetainedState`.

Design choices:
- The cache update is one TensorScatter (opset 24) per cache along the sequence axis, written
  at `position_ids[:, 0]` (each batch row writes seq_len consecutive rows from there). It is
  the op made for this job; ScatterND would need index tensors built from symbolic shapes.
- Attention always runs over all `ctx_len` cache rows (new keys already written in), masked by
  absolute position: the query at position p sees rows j <= p. Rows not yet written are all
  past p, so no separate "valid length" is needed, and row 0 is always visible, so no row of
  the softmax is fully masked. The mask is a Where with a large finite negative, not -inf, so
  a masked score can never turn into NaN.
- Learned position embeddings (a Gather on `position_ids`) rather than rotary ones keep the
  op set plain: Gather, MatMul, Add, Mul, Reshape, Transpose, Softmax, LayerNormalization,
  Where, LessOrEqual, Unsqueeze, Gelu, TensorScatter.
- Weights are random (`np.random.default_rng(seed)`) but the embeddings and LM head are scaled
  up so that logits spread over several units: greedy argmax is then decided by margins far
  above float rounding, and two implementations can be compared token by token.
- The generation loop takes any runner (a function from feeds to outputs by name), so the same
  loop drives ONNX Runtime (caches fed back by the caller) and a runtime that keeps the cache
  itself (retained state: no `past_*` inputs passed).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import onnx.helper as oh
from onnx import TensorProto, numpy_helper

OPSET = 24
"""TensorScatter needs opset 24."""

MASKED = -1.0e9
"""Score of a cache row the query may not see (finite: exp underflows to exactly 0)."""

Runner = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]


def past_names(layers: int) -> list[str]:
    """The cache input names, in graph input order."""
    return [f"past_{kind}.{i}" for i in range(layers) for kind in ("key", "value")]


def retained_name(past: str) -> str:
    return f"{past}_RetainedState"


class _Graph:
    """Collects nodes and initializers with unique names."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self._count = 0

    def fresh(self, hint: str) -> str:
        self._count += 1
        return f"{hint}_{self._count}"

    def const(self, name: str, value: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(value, name))
        return name

    def weight(self, name: str, shape: tuple[int, ...], scale: float) -> str:
        value = (self.rng.standard_normal(shape) * scale).astype(np.float32)
        return self.const(name, value)

    def op(self, op_type: str, inputs: list[str], out: str | None = None, **attrs: Any) -> str:
        name = out or self.fresh(op_type.lower())
        self.nodes.append(oh.make_node(op_type, inputs, [name], name=f"n_{name}", **attrs))
        return name


@dataclass(frozen=True)
class _Dims:
    vocab: int
    d_model: int
    heads: int
    head_dim: int
    ctx_len: int


def _layer_norm(g: _Graph, x: str, prefix: str, d_model: int) -> str:
    scale = g.const(f"{prefix}.ln_scale", np.ones(d_model, np.float32))
    bias = g.const(f"{prefix}.ln_bias", np.zeros(d_model, np.float32))
    return g.op("LayerNormalization", [x, scale, bias], axis=-1, epsilon=1e-5)


def _split_heads(g: _Graph, x: str, heads_shape: str) -> str:
    """[B, S, D] -> [B, H, S, hd]."""
    return g.op("Transpose", [g.op("Reshape", [x, heads_shape])], perm=[0, 2, 1, 3])


def _attention(g: _Graph, x: str, layer: int, dims: _Dims, allowed: str, write_at: str) -> str:
    d = dims.d_model
    p = f"layer{layer}.attn"
    h = _layer_norm(g, x, p, d)
    heads_shape = "heads_shape"
    q, k, v = (
        _split_heads(g, g.op("MatMul", [h, g.weight(f"{p}.w{n}", (d, d), d**-0.5)]), heads_shape)
        for n in "qkv"
    )
    keys = g.op(
        "TensorScatter",
        [f"past_key.{layer}", k, write_at],
        retained_name(f"past_key.{layer}"),
        axis=2,
    )
    values = g.op(
        "TensorScatter",
        [f"past_value.{layer}", v, write_at],
        retained_name(f"past_value.{layer}"),
        axis=2,
    )
    keys_t = g.op("Transpose", [keys], perm=[0, 1, 3, 2])
    scores = g.op("Mul", [g.op("MatMul", [q, keys_t]), "attn_scale"])
    probs = g.op("Softmax", [g.op("Where", [allowed, scores, "masked"])], axis=-1)
    context = g.op("Transpose", [g.op("MatMul", [probs, values])], perm=[0, 2, 1, 3])
    merged = g.op("Reshape", [context, "model_shape"])
    out = g.op("MatMul", [merged, g.weight(f"{p}.wo", (d, d), d**-0.5)])
    return g.op("Add", [x, out])


def _mlp(g: _Graph, x: str, layer: int, d_model: int) -> str:
    p = f"layer{layer}.mlp"
    hidden = 4 * d_model
    h = _layer_norm(g, x, p, d_model)
    up = g.op("MatMul", [h, g.weight(f"{p}.w1", (d_model, hidden), d_model**-0.5)])
    up = g.op("Add", [up, g.weight(f"{p}.b1", (hidden,), 0.1)])
    act = g.op("Gelu", [up])
    down = g.op("MatMul", [act, g.weight(f"{p}.w2", (hidden, d_model), hidden**-0.5)])
    down = g.op("Add", [down, g.weight(f"{p}.b2", (d_model,), 0.1)])
    return g.op("Add", [x, down])


def _shared_constants(g: _Graph, dims: _Dims) -> None:
    g.const("heads_shape", np.array([0, 0, dims.heads, dims.head_dim], np.int64))
    g.const("model_shape", np.array([0, 0, dims.d_model], np.int64))
    g.const("attn_scale", np.array(dims.head_dim**-0.5, np.float32))
    g.const("masked", np.array(MASKED, np.float32))
    g.const("cache_rows", np.arange(dims.ctx_len, dtype=np.int64))
    g.const("first_position", np.array(0, np.int64))
    g.const("mask_axes", np.array([1, 3], np.int64))


def _mask_and_write_index(g: _Graph) -> tuple[str, str]:
    """`allowed` [B, 1, S, ctx]: cache row j <= the query's position; write index [B]."""
    positions = g.op("Unsqueeze", ["position_ids", "mask_axes"])  # [B, 1, S, 1]
    allowed = g.op("LessOrEqual", ["cache_rows", positions], "allowed")
    write_at = g.op("Gather", ["position_ids", "first_position"], "write_index", axis=1)
    return allowed, write_at


def kv_decoder(
    vocab: int = 48,
    d_model: int = 32,
    heads: int = 2,
    layers: int = 2,
    ctx_len: int = 24,
    seed: int = 0,
) -> onnx.ModelProto:
    """A pre-LayerNorm decoder with `layers` blocks (attention + GELU MLP) and a KV cache."""
    if d_model % heads:
        raise ValueError(f"d_model {d_model} is not a multiple of heads {heads}")
    dims = _Dims(vocab, d_model, heads, d_model // heads, ctx_len)
    g = _Graph(np.random.default_rng(seed))
    _shared_constants(g, dims)
    tokens = g.op("Gather", [g.weight("tok_emb", (vocab, d_model), 1.0), "input_ids"], axis=0)
    places = g.op("Gather", [g.weight("pos_emb", (ctx_len, d_model), 0.5), "position_ids"], axis=0)
    x = g.op("Add", [tokens, places])
    allowed, write_at = _mask_and_write_index(g)
    for layer in range(layers):
        x = _attention(g, x, layer, dims, allowed, write_at)
        x = _mlp(g, x, layer, d_model)
    final = _layer_norm(g, x, "final", d_model)
    g.op("MatMul", [final, g.weight("lm_head", (d_model, vocab), 4.0 * d_model**-0.5)], "logits")

    cache_dims: list[str | int] = ["batch_size", heads, ctx_len, dims.head_dim]
    token_dims: list[str | int] = ["batch_size", "seq_len"]
    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    inputs = [
        oh.make_tensor_value_info("input_ids", i64, token_dims),
        oh.make_tensor_value_info("position_ids", i64, token_dims),
    ] + [oh.make_tensor_value_info(n, f32, cache_dims) for n in past_names(layers)]
    outputs = [oh.make_tensor_value_info("logits", f32, [*token_dims, vocab])] + [
        oh.make_tensor_value_info(retained_name(n), f32, cache_dims) for n in past_names(layers)
    ]
    graph = oh.make_graph(g.nodes, "kv_decoder", inputs, outputs, initializer=g.inits)
    opsets = [oh.make_opsetid("", OPSET)]
    model = oh.make_model(graph, opset_imports=opsets, producer_name="qpcfarm-tests")
    model.ir_version = oh.find_min_ir_version_for(opsets)
    return model


def cache_shape(model: onnx.ModelProto, batch_size: int = 1) -> tuple[int, ...]:
    """[batch_size, heads, ctx_len, head_dim] of the model's `past_*` inputs."""
    past = next(i for i in model.graph.input if i.name.startswith("past_"))
    dims = past.type.tensor_type.shape.dim
    return (batch_size, *(d.dim_value for d in dims[1:]))


def empty_cache(model: onnx.ModelProto, batch_size: int = 1) -> dict[str, np.ndarray]:
    """Zero `past_*` inputs: the cache before the first prefill."""
    shape = cache_shape(model, batch_size)
    names = [i.name for i in model.graph.input if i.name.startswith("past_")]
    return {name: np.zeros(shape, np.float32) for name in names}


def ort_runner(model: onnx.ModelProto) -> Runner:
    """The model on ONNX Runtime's CPU provider, symbolic dims resolved per call."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3  # TensorScatter warns on every run that it copies the cache
    session = ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    names = [o.name for o in session.get_outputs()]

    def run(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(names, session.run(None, feeds), strict=True))

    return run


@dataclass(frozen=True)
class Generation:
    tokens: list[int]
    """The generated token ids, in order."""
    logits: np.ndarray
    """[new_tokens, vocab]: the logits each token was chosen from (prefill's last position,
    then each decode step's)."""


def greedy_decode(
    run: Runner,
    prompt_ids: np.ndarray,
    new_tokens: int,
    *,
    feed_back: bool,
    cache: Mapping[str, np.ndarray] | None = None,
) -> Generation:
    """Greedy generation: one prefill of the whole prompt, then one decode run per token.

    With `feed_back`, `cache` is the initial `past_*` inputs (see `empty_cache`) and each
    run's `*_RetainedState` outputs are the next run's `past_*` inputs. Without it the runner
    keeps the cache itself: no `past_*` inputs are passed and retained outputs are ignored.
    """
    prompt = np.asarray(prompt_ids, dtype=np.int64)
    if prompt.ndim != 2 or prompt.shape[0] != 1 or prompt.shape[1] == 0:
        raise ValueError(f"prompt_ids must have shape [1, P] with P >= 1, not {prompt.shape}")
    if new_tokens < 1:
        raise ValueError(f"new_tokens must be at least 1, not {new_tokens}")
    if feed_back and cache is None:
        raise ValueError("feed_back=True needs the initial cache (e.g. empty_cache(model))")
    past = dict(cache or {}) if feed_back else {}
    length = prompt.shape[1]
    step_ids, step_positions = prompt, np.arange(length, dtype=np.int64)[None, :]
    tokens: list[int] = []
    chosen: list[np.ndarray] = []
    while True:
        outputs = run({"input_ids": step_ids, "position_ids": step_positions, **past})
        last = np.asarray(outputs["logits"])[0, -1]
        tokens.append(int(np.argmax(last)))
        chosen.append(last)
        if len(tokens) == new_tokens:
            return Generation(tokens, np.stack(chosen))
        if feed_back:
            past = {name: outputs[retained_name(name)] for name in past}
        step_ids = np.array([[tokens[-1]]], np.int64)
        step_positions = np.array([[length]], np.int64)
        length += 1


def generate_with(
    run: Runner,
    prompt_ids: np.ndarray,
    new_tokens: int,
    *,
    feed_back: bool,
    cache: Mapping[str, np.ndarray] | None = None,
) -> list[int]:
    """The greedy token ids `greedy_decode` generates with `run`."""
    return greedy_decode(run, prompt_ids, new_tokens, feed_back=feed_back, cache=cache).tokens


def generate_reference(
    model: onnx.ModelProto, prompt_ids: np.ndarray, new_tokens: int
) -> list[int]:
    """Greedy generation on ONNX Runtime, caches fed back from run to run."""
    return generate_with(
        ort_runner(model), prompt_ids, new_tokens, feed_back=True, cache=empty_cache(model)
    )


def top2_margin(logits: np.ndarray) -> np.ndarray:
    """Per row of [..., vocab] logits: the largest minus the second largest."""
    top = np.sort(logits, axis=-1)
    return np.asarray(top[..., -1] - top[..., -2])
