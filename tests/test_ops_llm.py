"""LLM building blocks: LinearAttention, CausalConvWithState, TensorScatter and SwiGLU, compiled
and run on 1 and 4 cores against the ONNX reference (ONNX Runtime does not implement them)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
import onnx.helper as oh
import pytest

from compiler_core.errors import CompileError
from compiler_core.ops.registry import REGISTRY, NodeInfo
from tests.op_checks import assert_matches, one_node_model, rand, run_compiled

# ---------------------------------------------------------------------------------------------
# LinearAttention


def _l2(x: np.ndarray, heads: int) -> np.ndarray:
    """Keys L2-normalised per head, as the delta rules expect."""
    b, t, hidden = x.shape
    h = x.reshape(b, t, heads, hidden // heads)
    return (h / np.linalg.norm(h, axis=-1, keepdims=True)).reshape(b, t, hidden).astype(x.dtype)


def _linear_attention(
    feeds: Mapping[str, np.ndarray],
    *,
    q_heads: int,
    kv_heads: int,
    d_v: int,
    dtype: type = np.float32,
    **attrs: Any,
) -> onnx.ModelProto:
    names = ["query", "key", "value", "past_state", "decay", "beta"]
    node_inputs = [n if n in feeds else "" for n in names]
    while node_inputs[-1] == "":
        node_inputs.pop()
    node = oh.make_node(
        "LinearAttention",
        node_inputs,
        ["output", "present_state"],
        q_num_heads=q_heads,
        kv_num_heads=kv_heads,
        **attrs,
    )
    b, t, q_hidden = feeds["query"].shape
    d_k = q_hidden // q_heads
    outputs = {
        "output": (dtype, (b, t, q_heads * d_v)),
        "present_state": (dtype, (b, kv_heads, d_k, d_v)),
    }
    return one_node_model(node, feeds, outputs, opset=27)


def _la_feeds(
    b: int,
    t: int,
    q_heads: int,
    kv_heads: int,
    d_k: int,
    d_v: int,
    *,
    past: bool = False,
    decay_per_key: bool | None = None,
    beta_heads: int | None = None,
    dtype: type = np.float32,
) -> dict[str, np.ndarray]:
    feeds = {
        "query": rand(b, t, q_heads * d_k, dtype=dtype),
        "key": _l2(rand(b, t, kv_heads * d_k, dtype=dtype), kv_heads),
        "value": rand(b, t, kv_heads * d_v, dtype=dtype),
    }
    if past:
        feeds["past_state"] = (0.5 * rand(b, kv_heads, d_k, d_v)).astype(dtype)
    if decay_per_key is not None:
        width = kv_heads * d_k if decay_per_key else kv_heads
        feeds["decay"] = (-np.abs(rand(b, t, width)) * 0.5).astype(dtype)
    if beta_heads is not None:
        feeds["beta"] = (1 / (1 + np.exp(-rand(b, t, beta_heads)))).astype(dtype)
    return feeds


def test_linear_attention_linear_rule_prefill_matches_reference():
    feeds = _la_feeds(2, 5, 2, 2, 4, 3)
    model = _linear_attention(feeds, q_heads=2, kv_heads=2, d_v=3, update_rule="linear")
    assert_matches(model, feeds, oracle="reference", rtol=1e-4, atol=1e-5)


def test_linear_attention_gated_per_head_decay_with_past_state_matches_reference():
    feeds = _la_feeds(1, 4, 2, 2, 4, 4, past=True, decay_per_key=False)
    model = _linear_attention(feeds, q_heads=2, kv_heads=2, d_v=4, update_rule="gated")
    assert_matches(model, feeds, oracle="reference", rtol=1e-4, atol=1e-5)


def test_linear_attention_delta_rule_with_shared_beta_matches_reference():
    feeds = _la_feeds(2, 3, 2, 2, 4, 2, beta_heads=1)
    model = _linear_attention(feeds, q_heads=2, kv_heads=2, d_v=2, update_rule="delta")
    assert_matches(model, feeds, oracle="reference", rtol=1e-4, atol=1e-5)


def test_linear_attention_gated_delta_gqa_explicit_scale_matches_reference():
    feeds = _la_feeds(2, 4, 4, 2, 4, 3, past=True, decay_per_key=True, beta_heads=2)
    model = _linear_attention(feeds, q_heads=4, kv_heads=2, d_v=3, scale=0.3)
    assert_matches(model, feeds, oracle="reference", rtol=1e-4, atol=1e-5)


def test_linear_attention_gated_delta_decode_step_float16_matches_reference():
    feeds = _la_feeds(
        2, 1, 2, 1, 8, 4, past=True, decay_per_key=True, beta_heads=1, dtype=np.float16
    )
    model = _linear_attention(feeds, q_heads=2, kv_heads=1, d_v=4, dtype=np.float16)
    assert_matches(model, feeds, oracle="reference", rtol=2e-3, atol=2e-3)


def test_linear_attention_unknown_update_rule_is_rejected():
    feeds = _la_feeds(1, 2, 2, 2, 4, 4)
    model = _linear_attention(feeds, q_heads=2, kv_heads=2, d_v=4, update_rule="retnet")
    with pytest.raises(CompileError, match="update_rule"):
        run_compiled(model, feeds)


def test_linear_attention_gated_delta_without_beta_is_rejected():
    feeds = _la_feeds(1, 2, 2, 2, 4, 4, decay_per_key=True)
    model = _linear_attention(feeds, q_heads=2, kv_heads=2, d_v=4)
    with pytest.raises(CompileError, match="beta"):
        run_compiled(model, feeds)


def test_linear_attention_query_heads_not_a_multiple_of_kv_heads_is_rejected():
    feeds = _la_feeds(1, 2, 3, 2, 4, 4, decay_per_key=False, beta_heads=2)
    feeds["query"] = rand(1, 2, 12)
    model = _linear_attention(feeds, q_heads=3, kv_heads=2, d_v=4)
    with pytest.raises(CompileError, match="multiple of kv_num_heads"):
        run_compiled(model, feeds)


def test_linear_attention_kernel_names_an_unknown_update_rule():
    """The op's own check, for models that skip ONNX shape inference."""
    info = NodeInfo(
        op_type="LinearAttention",
        name="la",
        attrs={"q_num_heads": 2, "kv_num_heads": 2, "update_rule": "retnet"},
        in_shapes=((1, 2, 8), (1, 2, 8), (1, 2, 8)),
        in_dtypes=("float32",) * 3,
        out_shapes=((1, 2, 8), (1, 2, 4, 4)),
        out_dtypes=("float32",) * 2,
        opset=27,
    )
    opdef = REGISTRY.lookup("LinearAttention", opset=27)
    assert opdef is not None
    with pytest.raises(CompileError, match="update_rule 'retnet' is not one of") as err:
        opdef.split_axes(info)
    assert err.value.code == "invalid_model"


