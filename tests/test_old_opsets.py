"""Models at the classic model zoo's opsets (7-9): quantizing raises the model's opset before it
writes QuantizeLinear/DequantizeLinear (opset 10+, `axis` 13+, 16-bit 21+), so the program
compiles and matches the float model; every pass that inserts operators leaves a graph that is
valid ONNX at the opset the model then declares (ONNX's checker and ONNX Runtime say so)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx.helper as oh
import onnx_ir as ir
import pytest
from onnx import TensorProto
from onnx import numpy_helper as nh

from compiler_core.compile import compile_model
from compiler_core.errors import CompileError
from compiler_core.importer import dynamic_values, import_model
from compiler_core.options import CompileOptions
from compiler_core.passes import graph_pipeline, run_passes
from compiler_core.passes.base import model_opset
from compiler_core.passes.pipeline import without_epilogue_fusion
from compiler_core.passes.raise_opset import raise_opset
from compiler_core.runtime import run_qpc
from tests.quant_models import output_scales, run_ort

INT8_TOLERANCE = 0.03
"""Max error over the largest float output, as tests/test_quantization_calibration.py holds
int8 programs to."""


def cnn(opset: int, seed: int = 0) -> onnx.ModelProto:
    """Conv, BatchNormalization, Relu, MaxPool, a residual Conv + Add, AveragePool, Reshape,
    Gemm (a classic ResNet's tail), in the forms `opset` defines (BatchNormalization-7 still
    has `spatial`)."""
    rng = np.random.default_rng(seed)
    inits = {
        "w1": rng.normal(0, 0.3, (8, 3, 3, 3)).astype(np.float32),
        "b1": rng.normal(0, 0.1, (8,)).astype(np.float32),
        "gamma": rng.uniform(0.5, 1.5, (8,)).astype(np.float32),
        "beta": rng.normal(0, 0.1, (8,)).astype(np.float32),
        "mean": rng.normal(0, 0.1, (8,)).astype(np.float32),
        "var": rng.uniform(0.5, 1.5, (8,)).astype(np.float32),
        "w2": rng.normal(0, 0.2, (8, 8, 3, 3)).astype(np.float32),
        "shape": np.array([1, 32], np.int64),
        "fw": rng.normal(0, 0.3, (10, 32)).astype(np.float32),
        "fb": rng.normal(0, 0.1, (10,)).astype(np.float32),
    }
    bn: dict[str, Any] = {"epsilon": 1e-5}
    if opset < 9:
        bn["spatial"] = 1
    nodes = [
        oh.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        oh.make_node("BatchNormalization", ["c1", "gamma", "beta", "mean", "var"], ["n1"], **bn),
        oh.make_node("Relu", ["n1"], ["r1"]),
        oh.make_node("MaxPool", ["r1"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
        oh.make_node("Conv", ["p", "w2"], ["c2"], pads=[1, 1, 1, 1]),
        oh.make_node("Add", ["c2", "p"], ["a"]),
        oh.make_node("Relu", ["a"], ["r2"]),
        oh.make_node("AveragePool", ["r2"], ["p2"], kernel_shape=[4, 4], strides=[4, 4]),
        oh.make_node("Reshape", ["p2", "shape"], ["f"]),
        oh.make_node("Gemm", ["f", "fw", "fb"], ["y"], transB=1),
    ]
    return _model(nodes, [("x", [1, 3, 16, 16])], [("y", [1, 10])], inits, opset)


def _model(
    nodes: list[onnx.NodeProto],
    inputs: list[tuple[str, list[int]]],
    outputs: list[tuple[str, list[int] | None]],
    inits: dict[str, np.ndarray],
    opset: int,
) -> onnx.ModelProto:
    graph = oh.make_graph(
        nodes,
        f"opset{opset}",
        [oh.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
        [oh.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in outputs],
        [nh.from_array(v, k) for k, v in inits.items()],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset)])
    model.ir_version = 4
    onnx.checker.check_model(model, full_check=True)
    return model


def samples(count: int, seed: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 1, (count, 1, 3, 16, 16)).astype(np.float32)


def relative_error(result: Any, model: onnx.ModelProto, xs: np.ndarray) -> float:
    worst = 0.0
    for x in xs:
        ours = run_qpc(result.qpc_path, {"x": x})["y"]
        (ref,) = run_ort(model, {"x": x})
        worst = max(worst, float(np.abs(ours - ref).max() / np.abs(ref).max()))
    return worst


@pytest.fixture(scope="module", params=[7, 8, 9])
def dumped(request, tmp_path_factory):
    """An old-opset CNN, its calibration set, and the profile -dump-profile wrote for it
    (that compile quantizes too: it must get through)."""
    opset = request.param
    root = tmp_path_factory.mktemp(f"opset{opset}")
    model = cnn(opset)
    onnx.save(model, root / "model.onnx")
    np.savez(root / "calib.npz", x=samples(6))
    profile = root / "profile.json"
    result = compile_model(
        root / "model.onnx",
        [f"-dump-profile={profile}", f"-input-list-file={root / 'calib.npz'}"],
    )
    kernels = {k.info.op_type for k in result.program.kernels}
    result.cleanup()
    return opset, root, model, profile, kernels


def test_dump_profile_quantizes_an_old_opset_cnn(dumped):
    opset, _, _, profile, kernels = dumped
    assert profile.is_file()
    assert {"QConv", "QMatMul"} <= kernels, (opset, kernels)
    assert not {"QuantizeLinear", "Conv", "Gemm"} & (kernels - {"QuantizeLinear"})


@pytest.mark.parametrize("flags", [[], ["-enable-channelwise"]], ids=["per-tensor", "channelwise"])
def test_load_profile_compiles_an_old_opset_cnn_close_to_float(dumped, flags):
    opset, root, model, profile, _ = dumped
    result = compile_model(root / "model.onnx", [f"-load-profile={profile}", *flags])
    ops = [k.info.op_type for k in result.program.kernels]
    assert ops.count("QConv") == 2 and "QMatMul" in ops and "QAveragePool" in ops, ops
    assert not {"Conv", "Gemm", "Relu", "Add", "AveragePool"} & set(ops), ops
    xs = samples(4, seed=11)
    assert relative_error(result, model, xs) < INT8_TOLERANCE
    # and it computes the QDQ graph the quantize pass wrote, as ONNX Runtime runs it, to
    # within one step of the output's quantization (tests/test_quantization_qdq.py's bound)
    qdq = after_passes(root / "model.onnx", f"-load-profile={profile}", *flags)
    step = output_scales(qdq)["y"]
    for x in xs:
        ours = run_qpc(result.qpc_path, {"x": x})["y"]
        (theirs,) = run_ort(qdq, {"x": x}, optimize=False)
        assert np.abs(ours - theirs).max() <= step * (1 + 1e-5)
    result.cleanup()


def after_passes(source: onnx.ModelProto | Path, *flags: str) -> onnx.ModelProto:
    """The graph the passes leave (without epilogue fusion and int8 folding, whose results are
    not ONNX), as a ModelProto."""
    opts = CompileOptions.from_flags(list(flags))
    with without_epilogue_fusion():
        passes = [p for p in graph_pipeline(opts) if p.name != "fold-qdq"]
    imported = import_model(source)
    run_passes(imported.model, passes)
    return ir.serde.serialize_model(imported.model)


@pytest.mark.parametrize(
    ("flags", "needed"),
    [
        ([], 13),
        (["-enable-channelwise", "-quantization-precision-bias=Int32"], 13),
        (["-quantization-precision=Int16"], 21),
    ],
    ids=["int8", "int8-channelwise-int32-bias", "int16"],
)
def test_quantized_graph_is_valid_onnx_at_the_opset_it_declares(dumped, flags, needed):
    opset, root, model, profile, _ = dumped
    proto = after_passes(root / "model.onnx", f"-load-profile={profile}", *flags)
    declared = {o.domain: o.version for o in proto.opset_import}
    assert declared[""] == needed
    kinds = {n.op_type for n in proto.graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= kinds
    if "-enable-channelwise" in flags:
        assert any(
            a.name == "axis"
            for n in proto.graph.node
            if n.op_type == "DequantizeLinear"
            for a in n.attribute
        )
    onnx.checker.check_model(proto, full_check=True)
    x = samples(1, seed=5)[0]
    (qdq,) = run_ort(proto, {"x": x}, optimize=False)
    (ref,) = run_ort(model, {"x": x})
    assert np.abs(qdq - ref).max() / np.abs(ref).max() < INT8_TOLERANCE


def attribute_forms(opset: int) -> onnx.ModelProto:
    """Ops whose definition changes between opset 9 and 13: Softmax over a middle axis
    (2-D coercion before 13), Upsample (Resize from 10), Slice, Squeeze and Clip with
    attributes (inputs from 10, 13, 11), Pad with attributes (inputs from 11)."""
    nodes = [
        oh.make_node("Softmax", ["x"], ["s"], axis=1),
        oh.make_node("Slice", ["s"], ["sl"], starts=[0], ends=[2], axes=[1]),
        oh.make_node("Unsqueeze", ["sl"], ["u"], axes=[0]),
        oh.make_node("Squeeze", ["u"], ["sq"], axes=[0]),
        oh.make_node("Clip", ["sq"], ["c"], min=0.05, max=0.4),
        oh.make_node("Upsample", ["c", "scales"], ["up"], mode="nearest"),
        oh.make_node("Pad", ["up"], ["y"], pads=[0, 0, 1, 0, 0, 1], value=0.5),
    ]
    inits = {"scales": np.array([1.0, 1.0, 2.0], np.float32)}
    return _model(nodes, [("x", [2, 3, 4])], [("y", [2, 2, 10])], inits, opset)


def test_raising_the_opset_keeps_what_every_node_computes():
    model = attribute_forms(9)
    ir_model = import_model(model).model
    rewritten = raise_opset(ir_model, 13, "a test")
    assert rewritten == 7  # each one's definition changed
    proto = ir.serde.serialize_model(ir_model)
    assert model_opset(ir_model) == 13
    assert {o.domain: o.version for o in proto.opset_import}[""] == 13
    onnx.checker.check_model(proto, full_check=True)
    ops = [n.op_type for n in proto.graph.node]
    assert "Upsample" not in ops and "Resize" in ops
    assert not dynamic_values(ir_model.graph)  # the new values' shapes are known
    x = np.random.default_rng(0).uniform(-2, 2, (2, 3, 4)).astype(np.float32)
    np.testing.assert_allclose(
        run_ort(proto, {"x": x}, optimize=False)[0], run_ort(model, {"x": x})[0], rtol=1e-6
    )


def test_an_old_model_whose_ops_change_definition_quantizes_and_compiles(tmp_path):
    model = attribute_forms(9)
    onnx.save(model, tmp_path / "model.onnx")
    xs = np.random.default_rng(2).uniform(-2, 2, (6, 2, 3, 4)).astype(np.float32)
    np.savez(tmp_path / "calib.npz", x=xs)
    result = compile_model(
        tmp_path / "model.onnx",
        [f"-dump-profile={tmp_path / 'p.json'}", f"-input-list-file={tmp_path / 'calib.npz'}"],
    )
    ops = [k.info.op_type for k in result.program.kernels]
    assert "Resize" in ops and "Upsample" not in ops and "QuantizeLinear" in ops, ops
    for x in xs[:5]:  # the samples the profile holds: no range clipped
        ours = run_qpc(result.qpc_path, {"x": x})["y"]
        (ref,) = run_ort(model, {"x": x})
        assert np.abs(ours - ref).max() / np.abs(ref).max() < INT8_TOLERANCE
    result.cleanup()


def test_raising_keeps_unchanged_nodes_and_names_the_replacements_as_before():
    ir_model = import_model(cnn(9)).model
    before = {node.name: node for node in ir_model.graph}
    assert raise_opset(ir_model, 13, "a test") == 0
    assert {node.name: node for node in ir_model.graph} == before  # the same objects
    softmax = import_model(attribute_forms(9)).model
    name = next(n.name for n in softmax.graph if n.op_type == "Softmax")
    raise_opset(softmax, 13, "a test")
    (main,) = [n for n in softmax.graph if n.name == name]
    assert main.op_type == "Reshape"  # produces the Softmax's output, under its name
    assert raise_opset(softmax, 13, "a test") == 0  # already there


def test_a_node_the_converter_cannot_raise_is_named():
    scan_body = oh.make_graph(
        [oh.make_node("Add", ["s", "x"], ["s2"]), oh.make_node("Identity", ["s2"], ["o"])],
        "body",
        [oh.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in ("s", "x")],
        [oh.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in ("s2", "o")],
    )
    node = oh.make_node(
        "Scan", ["", "init", "xs"], ["final", "ys"], body=scan_body, num_scan_inputs=1
    )
    graph = oh.make_graph(
        [node],
        "scan8",
        [
            oh.make_tensor_value_info("init", TensorProto.FLOAT, [1, 2]),
            oh.make_tensor_value_info("xs", TensorProto.FLOAT, [1, 3, 2]),
        ],
        [
            oh.make_tensor_value_info("final", TensorProto.FLOAT, [1, 2]),
            oh.make_tensor_value_info("ys", TensorProto.FLOAT, [1, 3, 2]),
        ],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 8)])
    model.ir_version = 3
    ir_model = ir.serde.deserialize_model(model)
    with pytest.raises(CompileError) as info:
        raise_opset(ir_model, 13, "int8 QuantizeLinear/DequantizeLinear")
    assert info.value.code == "unsupported_operator"
    assert "Scan" in info.value.message and "opset 13" in info.value.message


def other_inserting_passes(opset: int) -> onnx.ModelProto:
    """What canonicalize (Sum, Flatten, Squeeze/Unsqueeze, Sub/Div by constants) and
    BatchNormalization folding (a BatchNormalization after no Conv) rewrite by inserting
    operators, in opset `opset`'s forms."""
    rng = np.random.default_rng(4)
    inits = {
        "gamma": rng.uniform(0.5, 1.5, (3,)).astype(np.float32),
        "beta": rng.normal(0, 0.1, (3,)).astype(np.float32),
        "mean": rng.normal(0, 0.1, (3,)).astype(np.float32),
        "var": rng.uniform(0.5, 1.5, (3,)).astype(np.float32),
        "half": np.array([2.0], np.float32),
        "third": np.array([0.3], np.float32),
        "w": rng.normal(0, 0.3, (12, 5)).astype(np.float32),
    }
    bn: dict[str, Any] = {"epsilon": 1e-5}
    if opset < 9:
        bn["spatial"] = 1
    nodes = [
        oh.make_node("BatchNormalization", ["x", "gamma", "beta", "mean", "var"], ["n"], **bn),
        oh.make_node("Sum", ["n", "x", "n"], ["s"]),
        oh.make_node("Div", ["s", "half"], ["d"]),
        oh.make_node("Sub", ["d", "third"], ["e"]),
        oh.make_node("Unsqueeze", ["e"], ["u"], axes=[0]),
        oh.make_node("Squeeze", ["u"], ["q"], axes=[0]),
        oh.make_node("Flatten", ["q"], ["f"], axis=1),
        oh.make_node("MatMul", ["f", "w"], ["y"]),
    ]
    return _model(nodes, [("x", [1, 3, 2, 2])], [("y", [1, 5])], inits, opset)


