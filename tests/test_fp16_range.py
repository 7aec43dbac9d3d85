"""float16's range under -convert-to-fp16: a MatMul scaled down by a constant (attention
scores before 1/sqrt(d)) is computed with the scale folded into an operand, so scores whose
unscaled products pass 65,504 come out finite and match ONNX Runtime fp32; a node whose range
the compiler cannot guarantee from what it knows is named in an `fp16_range` warning with the
-node-precision-info line that keeps it in float32 (and that line works)."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import onnx_ir as ir
import pytest
from onnx import TensorProto
from onnx import numpy_helper as nh

from compiler_core import compile_model, run_qpc
from compiler_core.passes import FoldMatMulScalePass
from compiler_core.runtime.numerics import NonFiniteWarning
from tests.op_checks import run_onnxruntime

FP16_MAX = 65504.0
SEQ = 16


def attention_scores(op: str, head: int, scale: float) -> onnx.ModelProto:
    """scores = MatMul(q, Transpose(k)) then `op` (Mul or Div) by the constant `scale`."""
    nodes = [
        oh.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1], name="k_t"),
        oh.make_node("MatMul", ["q", "kt"], ["s"], name="scores"),
        oh.make_node(op, ["s", "c"], ["y"], name="scale"),
    ]
    return _model(
        nodes,
        {"q": [1, SEQ, head], "k": [1, SEQ, head]},
        {"y": [1, SEQ, SEQ]},
        {"c": np.array(scale, np.float32)},
    )


def attention_block(hidden: int = 32, heads: int = 2, seed: int = 0) -> onnx.ModelProto:
    """Projections, heads, scores Div sqrt(d), Softmax, weighted values: the scale can go into
    the Q projection's weight and bias."""
    rng = np.random.default_rng(seed)
    head = hidden // heads
    inits = {
        "wq": rng.normal(0, 1.0, (hidden, hidden)).astype(np.float32),
        "bq": rng.normal(0, 1.0, (hidden,)).astype(np.float32),
        "wk": rng.normal(0, 1.0, (hidden, hidden)).astype(np.float32),
        "wv": rng.normal(0, 0.1, (hidden, hidden)).astype(np.float32),
        "split": np.array([1, SEQ, heads, head], np.int64),
        "sqrt_d": np.array(np.sqrt(head) * 1.25, np.float32),  # not a power of two
    }
    n = oh.make_node
    nodes = [
        n("MatMul", ["x", "wq"], ["q0"], name="q_proj"),
        n("Add", ["q0", "bq"], ["q1"], name="q_bias"),
        n("Reshape", ["q1", "split"], ["q2"], name="q_split"),
        n("Transpose", ["q2"], ["q"], perm=[0, 2, 1, 3], name="q_t"),
        n("MatMul", ["x", "wk"], ["k0"], name="k_proj"),
        n("Reshape", ["k0", "split"], ["k2"], name="k_split"),
        n("Transpose", ["k2"], ["kt"], perm=[0, 2, 3, 1], name="k_t"),
        n("MatMul", ["x", "wv"], ["v0"], name="v_proj"),
        n("Reshape", ["v0", "split"], ["v2"], name="v_split"),
        n("Transpose", ["v2"], ["v"], perm=[0, 2, 1, 3], name="v_t"),
        n("MatMul", ["q", "kt"], ["s0"], name="scores"),
        n("Div", ["s0", "sqrt_d"], ["s1"], name="scale"),
        n("Softmax", ["s1"], ["p"], axis=-1, name="softmax"),
        n("MatMul", ["p", "v"], ["y"], name="attend"),
    ]
    return _model(nodes, {"x": [1, SEQ, hidden]}, {"y": [1, heads, SEQ, head]}, inits)