# ---------------------------------------------------------------------------------------------
# CausalConvWithState


def _causal_conv(
    feeds: Mapping[str, np.ndarray], taps: int, dtype: type = np.float32, **attrs: Any
) -> onnx.ModelProto:
    names = ["input", "weight", "bias", "past_state"]
    node_inputs = [n if n in feeds else "" for n in names]
    while node_inputs[-1] == "":
        node_inputs.pop()
    node = oh.make_node("CausalConvWithState", node_inputs, ["output", "present_state"], **attrs)
    b, c, length = feeds["input"].shape
    outputs = {"output": (dtype, (b, c, length)), "present_state": (dtype, (b, c, taps - 1))}
    return one_node_model(node, feeds, outputs, opset=27)


def test_causal_conv_zero_padded_start_matches_reference():
    feeds = {"input": rand(2, 3, 7), "weight": rand(3, 1, 4)}
    assert_matches(_causal_conv(feeds, 4), feeds, oracle="reference")


def test_causal_conv_bias_past_state_and_silu_matches_reference():
    feeds = {
        "input": rand(2, 3, 5),
        "weight": rand(3, 1, 3),
        "bias": rand(3),
        "past_state": rand(2, 3, 2),
    }
    assert_matches(_causal_conv(feeds, 3, activation="silu"), feeds, oracle="reference")