@pytest.mark.parametrize("opset", [8, 9])
@pytest.mark.parametrize("flags", [[], ["-convert-to-fp16"]], ids=["fp32", "fp16"])
def test_passes_that_insert_operators_keep_an_old_model_valid(opset, flags):
    model = other_inserting_passes(opset)
    proto = after_passes(model, *flags)
    assert {o.domain: o.version for o in proto.opset_import}[""] == opset
    ops = {n.op_type for n in proto.graph.node}
    assert not {"Sum", "BatchNormalization", "Div", "Sub", "Flatten", "Squeeze"} & ops, ops
    onnx.checker.check_model(proto, full_check=True)
    x = np.random.default_rng(1).normal(0, 1, (1, 3, 2, 2)).astype(np.float32)
    tolerance = 1e-2 if flags else 1e-5
    np.testing.assert_allclose(
        run_ort(proto, {"x": x}, optimize=False)[0],
        run_ort(model, {"x": x})[0],
        rtol=tolerance,
        atol=tolerance,
    )


def test_a_bfloat16_boundary_raises_an_old_model_to_opset_13(tmp_path):
    (tmp_path / "io.yaml").write_text("- IOName: y\n  Precision: bfloat16\n")
    model = other_inserting_passes(9)
    proto = after_passes(model, f"-custom-IO-list-file={tmp_path / 'io.yaml'}")
    assert {o.domain: o.version for o in proto.opset_import}[""] == 13
    assert proto.graph.output[0].type.tensor_type.elem_type == TensorProto.BFLOAT16
    onnx.checker.check_model(proto, full_check=True)
    onnx.save(model, tmp_path / "model.onnx")
    result = compile_model(
        tmp_path / "model.onnx", [f"-custom-IO-list-file={tmp_path / 'io.yaml'}"]
    )
    x = np.random.default_rng(1).normal(0, 1, (1, 3, 2, 2)).astype(np.float32)
    ours = np.asarray(run_qpc(result.qpc_path, {"x": x})["y"], np.float32)
    np.testing.assert_allclose(ours, run_ort(model, {"x": x})[0], rtol=1e-2, atol=1e-2)
    result.cleanup()