def _model(nodes, inputs, outputs, inits, opset: int = 17) -> onnx.ModelProto:
    graph = oh.make_graph(
        nodes,
        "g",
        [oh.make_tensor_value_info(k, TensorProto.FLOAT, v) for k, v in inputs.items()],
        [oh.make_tensor_value_info(k, TensorProto.FLOAT, v) for k, v in outputs.items()],
        [nh.from_array(v, k) for k, v in inits.items()],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def large_qk(head: int, seed: int = 0) -> dict[str, np.ndarray]:
    """q and k (within float16) whose products sum past 65,504 in every score."""
    rng = np.random.default_rng(seed)
    q = (rng.normal(0, 20, (1, SEQ, head)) + 60).astype(np.float32)
    k = (rng.normal(0, 20, (1, SEQ, head)) + 60).astype(np.float32)
    return {"q": q, "k": k}


def unfused_fp16_scores(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """The float16 program without the fold: fp16 operands, fp32 accumulation, the MatMul's
    result stored in float16 before the scale."""
    q16, k16 = q.astype(np.float16).astype(np.float32), k.astype(np.float16).astype(np.float32)
    with np.errstate(over="ignore"):
        return (q16 @ np.swapaxes(k16, -1, -2)).astype(np.float16)


def assert_fp16_close(ours: np.ndarray, ref: np.ndarray) -> None:
    """docs/compiler.md's fp16 tolerance (rtol 1e-2, atol 1e-2 on order-1 values), the atol
    taken relative to the largest output."""
    assert np.isfinite(ours).all()
    np.testing.assert_allclose(ours, ref, rtol=1e-2, atol=1e-2 * float(np.abs(ref).max()))


def kernels(result) -> list[tuple[str, tuple[str, ...], str]]:
    return [(k.info.op_type, tuple(k.nodes), k.info.out_dtypes[0]) for k in result.program.kernels]


@pytest.mark.parametrize(
    ("op", "head", "scale"),
    [("Div", 80, float(np.sqrt(80))), ("Mul", 64, 0.125), ("Div", 64, 8.0)],
    ids=["div-sqrt80", "mul-eighth", "div-eight"],
)
def test_scaled_scores_past_fp16_max_come_out_finite_and_match_fp32(op, head, scale):
    model = attention_scores(op, head, scale)
    feeds = large_qk(head)
    assert np.isinf(unfused_fp16_scores(feeds["q"], feeds["k"])).any()  # what the fold avoids
    (ref,) = run_onnxruntime(model, feeds)
    assert np.abs(ref).max() < FP16_MAX < np.abs(ref * (scale if op == "Div" else 1 / scale)).max()
    result = compile_model(model, ["-convert-to-fp16"])
    ops = kernels(result)
    matmul = next(k for k in ops if k[0] == "MatMul")
    assert matmul[1] == ("scores", "scale") and matmul[2] == "float16", ops
    assert not [k for k in ops if k[1] == ("scale",)], ops  # the scale runs before the MatMul
    assert not [w for w in result.warnings if w["code"] == "fp16_range"]
    assert_fp16_close(run_qpc(result.qpc_path, feeds)["y"], ref)
    result.cleanup()


def test_without_the_fold_the_same_program_overflows(monkeypatch):
    """The test above can fail: with the fold switched off the QPC gives infinities."""
    model = attention_scores("Div", 80, float(np.sqrt(80)))
    monkeypatch.setattr(
        FoldMatMulScalePass, "call", lambda self, m: ir.passes.PassResult(m, modified=False)
    )
    result = compile_model(model, ["-convert-to-fp16"])
    with pytest.warns(NonFiniteWarning):
        out = run_qpc(result.qpc_path, large_qk(80))["y"]
    assert np.isinf(out).any()
    result.cleanup()


def test_a_scale_folds_into_the_projection_constants_without_a_new_kernel():
    model = attention_block()
    rng = np.random.default_rng(5)
    feeds = {"x": (rng.normal(0, 20, (1, SEQ, 32))).astype(np.float32)}
    (ref,) = run_onnxruntime(model, feeds)
    plain = compile_model(model)
    result = compile_model(model, ["-convert-to-fp16"])
    ops = kernels(result)
    assert not [k for k in ops if k[0] in ("Mul", "Div")], ops  # no kernel for the scale
    assert len([k for k in ops if k[0] != "Cast"]) <= len(kernels(plain)), ops
    scores = next(k for k in ops if "scores" in k[1])
    assert "scale" in scores[1]
    # the Q projection's scores overflow float16 unless the scale went in before
    (q,) = run_onnxruntime(_probe(model, "q"), feeds)
    (kt,) = run_onnxruntime(_probe(model, "kt"), feeds)
    assert np.isinf(unfused_fp16_scores(q, np.swapaxes(kt, -1, -2))).any()
    assert_fp16_close(run_qpc(result.qpc_path, feeds)["y"], ref)
    result.cleanup()
    plain.cleanup()


def _probe(model: onnx.ModelProto, name: str) -> onnx.ModelProto:
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    del probe.graph.output[:]
    probe.graph.output.append(oh.make_tensor_value_info(name, TensorProto.FLOAT, None))
    return probe


def test_the_folded_scale_node_can_still_be_named_for_float32(tmp_path: Path):
    model = attention_scores("Div", 80, float(np.sqrt(80)))
    keep = tmp_path / "keep.yaml"
    keep.write_text("FP32NodeInstanceNames: [scale]\n")
    result = compile_model(model, ["-convert-to-fp16", f"-node-precision-info={keep}"])
    matmul = next(k for k in kernels(result) if k[0] == "MatMul")
    assert matmul[2] == "float32"  # named by its scale: the pair stays float32, unfolded
    feeds = large_qk(80)
    (ref,) = run_onnxruntime(model, feeds)
    assert_fp16_close(run_qpc(result.qpc_path, feeds)["y"], ref)
    result.cleanup()


def test_a_scale_of_one_or_more_is_left_where_it_is():
    model = attention_scores("Mul", 16, 2.0)
    result = compile_model(model, ["-convert-to-fp16"])
    matmul = next(k for k in kernels(result) if k[0] == "MatMul")
    assert matmul[1] == ("scores", "scale")  # fused as the MatMul's epilogue, as before
    result.cleanup()


def test_a_scale_too_small_to_fold_keeps_the_matmul_in_float32():
    model = attention_scores("Mul", 64, 1e-6)
    feeds = large_qk(64)
    result = compile_model(model, ["-convert-to-fp16"])
    matmul = next(k for k in kernels(result) if k[0] == "MatMul")
    assert matmul[2] == "float32", kernels(result)
    (ref,) = run_onnxruntime(model, feeds)
    assert_fp16_close(run_qpc(result.qpc_path, feeds)["y"], ref)
    result.cleanup()


# -- the warning ----------------------------------------------------------------------------


def bounded_int8_matmul(weight: float, width: int = 64) -> onnx.ModelProto:
    """int8 input -> Cast -> MatMul with constant weights: |y| <= 128 * width * weight."""
    graph = oh.make_graph(
        [
            oh.make_node("Cast", ["x"], ["xf"], to=TensorProto.FLOAT, name="to_float"),
            oh.make_node("MatMul", ["xf", "w"], ["y"], name="dense"),
        ],
        "g",
        [oh.make_tensor_value_info("x", TensorProto.INT8, [2, width])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])],
        [nh.from_array(np.full((width, 8), weight, np.float32), "w")],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def range_warning(result) -> dict | None:
    return next((w for w in result.warnings if w["code"] == "fp16_range"), None)


def test_a_matmul_whose_bound_passes_fp16_max_is_named_with_the_fix_that_works(tmp_path):
    model = bounded_int8_matmul(10.0)  # 128 * 64 * 10 = 81,920
    result = compile_model(model, ["-convert-to-fp16"])
    warning = range_warning(result)
    assert warning is not None and warning["kind"] == "precision"
    assert warning["nodes"] == ["dense"]
    assert "dense (up to 8.19e+04)" in warning["message"]
    assert "FP32NodeInstanceNames: [dense]" in warning["suggestion"]
    feeds = {"x": np.full((2, 64), 127, np.int8)}  # the bound is reached: it overflows
    with pytest.warns(NonFiniteWarning):
        assert np.isinf(run_qpc(result.qpc_path, feeds)["y"]).all()
    result.cleanup()

    keep = tmp_path / "keep.yaml"
    keep.write_text("FP32NodeInstanceNames: [dense]\n")
    fixed = compile_model(model, ["-convert-to-fp16", f"-node-precision-info={keep}"])
    assert range_warning(fixed) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error", NonFiniteWarning)
        ours = run_qpc(fixed.qpc_path, feeds)["y"]
    (ref,) = run_onnxruntime(model, feeds)
    np.testing.assert_allclose(ours, ref, rtol=1e-3)
    fixed.cleanup()


def test_a_bound_within_fp16_warns_nothing():
    result = compile_model(bounded_int8_matmul(5.0), ["-convert-to-fp16"])  # 40,960
    assert range_warning(result) is None
    result.cleanup()


def sigmoid_into(op: str, weight: float) -> onnx.ModelProto:
    """x -> Sigmoid (within [0, 1] whatever x) -> Gemm or Conv with constant weights."""
    if op == "Gemm":
        nodes = [
            oh.make_node("Sigmoid", ["x"], ["s"], name="gate"),
            oh.make_node("Gemm", ["s", "w", "b"], ["y"], transB=1, name="head"),
        ]
        inits = {
            "w": np.full((4, 1024), weight, np.float32),
            "b": np.full((4,), 1.0, np.float32),
        }
        return _model(nodes, {"x": [1, 1024]}, {"y": [1, 4]}, inits)
    nodes = [
        oh.make_node("Sigmoid", ["x"], ["s"], name="gate"),
        oh.make_node("Conv", ["s", "w"], ["y"], pads=[1, 1, 1, 1], name="head"),
    ]
    inits = {"w": np.full((2, 64, 3, 3), weight, np.float32)}
    return _model(nodes, {"x": [1, 64, 4, 4]}, {"y": [1, 2, 4, 4]}, inits)


@pytest.mark.parametrize(("op", "large", "small"), [("Gemm", 70.0, 60.0), ("Conv", 120.0, 100.0)])
def test_gemm_and_conv_after_a_bounded_op_are_judged_by_their_weights(op, large, small):
    # Gemm: 1024 * w + 1; Conv: 64 * 3 * 3 * w
    flagged = compile_model(sigmoid_into(op, large), ["-convert-to-fp16"])
    warning = range_warning(flagged)
    assert warning is not None and warning["nodes"] == ["head"]
    flagged.cleanup()
    quiet = compile_model(sigmoid_into(op, small), ["-convert-to-fp16"])
    assert range_warning(quiet) is None
    quiet.cleanup()


def softmax_weighted(values: float) -> onnx.ModelProto:
    """Softmax(x) @ V: each result a weighted mean of V's values, whatever the length."""
    nodes = [
        oh.make_node("Softmax", ["x"], ["p"], axis=-1, name="weights"),
        oh.make_node("MatMul", ["p", "v"], ["y"], name="mix"),
    ]
    inits = {"v": np.full((4096, 8), values, np.float32)}
    return _model(nodes, {"x": [2, 4096]}, {"y": [2, 8]}, inits)


def test_softmax_rows_bound_a_matmul_by_its_values_not_their_count():
    result = compile_model(softmax_weighted(60000.0), ["-convert-to-fp16"])
    assert range_warning(result) is None  # 4096 * 60,000 would be the naive bound
    result.cleanup()


def test_float_inputs_of_unknown_range_are_not_judged():
    model = attention_scores("Mul", 64, 2.0)  # q, k: graph inputs, anything in float16
    result = compile_model(model, ["-convert-to-fp16"])
    assert range_warning(result) is None
    result.cleanup()


def test_fp16_nodes_in_a_float32_network_are_checked_and_folded_too(tmp_path):
    only = tmp_path / "fp16.yaml"
    only.write_text("FP16NodeInstanceNames: [dense]\n")
    result = compile_model(bounded_int8_matmul(10.0), [f"-node-precision-info={only}"])
    warning = range_warning(result)
    assert warning is not None and warning["nodes"] == ["dense"]
    result.cleanup()
    model = attention_scores("Div", 80, float(np.sqrt(80)))
    result = compile_model(model, ["-execute-nodes-in-fp16=MatMul,Div"])
    feeds = large_qk(80)
    (ref,) = run_onnxruntime(model, feeds)
    assert_fp16_close(run_qpc(result.qpc_path, feeds)["y"], ref)
    result.cleanup()


def test_a_constant_that_the_scale_would_flush_to_zero_is_left_and_the_activation_scaled():
    """W * 1/8 would drop W's float16 subnormals to 0: x is scaled instead, W kept."""
    weights = np.full((64, 8), 1e-7, np.float32)
    graph = oh.make_graph(
        [
            oh.make_node("MatMul", ["x", "w"], ["m"], name="dense"),
            oh.make_node("Mul", ["m", "c"], ["y"], name="scale"),
        ],
        "g",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])],
        [nh.from_array(weights, "w"), nh.from_array(np.array(0.125, np.float32), "c")],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    result = compile_model(model, ["-convert-to-fp16"])
    ops = kernels(result)
    assert [k[1] for k in ops if k[0] == "Mul"] == [("dense/mul_0",)], ops
    assert next(k for k in ops if k[0] == "MatMul")[1] == ("dense", "scale")
    result.cleanup()