def test_causal_conv_input_shorter_than_state_keeps_part_of_the_past_matches_reference():
    feeds = {"input": rand(1, 2, 2), "weight": rand(2, 1, 5), "past_state": rand(1, 2, 4)}
    assert_matches(_causal_conv(feeds, 5, activation="swish"), feeds, oracle="reference")


def test_causal_conv_float16_decode_step_matches_reference():
    feeds = {
        "input": rand(2, 4, 1, dtype=np.float16),
        "weight": rand(4, 1, 4, dtype=np.float16),
        "past_state": rand(2, 4, 3, dtype=np.float16),
    }
    model = _causal_conv(feeds, 4, dtype=np.float16, activation="silu")
    assert_matches(model, feeds, oracle="reference", rtol=1e-3, atol=1e-3)


def test_causal_conv_unknown_activation_is_rejected():
    feeds = {"input": rand(1, 2, 4), "weight": rand(2, 1, 3)}
    model = _causal_conv(feeds, 3, activation="gelu")
    with pytest.raises(CompileError, match="activation.*'gelu'"):
        run_compiled(model, feeds)


def test_causal_conv_kernel_names_a_weight_that_is_not_depthwise():
    """The op's own check, for models that skip ONNX shape inference."""
    info = NodeInfo(
        op_type="CausalConvWithState",
        name="conv",
        attrs={},
        in_shapes=((1, 2, 4), (2, 2, 3)),
        in_dtypes=("float32",) * 2,
        out_shapes=((1, 2, 4), (1, 2, 2)),
        out_dtypes=("float32",) * 2,
        opset=27,
    )
    opdef = REGISTRY.lookup("CausalConvWithState", opset=27)
    assert opdef is not None
    with pytest.raises(CompileError, match=r"weight shape \(2, 2, 3\) is not \(2, 1, k\)") as err:
        opdef.split_axes(info)
    assert err.value.code == "invalid_model"


# ---------------------------------------------------------------------------------------------
# TensorScatter


def _tensor_scatter(feeds: Mapping[str, np.ndarray], **attrs: Any) -> onnx.ModelProto:
    names = [n for n in ("past_cache", "update", "write_indices") if n in feeds]
    node = oh.make_node("TensorScatter", names, ["present_cache"], **attrs)
    cache = feeds["past_cache"]
    return one_node_model(node, feeds, {"present_cache": (cache.dtype, cache.shape)}, opset=24)


def test_tensor_scatter_linear_writes_at_each_batch_index_matches_onnxruntime():
    feeds = {
        "past_cache": rand(3, 2, 6, 4),
        "update": rand(3, 2, 2, 4),
        "write_indices": np.array([0, 3, 4], np.int64),
    }
    assert_matches(_tensor_scatter(feeds), feeds)


def test_tensor_scatter_without_indices_writes_the_prefix_matches_onnxruntime():
    feeds = {"past_cache": rand(2, 5, 3), "update": rand(2, 3, 3)}
    assert_matches(_tensor_scatter(feeds, axis=1), feeds)


def test_tensor_scatter_circular_wraps_around_matches_onnxruntime():
    feeds = {
        "past_cache": rand(2, 4, 3),
        "update": rand(2, 3, 3),
        "write_indices": np.array([2, 7], np.int64),
    }
    assert_matches(_tensor_scatter(feeds, axis=1, mode="circular"), feeds)


def test_tensor_scatter_int64_cache_on_inner_axis_matches_onnxruntime():
    feeds = {
        "past_cache": np.arange(2 * 3 * 6, dtype=np.int64).reshape(2, 3, 6),
        "update": -np.arange(2 * 3 * 2, dtype=np.int64).reshape(2, 3, 2) - 1,
        "write_indices": np.array([1, 4], np.int64),
    }
    assert_matches(_tensor_scatter(feeds, axis=-1), feeds)