def test_an_old_model_scaled_attention_folds_into_valid_operators_under_fp16():
    """fold-matmul-scale inserts a Mul (opset 7+) where the scale cannot go into constants."""
    nodes = [
        oh.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
        oh.make_node("MatMul", ["q", "kt"], ["s"]),
        oh.make_node("Div", ["s", "d"], ["y"]),
    ]
    inits = {"d": np.array(np.sqrt(80.0), np.float32)}
    model = _model(nodes, [("q", [1, 4, 80]), ("k", [1, 4, 80])], [("y", [1, 4, 4])], inits, 9)
    proto = after_passes(model, "-convert-to-fp16")
    assert {o.domain: o.version for o in proto.opset_import}[""] == 9
    assert [n.op_type for n in proto.graph.node if n.op_type != "Cast"] == [
        "Transpose",
        "Div",
        "MatMul",
    ]
    onnx.checker.check_model(proto, full_check=True)
    rng = np.random.default_rng(0)
    feeds = {n: (rng.normal(0, 20, (1, 4, 80)) + 60).astype(np.float32) for n in ("q", "k")}
    (ours,) = run_ort(proto, feeds, optimize=False)
    (ref,) = run_ort(model, feeds)
    np.testing.assert_allclose(ours, ref, rtol=1e-2)


