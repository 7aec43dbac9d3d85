"""Transformer benchmark models built in code: BERT-style encoders and a decoder-only LM with
a KV cache, at real sizes (BERT-base 110 M and BERT-Large 340 M parameters, a 1 B decoder).

Weights are random, written straight to an external data file next to the model (the
generator never holds more than one weight matrix), in float32 or float16. Models are cached
by name: a file that exists is complete (written to a temporary name, then renamed).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 24
_ALIGN = 4096


@dataclass(frozen=True)
class EncoderSpec:
    """A BERT encoder stack (post-LayerNorm, GELU), embeddings excluded: input [B, S, D]."""

    layers: int = 12
    hidden: int = 768
    heads: int = 12
    ffn: int = 3072
    seq: int = 128
    seed: int = 0

    @property
    def name(self) -> str:
        return f"bert-l{self.layers}-h{self.hidden}-a{self.heads}-f{self.ffn}-s{self.seq}"


BERT_BASE = EncoderSpec()
BERT_LARGE = EncoderSpec(layers=24, hidden=1024, heads=16, ffn=4096, seq=384)


@dataclass(frozen=True)
class DecoderSpec:
    """A pre-LayerNorm decoder LM with a KV cache of `ctx` rows per layer (QEfficient-style
    I/O: `input_ids`, `position_ids`, `past_key.{i}`/`past_value.{i}` and their
    `_RetainedState` outputs); `seq` tokens per run (a prefill chunk, or 1 to decode)."""

    layers: int = 20
    hidden: int = 2048
    heads: int = 16
    ffn: int = 8192
    vocab: int = 32000
    ctx: int = 1024
    seq: int | str = 1
    """Tokens per run, or a symbol (`seq_len`) that specializations bind."""
    seed: int = 0

    @property
    def name(self) -> str:
        return (
            f"decoder-l{self.layers}-h{self.hidden}-a{self.heads}-f{self.ffn}-v{self.vocab}"
            f"-c{self.ctx}-s{self.seq}"
        )

    @property
    def parameters(self) -> int:
        per_layer = 4 * self.hidden**2 + 2 * self.hidden * self.ffn
        return self.layers * per_layer + 2 * self.vocab * self.hidden


DECODER_1B_PREFILL = DecoderSpec(seq=128)
DECODER_1B_DECODE = DecoderSpec(seq=1)


class _Builder:
    """Nodes, initializers, and weights streamed to one external data file."""

    def __init__(self, data: IO[bytes], data_name: str, seed: int, dtype: str) -> None:
        self.data = data
        self.data_name = data_name
        self.rng = np.random.default_rng(seed)
        self.dtype = np.dtype(dtype)
        self.onnx_type = TensorProto.FLOAT16 if dtype == "float16" else TensorProto.FLOAT
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[TensorProto] = []
        self.count = 0

    def weight(self, name: str, shape: tuple[int, ...], scale: float) -> str:
        self.data.write(b"\0" * (-self.data.tell() % _ALIGN))
        offset = self.data.tell()
        rows = shape[0]
        per_row = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
        step = max(1, (16 << 20) // max(1, per_row * 4))
        for start in range(0, rows, step):
            n = min(step, rows - start)
            chunk = self.rng.standard_normal((n, per_row), dtype=np.float32) * np.float32(scale)
            self.data.write(chunk.astype(self.dtype).tobytes())
        tensor = TensorProto(name=name, data_type=self.onnx_type, dims=list(shape))
        tensor.data_location = TensorProto.EXTERNAL
        length = self.data.tell() - offset
        for key, value in (("location", self.data_name), ("offset", offset), ("length", length)):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, str(value)
        self.inits.append(tensor)
        return name

    def const(self, name: str, value: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(value, name))
        return name

    def ones(self, name: str, n: int, fill: float) -> str:
        return self.const(name, np.full(n, fill, dtype=self.dtype))

    def op(self, op_type: str, inputs: list[str], out: str | None = None, **attrs: Any) -> str:
        self.count += 1
        name = out or f"{op_type.lower()}_{self.count}"
        self.nodes.append(helper.make_node(op_type, inputs, [name], name=f"n_{name}", **attrs))
        return name

    def dense(self, x: str, name: str, d_in: int, d_out: int, bias: bool = True) -> str:
        y = self.op("MatMul", [x, self.weight(f"{name}.w", (d_in, d_out), d_in**-0.5)])
        if bias:
            y = self.op("Add", [y, self.ones(f"{name}.b", d_out, 0.01)])
        return y

    def layer_norm(self, x: str, name: str, d: int) -> str:
        scale, shift = self.ones(f"{name}.scale", d, 1.0), self.ones(f"{name}.shift", d, 0.0)
        return self.op("LayerNormalization", [x, scale, shift], axis=-1, epsilon=1e-5)


def _write(path: Path, build: Any, seed: int, dtype: str) -> Path:
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    data_name = f"{path.name}.data"
    with open(path.parent / data_name, "wb") as data:
        b = _Builder(data, data_name, seed, dtype)
        graph = build(b)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = helper.find_min_ir_version_for([helper.make_opsetid("", OPSET)])
    tmp = path.with_suffix(".onnx.tmp")
    tmp.write_bytes(model.SerializeToString())
    tmp.replace(path)
    return path


def _heads(b: _Builder, x: str, shape: str) -> str:
    return b.op("Transpose", [b.op("Reshape", [x, shape])], perm=[0, 2, 1, 3])


def write_encoder(spec: EncoderSpec, out_dir: Path, dtype: str = "float32") -> Path:
    """BERT layers: self-attention and a GELU MLP, each followed by Add + LayerNorm."""
    d, h = spec.hidden, spec.heads
    head = d // h

    def build(b: _Builder) -> onnx.GraphProto:
        b.const("heads_shape", np.array([0, 0, h, head], np.int64))
        b.const("model_shape", np.array([0, 0, d], np.int64))
        b.const("scale", np.array(head**-0.5, dtype=b.dtype))
        x = "x"
        for i in range(spec.layers):
            p = f"layer{i}"
            q, k, v = (_heads(b, b.dense(x, f"{p}.{n}", d, d), "heads_shape") for n in "qkv")
            kt = b.op("Transpose", [k], perm=[0, 1, 3, 2])
            scores = b.op("Mul", [b.op("MatMul", [q, kt]), "scale"])
            probs = b.op("Softmax", [scores], axis=-1)
            ctx = b.op("Transpose", [b.op("MatMul", [probs, v])], perm=[0, 2, 1, 3])
            attn = b.dense(b.op("Reshape", [ctx, "model_shape"]), f"{p}.o", d, d)
            x = b.layer_norm(b.op("Add", [x, attn]), f"{p}.ln1", d)
            up = b.op("Gelu", [b.dense(x, f"{p}.up", d, spec.ffn)])
            x = b.layer_norm(b.op("Add", [x, b.dense(up, f"{p}.down", spec.ffn, d)]), f"{p}.ln2", d)
        b.nodes[-1].output[0] = "y"
        dims: list[str | int] = ["batch", spec.seq, d]
        return helper.make_graph(
            b.nodes,
            spec.name,
            [helper.make_tensor_value_info("x", b.onnx_type, dims)],
            [helper.make_tensor_value_info("y", b.onnx_type, dims)],
            b.inits,
        )

    return _write(out_dir / f"{spec.name}-{dtype}.onnx", build, spec.seed, dtype)


def write_decoder(spec: DecoderSpec, out_dir: Path, dtype: str = "float16") -> Path:
    """Token and position embeddings, `layers` pre-LN blocks (attention over the whole cache
    with the new rows scattered in at `position_ids[:, 0]`, GELU MLP), LM head."""
    d, h = spec.hidden, spec.heads
    head = d // h

    def build(b: _Builder) -> onnx.GraphProto:
        b.const("heads_shape", np.array([0, 0, h, head], np.int64))
        b.const("model_shape", np.array([0, 0, d], np.int64))
        b.const("scale", np.array(head**-0.5, dtype=b.dtype))
        b.const("masked", np.array(-1.0e4, dtype=b.dtype))
        b.const("rows", np.arange(spec.ctx, dtype=np.int64))
        b.const("zero", np.array(0, np.int64))
        b.const("mask_axes", np.array([1, 3], np.int64))
        tokens = b.op("Gather", [b.weight("tok_emb", (spec.vocab, d), 1.0), "input_ids"], axis=0)
        places = b.op("Gather", [b.weight("pos_emb", (spec.ctx, d), 0.5), "position_ids"], axis=0)
        x = b.op("Add", [tokens, places])
        allowed = b.op("LessOrEqual", ["rows", b.op("Unsqueeze", ["position_ids", "mask_axes"])])
        write_at = b.op("Gather", ["position_ids", "zero"], axis=1)
        for i in range(spec.layers):
            p = f"layer{i}"
            n = b.layer_norm(x, f"{p}.ln1", d)
            q, k, v = (_heads(b, b.dense(n, f"{p}.{w}", d, d, False), "heads_shape") for w in "qkv")
            keys = b.op(
                "TensorScatter",
                [f"past_key.{i}", k, write_at],
                f"past_key.{i}_RetainedState",
                axis=2,
            )
            values = b.op(
                "TensorScatter",
                [f"past_value.{i}", v, write_at],
                f"past_value.{i}_RetainedState",
                axis=2,
            )
            scores = b.op(
                "Mul", [b.op("MatMul", [q, b.op("Transpose", [keys], perm=[0, 1, 3, 2])]), "scale"]
            )
            probs = b.op("Softmax", [b.op("Where", [allowed, scores, "masked"])], axis=-1)
            ctx = b.op("Transpose", [b.op("MatMul", [probs, values])], perm=[0, 2, 1, 3])
            x = b.op(
                "Add", [x, b.dense(b.op("Reshape", [ctx, "model_shape"]), f"{p}.o", d, d, False)]
            )
            n = b.layer_norm(x, f"{p}.ln2", d)
            up = b.op("Gelu", [b.dense(n, f"{p}.up", d, spec.ffn, False)])
            x = b.op("Add", [x, b.dense(up, f"{p}.down", spec.ffn, d, False)])
        final = b.layer_norm(x, "final", d)
        b.op("MatMul", [final, b.weight("lm_head", (d, spec.vocab), d**-0.5)], "logits")
        cache: list[str | int] = ["batch", h, spec.ctx, head]
        tokens_dims: list[str | int] = ["batch", spec.seq]
        elem = b.onnx_type
        past = [f"past_{kind}.{i}" for i in range(spec.layers) for kind in ("key", "value")]
        inputs = [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, tokens_dims),
            helper.make_tensor_value_info("position_ids", TensorProto.INT64, tokens_dims),
            *(helper.make_tensor_value_info(n, elem, cache) for n in past),
        ]
        outputs = [
            helper.make_tensor_value_info("logits", elem, [*tokens_dims, spec.vocab]),
            *(helper.make_tensor_value_info(f"{n}_RetainedState", elem, cache) for n in past),
        ]
        return helper.make_graph(b.nodes, spec.name, inputs, outputs, b.inits)

    return _write(out_dir / f"{spec.name}-{dtype}.onnx", build, spec.seed, dtype)