def test_tensor_scatter_linear_write_past_the_end_is_a_runtime_fault():
    feeds = {
        "past_cache": rand(2, 4, 3),
        "update": rand(2, 2, 3),
        "write_indices": np.array([0, 3], np.int64),
    }
    with pytest.raises(CompileError, match="write index 3 for batch 1") as err:
        run_compiled(_tensor_scatter(feeds, axis=1), feeds)
    assert err.value.code == "runtime_fault"


def test_tensor_scatter_on_the_batch_axis_is_rejected():
    feeds = {"past_cache": rand(4, 3), "update": rand(4, 3)}
    with pytest.raises(CompileError, match="axis"):
        run_compiled(_tensor_scatter(feeds, axis=0), feeds)


def test_tensor_scatter_update_longer_than_the_cache_is_rejected():
    feeds = {"past_cache": rand(2, 4, 3), "update": rand(2, 5, 3)}
    model = _tensor_scatter(feeds, axis=1, mode="circular")
    with pytest.raises(CompileError, match="update length 5 exceeds cache length 4") as err:
        run_compiled(model, feeds)
    assert err.value.code == "invalid_model"


# ---------------------------------------------------------------------------------------------
# SwiGLU


def _swiglu(a: np.ndarray, **attrs: Any) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    feeds = {"A": a, "B": rand(*a.shape, dtype=a.dtype)}
    node = oh.make_node("SwiGLU", ["A", "B"], ["Y"], **attrs)
    return one_node_model(node, feeds, {"Y": (a.dtype, a.shape)}, opset=28), feeds


def test_swiglu_default_alpha_tiled_across_cores_matches_reference():
    model, feeds = _swiglu(rand(64, 96) * 3)
    assert_matches(model, feeds, oracle="reference")


def test_swiglu_alpha_scales_the_gate_matches_reference():
    model, feeds = _swiglu(rand(2, 3, 5), alpha=1.702)
    assert_matches(model, feeds, oracle="reference")


def test_swiglu_float16_rounds_like_swish_then_mul_matches_reference():
    # The reference rounds every step of the function body (Sigmoid, Mul, ...) to float16,
    # we round the Swish once: a few float16 ulps (2**-10 relative each) apart at most.
    x = np.random.default_rng(21).standard_normal((4, 33)).astype(np.float16) * 4
    model, feeds = _swiglu(x)
    assert_matches(model, feeds, oracle="reference", rtol=4e-3, atol=1e-3)


def test_swiglu_as_epilogue_of_the_gate_projection_matches_reference():
    x, w = rand(8, 16), rand(16, 24)
    b = rand(8, 24)
    nodes = [
        oh.make_node("MatMul", ["X", "W"], ["A"]),
        oh.make_node("SwiGLU", ["A", "B"], ["Y"]),
    ]
    graph = oh.make_graph(
        nodes,
        "gated_mlp",
        [
            oh.make_tensor_value_info("X", onnx.TensorProto.FLOAT, [8, 16]),
            oh.make_tensor_value_info("B", onnx.TensorProto.FLOAT, [8, 24]),
        ],
        [oh.make_tensor_value_info("Y", onnx.TensorProto.FLOAT, [8, 24])],
        initializer=[onnx.numpy_helper.from_array(w, "W")],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 28)])
    model.ir_version = 10
    assert_matches(model, {"X": x, "B": b}, oracle="reference", rtol=1e-4, atol=1e-5)


def test_swiglu_kernel_names_gate_and_value_of_different_shapes():
    """The op's own check, for models that skip ONNX shape inference."""
    info = NodeInfo(
        op_type="SwiGLU",
        name="glu",
        attrs={},
        in_shapes=((2, 4), (1, 4)),
        in_dtypes=("float32",) * 2,
        out_shapes=((2, 4),),
        out_dtypes=("float32",),
        opset=28,
    )
    opdef = REGISTRY.lookup("SwiGLU", opset=28)
    assert opdef is not None
    with pytest.raises(CompileError, match="must have the same shape") as err:
        opdef.split_axes(info)
    assert err.value.code == "invalid_model"