def test_a_bfloat16_boundary_raises_before_fusion_so_fused_steps_read_the_new_opset(tmp_path):
    """Conv + Clip-6 (bounds as attributes) fused into one kernel: the Clip is converted to
    its opset-13 form (bounds as inputs) before fusion records it."""
    rng = np.random.default_rng(0)
    nodes = [
        oh.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
        oh.make_node("Clip", ["c"], ["y"], min=-0.5, max=0.7),
    ]
    inits = {
        "w": rng.normal(0, 0.5, (4, 3, 3, 3)).astype(np.float32),
        "b": rng.normal(0, 0.1, (4,)).astype(np.float32),
    }
    model = _model(nodes, [("x", [1, 3, 8, 8])], [("y", [1, 4, 8, 8])], inits, 9)
    (tmp_path / "io.yaml").write_text("- IOName: y\n  Precision: bfloat16\n")
    result = compile_model(model, [f"-custom-IO-list-file={tmp_path / 'io.yaml'}"])
    (conv,) = [k for k in result.program.kernels if k.info.op_type == "Conv"]
    assert conv.info.opset == 13 and [(e.op_type, e.opset) for e in conv.epilogue] == [("Clip", 13)]
    x = rng.normal(0, 1, (1, 3, 8, 8)).astype(np.float32)
    ours = np.asarray(run_qpc(result.qpc_path, {"x": x})["y"], np.float32)
    np.testing.assert_allclose(ours, run_ort(model, {"x": x})[0], rtol=1e-2, atol=1e-2)
    result.cleanup()