def normed_scores(sigma: float, hidden: int = 64, seed: int = 0) -> onnx.ModelProto:
    """LayerNormalization, then q = n Wq, k = n Wk and q k^T: |n| <= sqrt(64) = 8, so every
    score is at most (8 |Wq|_F)(8 |Wk|_F) = (512 sigma)^2 (Cauchy-Schwarz), where intervals
    would allow 64 |q|max |k|max, some 40x more."""
    rng = np.random.default_rng(seed)
    inits = {
        "gamma": np.ones(hidden, np.float32),
        "beta": np.zeros(hidden, np.float32),
        "wq": rng.normal(0, sigma, (hidden, hidden)).astype(np.float32),
        "wk": rng.normal(0, sigma, (hidden, hidden)).astype(np.float32),
    }
    nodes = [
        oh.make_node("LayerNormalization", ["x", "gamma", "beta"], ["n"], axis=-1, name="ln"),
        oh.make_node("MatMul", ["n", "wq"], ["q"], name="q_proj"),
        oh.make_node("MatMul", ["n", "wk"], ["k"], name="k_proj"),
        oh.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1], name="k_t"),
        oh.make_node("MatMul", ["q", "kt"], ["y"], name="scores"),
    ]
    return _model(nodes, {"x": [1, SEQ, hidden]}, {"y": [1, SEQ, SEQ]}, inits)


def test_attention_scores_after_a_layer_norm_are_bounded_by_vector_norms():
    quiet = compile_model(normed_scores(0.4), ["-convert-to-fp16"])  # <= 41,943
    assert range_warning(quiet) is None
    quiet.cleanup()
    flagged = compile_model(normed_scores(0.6), ["-convert-to-fp16"])  # <= 94,372
    warning = range_warning(flagged)
    assert warning is not None and warning["nodes"] == ["scores"]
    flagged.cleanup()
