"""A tiny decoder with a continuous-batching KV cache, in the form QEfficient exports one
(`continuous_batching=True`), built with onnx.helper.

Beside `input_ids` / `position_ids` [batch_size, seq_len] it takes `batch_index`
[batch_size, 1]: the cache slot each row of the batch owns. Every `past_key.{i}` /
`past_value.{i}` cache holds `full_batch_size` slots [full_batch_size, heads, ctx_len,
head_dim]; a run of any batch_size <= full_batch_size touches only its rows' slots.

The cache is written and read as QEfficient's `CtxScatterCB` / `CtxGatherCB` functions are
exported: ScatterND with indices [batch, head, position] built at run time (Unsqueeze,
Expand, Concat of `batch_index`, a head Range and `position_ids`), and GatherND of the
batch's slots over the whole context. One deviation: QEfficient's exporter fills the gather
indices past the last position with INT32_MAX (undefined for ONNX's GatherND, refused by
ONNX Runtime); here they stay in range and the attention mask hides them, as it does there.

The rest (embeddings, attention masked by absolute position, MLP) is `tests/decoder_model.py`'s.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
import onnx.helper as oh
from onnx import TensorProto

from tests.decoder_model import (
    OPSET,
    Runner,
    _Dims,
    _Graph,
    _layer_norm,
    _mask_and_write_index,
    _mlp,
    _shared_constants,
    _split_heads,
    past_names,
    retained_name,
)


def _indices(g: _Graph, positions: str, rows: str) -> str:
    """[batch, heads, rows, 3] coordinates (slot, head, position) as CtxScatterCB/GatherCB
    build them: `positions` is [batch, rows] (position_ids, or the context's row numbers)."""
    batch = g.op("Gather", [g.op("Shape", ["batch_index"]), "zero_1d"], axis=0)
    heads = g.op("Gather", [g.op("Shape", ["past_key.0"]), "one_1d"], axis=0)
    length = g.op("Gather", [g.op("Shape", [positions]), "one_1d"], axis=0)
    shape = g.op("Concat", [batch, heads, length, "one_1d"], axis=0)
    slot = g.op("Expand", [g.op("Unsqueeze", ["batch_index", "axes_23"]), shape])
    head_rows = g.op("Range", ["zero", g.op("Squeeze", [heads, "zero_1d"]), "one"])
    head = g.op("Expand", [g.op("Unsqueeze", [head_rows, "axes_023"]), shape])
    where = g.op("Expand", [g.op("Unsqueeze", [positions, "axes_13"]), shape])
    return g.op("Concat", [slot, head, where], axis=3)


def _attention(g: _Graph, x: str, layer: int, dims: _Dims, allowed: str) -> str:
    d = dims.d_model
    p = f"layer{layer}.attn"
    h = _layer_norm(g, x, p, d)
    q, k, v = (
        _split_heads(g, g.op("MatMul", [h, g.weight(f"{p}.w{n}", (d, d), d**-0.5)]), "heads_shape")
        for n in "qkv"
    )
    caches = []
    for kind, update in (("key", k), ("value", v)):
        past = f"past_{kind}.{layer}"
        written = g.op("ScatterND", [past, "scatter_indices", update], retained_name(past))
        caches.append(g.op("GatherND", [written, "gather_indices"]))
    keys, values = caches
    keys_t = g.op("Transpose", [keys], perm=[0, 1, 3, 2])
    scores = g.op("Mul", [g.op("MatMul", [q, keys_t]), "attn_scale"])
    probs = g.op("Softmax", [g.op("Where", [allowed, scores, "masked"])], axis=-1)
    context = g.op("Transpose", [g.op("MatMul", [probs, values])], perm=[0, 2, 1, 3])
    merged = g.op("Reshape", [context, "model_shape"])
    out = g.op("MatMul", [merged, g.weight(f"{p}.wo", (d, d), d**-0.5)])
    return g.op("Add", [x, out])


def cb_decoder(
    vocab: int = 48,
    d_model: int = 32,
    heads: int = 2,
    layers: int = 2,
    ctx_len: int = 24,
    seed: int = 0,
) -> onnx.ModelProto:
    """A pre-LayerNorm decoder whose KV cache has `full_batch_size` slots."""
    dims = _Dims(vocab, d_model, heads, d_model // heads, ctx_len)
    g = _Graph(np.random.default_rng(seed))
    _shared_constants(g, dims)
    for name, value in (
        ("zero", np.array(0, np.int64)),
        ("one", np.array(1, np.int64)),
        ("zero_1d", np.array([0], np.int64)),
        ("one_1d", np.array([1], np.int64)),
        ("axes_23", np.array([2, 3], np.int64)),
        ("axes_023", np.array([0, 2, 3], np.int64)),
        ("axes_13", np.array([1, 3], np.int64)),
        ("axes_0", np.array([0], np.int64)),
    ):
        g.const(name, value)
    tokens = g.op("Gather", [g.weight("tok_emb", (vocab, d_model), 1.0), "input_ids"], axis=0)
    places = g.op("Gather", [g.weight("pos_emb", (ctx_len, d_model), 0.5), "position_ids"], axis=0)
    x = g.op("Add", [tokens, places])
    allowed, _ = _mask_and_write_index(g)
    g.op("Identity", [_indices(g, "position_ids", "seq")], "scatter_indices")
    # every context row of the batch's slots: [batch, ctx] row numbers
    rows = g.op("Expand", [g.op("Unsqueeze", ["cache_rows", "axes_0"]), "batch_rows_shape"])
    g.op("Identity", [_indices(g, rows, "ctx")], "gather_indices")
    batch = g.op("Gather", [g.op("Shape", ["batch_index"]), "zero_1d"], axis=0)
    g.op("Concat", [batch, "ctx_1d"], "batch_rows_shape", axis=0)
    g.const("ctx_1d", np.array([ctx_len], np.int64))
    for layer in range(layers):
        x = _attention(g, x, layer, dims, allowed)
        x = _mlp(g, x, layer, d_model)
    final = _layer_norm(g, x, "final", d_model)
    g.op("MatMul", [final, g.weight("lm_head", (d_model, vocab), 4.0 * d_model**-0.5)], "logits")

    cache_dims: list[str | int] = ["full_batch_size", heads, ctx_len, dims.head_dim]
    token_dims: list[str | int] = ["batch_size", "seq_len"]
    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    inputs = [
        oh.make_tensor_value_info("input_ids", i64, token_dims),
        oh.make_tensor_value_info("position_ids", i64, token_dims),
        oh.make_tensor_value_info("batch_index", i64, ["batch_size", 1]),
    ] + [oh.make_tensor_value_info(n, f32, cache_dims) for n in past_names(layers)]
    outputs = [oh.make_tensor_value_info("logits", f32, [*token_dims, vocab])] + [
        oh.make_tensor_value_info(retained_name(n), f32, cache_dims) for n in past_names(layers)
    ]
    nodes = _topological(g.nodes, {i.name for i in inputs} | {t.name for t in g.inits})
    graph = oh.make_graph(nodes, "cb_decoder", inputs, outputs, initializer=g.inits)
    opsets = [oh.make_opsetid("", OPSET)]
    model = oh.make_model(graph, opset_imports=opsets, producer_name="qpcfarm-tests")
    model.ir_version = oh.find_min_ir_version_for(opsets)
    return model


def _topological(nodes: list[onnx.NodeProto], known: set[str]) -> list[onnx.NodeProto]:
    """The nodes ordered so each follows the producers of its inputs."""
    ready, pending, done = set(known), list(nodes), []
    while pending:
        rest = [n for n in pending if not all(i in ready or not i for i in n.input)]
        for n in pending:
            if n not in rest:
                done.append(n)
                ready.update(n.output)
        if len(rest) == len(pending):
            raise ValueError(f"cycle or missing input at {rest[0].name}")
        pending = rest
    return done


def empty_cb_cache(model: onnx.ModelProto, slots: int) -> dict[str, np.ndarray]:
    """Zero `past_*` inputs of `slots` slots."""
    past = next(i for i in model.graph.input if i.name.startswith("past_"))
    shape = (slots, *(d.dim_value for d in past.type.tensor_type.shape.dim[1:]))
    names = [i.name for i in model.graph.input if i.name.startswith("past_")]
    return {name: np.zeros(shape, np.float32) for name in names}


class FedBack:
    """A runner that keeps the whole cache on the host and feeds it back (ONNX Runtime's side
    of a comparison with a runtime that keeps it as retained state)."""

    def __init__(self, run: Runner, cache: Mapping[str, np.ndarray]) -> None:
        self.run_model, self.cache = run, dict(cache)

    def __call__(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        outputs = self.run_model({**feeds, **self.cache})
        self.cache = {name: outputs[retained_name(name)] for name in self.cache}
        return outputs
