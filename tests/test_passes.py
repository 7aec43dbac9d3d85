"""Graph passes: each test states one rewrite, checks the graph left and `modified`, and checks
the numbers against ONNX Runtime (except epilogue fusion, whose result is not ONNX)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx.parser
import onnx_ir as ir
import onnxruntime as ort
import pytest

from compiler_core.errors import CompileError
from compiler_core.fusion import (
    EpilogueStep,
    base_input_count,
    epilogue,
    fused_node_names,
)
from compiler_core.importer import import_model
from compiler_core.passes import (
    PASS_NAMES,
    CanonicalizePass,
    ConvertToFp16Pass,
    EliminateCommonSubexpressionsPass,
    EliminateDeadCodePass,
    FoldBatchNormIntoConvPass,
    FoldConstantsPass,
    FuseEpiloguePass,
    GraphPass,
    PassTiming,
    ProgressReporter,
    graph_pipeline,
    run_passes,
)

HEADER = '<ir_version: 8, opset_import: ["" : 17]>'
RNG = np.random.default_rng(0)


def parse(text: str) -> onnx.ModelProto:
    return onnx.parser.parse_model(f"{HEADER}\n{text}")


def load(proto: onnx.ModelProto) -> ir.Model:
    return import_model(proto).model


def op_types(model: ir.Model) -> list[str]:
    return [node.op_type for node in model.graph]


def node_named(model: ir.Model, name: str) -> ir.Node:
    return next(node for node in model.graph if node.name == name)


def run_ort(proto: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return [np.asarray(out) for out in session.run(None, feeds)]


def assert_same_as_original(
    original: onnx.ModelProto,
    model: ir.Model,
    feeds: dict[str, np.ndarray],
    *,
    rtol: float = 1e-5,
    atol: float = 1e-5,
) -> None:
    """The rewritten model computes what ORT computes for the original one."""
    expected = run_ort(original, feeds)
    rewritten = ir.to_proto(model)
    onnx.checker.check_model(rewritten)
    actual = run_ort(rewritten, feeds)
    assert [o.name for o in rewritten.graph.output] == [o.name for o in original.graph.output]
    for got, want in zip(actual, expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


def randn(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def floats(array: np.ndarray) -> str:
    return ", ".join(f"{v:.6f}" for v in array.reshape(-1))


# --- fold-constants ----------------------------------------------------------------------------


def test_fold_constants_evaluates_constant_add_and_lifts_the_constant() -> None:
    proto = parse(
        "m (float[4] x) => (float[4] y) {"
        " two = Constant<value_float=2.0>() four = Add(two, two) y = Mul(x, four) }"
    )
    model = load(proto)
    result = FoldConstantsPass()(model)
    assert result.modified and op_types(model) == ["Mul"]
    four = model.graph.node(0).inputs[1]
    assert four is not None and four.is_initializer() and four.const_value is not None
    np.testing.assert_array_equal(four.const_value.numpy(), np.float32(4.0))
    assert_same_as_original(proto, model, {"x": randn(4)})
    assert not FoldConstantsPass()(model).modified


def test_constant_of_shape_weights_fold_whatever_their_size() -> None:
    proto = parse(
        "m (float[1,8,6,6] x) => (float[1,16,4,4] y) {"
        " s = Constant<value_ints=[16, 8, 3, 3]>()"
        " w = ConstantOfShape<value=float[1] {0.25}>(s)"
        " y = Conv(x, w) }"
    )
    model = load(proto)
    result = FoldConstantsPass(size_limit=10)(model)
    assert result.modified and op_types(model) == ["Conv"]
    weight = model.graph.node(0).inputs[1]
    assert weight is not None and weight.const_value is not None
    assert weight.const_value.shape == (16, 8, 3, 3)
    assert_same_as_original(proto, model, {"x": randn(1, 8, 6, 6)})


def test_shape_gather_concat_reshape_becomes_a_constant_reshape() -> None:
    proto = parse(
        "m (float[2,3,4] x) => (float[2,12] y) {"
        " s = Shape(x) i = Constant<value=int64[1] {0}>() b = Gather<axis=0>(s, i)"
        " rest = Constant<value=int64[1] {-1}>() target = Concat<axis=0>(b, rest)"
        " y = Reshape(x, target) }"
    )
    model = load(proto)
    assert FoldConstantsPass()(model).modified
    assert op_types(model) == ["Reshape"]
    target = model.graph.node(0).inputs[1]
    assert target is not None and target.const_value is not None
    np.testing.assert_array_equal(target.const_value.numpy(), [2, -1])
    assert_same_as_original(proto, model, {"x": randn(2, 3, 4)})


def test_data_dependent_shapes_become_static_after_folding() -> None:
    proto = parse(
        "m (float[2,3,4] x) => (float[2,12] y) {"
        " s = Shape<start=0, end=1>(x) rest = Constant<value=int64[1] {-1}>()"
        " target = Concat<axis=0>(s, rest) r = Reshape(x, target) y = Relu(r) }"
    )
    model = load(proto)
    FoldConstantsPass()(model)
    relu_input = model.graph.node(1).inputs[0]
    assert relu_input is not None and relu_input.shape == ir.Shape([2, 12])


def test_ops_with_data_dependent_shapes_fold_on_constants() -> None:
    proto = parse(
        "m (float[1,2] x) => (float[1,2] y) <int64[4] c = {0, 1, 0, 2}> {"
        " nz = NonZero(c) f = Cast<to=1>(nz) y = Add(x, f) }"
    )
    model = load(proto)
    assert FoldConstantsPass()(model).modified
    assert op_types(model) == ["Add"]
    assert_same_as_original(proto, model, {"x": randn(1, 2)})


def test_size_limit_only_caps_shape_folds_of_non_constant_inputs() -> None:
    proto = parse("m (float[2,3,4] x) => (int64[3] y) { s = Shape(x) y = Identity(s) }")
    model = load(proto)
    assert not FoldConstantsPass(size_limit=2)(model).modified
    assert FoldConstantsPass(size_limit=3)(model).modified
    assert op_types(model) == ["Identity"]


# --- dead code, common subexpressions ---------------------------------------------------------


def test_dead_nodes_and_unused_initializers_are_removed() -> None:
    proto = parse(
        "m (float[4] x) => (float[4] y) <float[4] unused = {1, 2, 3, 4}> {"
        " a = Relu(x) b = Sigmoid(a) y = Abs(x) }"
    )
    model = load(proto)
    result = EliminateDeadCodePass()(model)
    assert result.modified and op_types(model) == ["Abs"]
    assert "unused" not in model.graph.initializers
    assert [v.name for v in model.graph.outputs] == ["y"]
    assert not EliminateDeadCodePass()(model).modified


def test_cse_merges_two_identical_relus_and_equal_constants() -> None:
    proto = parse(
        "m (float[4] x) => (float[4] y) <float[1] c1 = {2.0}, float[1] c2 = {2.0}> {"
        " a = Relu(x) b = Relu(x) p = Mul(a, c1) q = Mul(b, c2) y = Add(p, q) }"
    )
    model = load(proto)
    result = EliminateCommonSubexpressionsPass()(model)
    assert result.modified
    assert op_types(model) == ["Relu", "Mul", "Add"]
    assert_same_as_original(proto, model, {"x": randn(4)})


def test_cse_keeps_nodes_whose_attributes_differ() -> None:
    proto = parse(
        "m (float[4] x) => (float[4] y) {"
        " a = LeakyRelu<alpha=0.1>(x) b = LeakyRelu<alpha=0.2>(x) y = Add(a, b) }"
    )
    model = load(proto)
    assert not EliminateCommonSubexpressionsPass()(model).modified
    assert op_types(model) == ["LeakyRelu", "LeakyRelu", "Add"]


# --- canonicalize ------------------------------------------------------------------------------


def test_identity_and_inference_dropout_vanish_and_output_names_survive() -> None:
    proto = parse(
        "m (float[4] x) => (float[4] y, float[4] z) {"
        " a = Identity(x) b = Relu(a) c = Dropout(b) y = Identity(c) z = Identity(x) }"
    )
    model = load(proto)
    result = CanonicalizePass()(model)
    assert result.modified
    # z = Identity(x) stays: a graph input cannot be renamed to the output's name.
    assert op_types(model) == ["Relu", "Identity"]
    assert model.graph.node(0).outputs[0].name == "y"
    assert_same_as_original(proto, model, {"x": randn(4)})


def test_dropout_whose_mask_is_read_stays() -> None:
    proto = parse("m (float[4] x) => (float[4] y, bool[4] mask) { y, mask = Dropout(x) }")
    model = load(proto)
    assert not CanonicalizePass()(model).modified


def test_sum_becomes_adds_and_sub_div_by_constants_become_exact_add_mul() -> None:
    proto = parse(
        "m (float[2,3] x, float[3] v, float[2,3] w) => (float[2,3] y, float[2,3] z) "
        "<float[1] four = {4.0}, float[1] three = {3.0}, float[3] k = {0.1, 0.2, 0.3}> {"
        " s = Sum(x, v, w) d = Div(s, four) y = Sub(d, k) z = Div(x, three) }"
    )
    model = load(proto)
    assert CanonicalizePass()(model).modified
    assert op_types(model) == ["Add", "Add", "Mul", "Add", "Div"]
    feeds = {"x": randn(2, 3), "v": randn(3), "w": randn(2, 3)}
    expected = run_ort(proto, feeds)
    actual = run_ort(ir.to_proto(model), feeds)
    for got, want in zip(actual, expected, strict=True):
        np.testing.assert_array_equal(got, want)


def test_flatten_squeeze_unsqueeze_become_reshapes_to_constant_shapes() -> None:
    proto = parse(
        "m (float[2,1,3,4] x) => (float[2,12] y, float[2,3,4] z, float[1,2,1,3,4] u) {"
        " y = Flatten<axis=1>(x) ax = Constant<value=int64[1] {1}>() z = Squeeze(x, ax)"
        " zero = Constant<value=int64[1] {0}>() u = Unsqueeze(x, zero) }"
    )
    model = load(proto)
    assert CanonicalizePass()(model).modified
    assert [t for t in op_types(model) if t != "Constant"] == ["Reshape"] * 3
    assert_same_as_original(proto, model, {"x": randn(2, 1, 3, 4)})


# --- fold-batchnorm ----------------------------------------------------------------------------


def conv_bn_model(channels: int = 4, *, with_bias: bool) -> onnx.ModelProto:
    w, b = randn(channels, 3, 3, 3), randn(channels)
    gamma, beta, mean = randn(channels), randn(channels), randn(channels)
    var = np.abs(randn(channels)) + 0.1
    bias_decl = f", float[{channels}] b = {{{floats(b)}}}" if with_bias else ""
    conv = "t = Conv<pads=[1,1,1,1]>(x, w, b)" if with_bias else "t = Conv<pads=[1,1,1,1]>(x, w)"
    return parse(
        f"m (float[1,3,5,5] x) => (float[1,{channels},5,5] y) "
        f"<float[{channels},3,3,3] w = {{{floats(w)}}}{bias_decl},"
        f" float[{channels}] g = {{{floats(gamma)}}}, float[{channels}] be = {{{floats(beta)}}},"
        f" float[{channels}] mu = {{{floats(mean)}}}, float[{channels}] var = {{{floats(var)}}}> {{"
        f" {conv} y = BatchNormalization<epsilon=0.001>(t, g, be, mu, var) }}"
    )


@pytest.mark.parametrize("with_bias", [False, True])
def test_batchnorm_after_conv_folds_into_its_weights(with_bias: bool) -> None:
    proto = conv_bn_model(with_bias=with_bias)
    model = load(proto)
    result = FoldBatchNormIntoConvPass()(model)
    assert result.modified and op_types(model) == ["Conv"]
    assert model.graph.node(0).outputs[0].name == "y"
    assert_same_as_original(proto, model, {"x": randn(1, 3, 5, 5)}, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("row", [27, 576])
def test_a_folded_weight_read_from_its_file_is_the_products_of_its_rows(
    row: int, tmp_path: Path
) -> None:
    """`scale_into` (how the QPC writer gets a folded weight kept in a file) gives each
    weight times its output channel's factor, for rows shorter and longer than the ones it
    scales row by row, and leaves numpy's buffer size as it found it."""
    from compiler_core.passes.fold_batchnorm import ScaledWeight

    weight = randn(6, row)
    factor = randn(6)
    path = tmp_path / "w.bin"
    weight.tofile(path)
    source = ir.ExternalTensor(
        location="w.bin",
        offset=0,
        length=weight.nbytes,
        dtype=ir.DataType.FLOAT,
        shape=ir.Shape(weight.shape),
        name="w",
        base_dir=tmp_path,
    )
    scaled = ScaledWeight(lambda: ir.Tensor(weight * factor[:, None]), source, factor, weight.dtype)
    assert scaled.scales_into(weight.dtype)
    out = np.zeros(weight.nbytes, np.uint8)
    before = np.getbufsize()
    with open(path, "rb") as f:
        scaled.scale_into(out, {str(path): f})
    assert np.getbufsize() == before
    got = out.view(np.float32).reshape(weight.shape)
    assert got.tobytes() == (weight * factor[:, None]).tobytes()


def test_weights_shared_by_two_convs_fold_separately() -> None:
    c = 2
    bn = (
        f"<float[{c},3,1,1] w = {{{floats(randn(c, 3, 1, 1))}}},"
        f" float[{c}] g = {{{floats(randn(c))}}}, float[{c}] be = {{{floats(randn(c))}}},"
        f" float[{c}] mu = {{{floats(randn(c))}}}, float[{c}] var = {{0.5, 2.0}},"
        f" float[{c}] g2 = {{{floats(randn(c))}}}>"
    )
    proto = parse(
        f"m (float[1,3,4,4] x) => (float[1,{c},4,4] y) {bn} {{"
        " a = Conv(x, w) b = Conv(x, w) p = BatchNormalization(a, g, be, mu, var)"
        " q = BatchNormalization(b, g2, be, mu, var) y = Add(p, q) }"
    )
    model = load(proto)
    assert FoldBatchNormIntoConvPass()(model).modified
    assert op_types(model) == ["Conv", "Conv", "Add"]
    assert_same_as_original(proto, model, {"x": randn(1, 3, 4, 4)}, rtol=1e-4, atol=1e-4)


def test_standalone_batchnorm_becomes_mul_add() -> None:
    c = 3
    proto = parse(
        f"m (float[2,{c},4,4] x) => (float[2,{c},4,4] y) "
        f"<float[{c}] g = {{{floats(randn(c))}}}, float[{c}] be = {{{floats(randn(c))}}},"
        f" float[{c}] mu = {{{floats(randn(c))}}}, float[{c}] var = {{1.0, 0.5, 2.0}}> {{"
        " y = BatchNormalization(x, g, be, mu, var) }"
    )
    model = load(proto)
    assert FoldBatchNormIntoConvPass()(model).modified
    assert op_types(model) == ["Mul", "Add"]
    assert_same_as_original(proto, model, {"x": randn(2, c, 4, 4)}, rtol=1e-5, atol=1e-5)


def test_expanded_batchnorm_mul_add_fold_into_the_conv() -> None:
    w, scale, shift = randn(4, 3, 1, 1), randn(4, 1, 1), randn(1, 4, 1, 1)
    proto = parse(
        "m (float[1,3,5,5] x) => (float[1,4,5,5] y) "
        f"<float[4,3,1,1] w = {{{floats(w)}}}, float[4,1,1] s = {{{floats(scale)}}},"
        f" float[1,4,1,1] t = {{{floats(shift)}}}> {{"
        " c = Conv(x, w) m = Mul(c, s) y = Add(t, m) }"
    )
    model = load(proto)
    assert FoldBatchNormIntoConvPass()(model).modified
    assert op_types(model) == ["Conv"]
    assert_same_as_original(proto, model, {"x": randn(1, 3, 5, 5)}, rtol=1e-5, atol=1e-5)


def test_mul_by_a_non_per_channel_constant_does_not_fold() -> None:
    proto = parse(
        "m (float[1,3,5,5] x) => (float[1,4,5,5] y) "
        f"<float[4,3,1,1] w = {{{floats(randn(4, 3, 1, 1))}}},"
        f" float[5] s = {{{floats(randn(5))}}}> {{ c = Conv(x, w) y = Mul(c, s) }}"
    )
    model = load(proto)
    assert not FoldBatchNormIntoConvPass()(model).modified
    assert op_types(model) == ["Conv", "Mul"]


# --- fuse-epilogue -----------------------------------------------------------------------------


def test_conv_add_bias_relu_is_recorded_as_one_fused_conv() -> None:
    proto = parse(
        "m (float[1,3,5,5] x) => (float[1,4,5,5] y) "
        f"<float[4,3,3,3] w = {{{floats(randn(4, 3, 3, 3))}}},"
        f" float[4,1,1] bias = {{{floats(randn(4, 1, 1))}}}> {{"
        " c = Conv<pads=[1,1,1,1]>(x, w) a = Add(c, bias) y = Relu(a) }"
    )
    model = load(proto)
    names = [node.name or "" for node in model.graph]
    fuse = FuseEpiloguePass()
    assert fuse(model).modified
    assert op_types(model) == ["Conv"]
    conv = model.graph.node(0)
    assert base_input_count(conv) == 2
    assert [v.name if v is not None else None for v in conv.inputs] == ["x", "w", "bias"]
    assert epilogue(conv) == (
        EpilogueStep("Add", names[1], (None, 2)),
        EpilogueStep("Relu", names[2], (None,)),
    )
    assert fused_node_names(conv) == tuple(names)
    assert conv.outputs[0].name == "y" and conv.outputs[0].is_graph_output()


def test_matmul_add_bias_is_an_epilogue_even_with_the_bias_first() -> None:
    proto = parse(
        "m (float[4,8] x, float[8,16] w, float[16] b) => (float[4,16] y) {"
        " p = MatMul(x, w) y = Add(b, p) }"
    )
    model = load(proto)
    assert FuseEpiloguePass()(model).modified
    matmul = model.graph.node(0)
    assert op_types(model) == ["MatMul"]
    assert epilogue(matmul)[0].inputs == (2, None)


def test_clip_bounds_become_fused_inputs_and_a_missing_one_is_marked() -> None:
    proto = parse(
        "m (float[4,8] x, float[8,8] w) => (float[4,8] y) <float hi = {6.0}> {"
        ' p = MatMul(x, w) y = Clip(p, "", hi) }'
    )
    model = load(proto)
    assert FuseEpiloguePass()(model).modified
    (step,) = epilogue(model.graph.node(0))
    assert step.op_type == "Clip" and step.inputs == (None, -1, 2)


def test_fusion_is_refused_when_the_intermediate_has_two_uses() -> None:
    proto = parse(
        "m (float[1,3,5,5] x) => (float[1,4,5,5] y) "
        f"<float[4,3,3,3] w = {{{floats(randn(4, 3, 3, 3))}}}> {{"
        " c = Conv<pads=[1,1,1,1]>(x, w) a = Relu(c) b = Sigmoid(c) y = Add(a, b) }"
    )
    model = load(proto)
    conv_name = model.graph.node(0).name or ""
    fuse = FuseEpiloguePass()
    fuse(model)
    conv = node_named(model, conv_name)
    assert epilogue(conv) == ()
    refusal = next(r for r in fuse.refusals if r.producer == conv_name)
    assert refusal.reasons == (f"output of {conv_name} has 2 uses",)


def test_fusion_is_refused_when_the_step_would_broadcast_the_output() -> None:
    proto = parse(
        "m (float[1,8] x, float[8,8] w, float[4,8] z) => (float[4,8] y) {"
        " p = MatMul(x, w) y = Add(p, z) }"
    )
    model = load(proto)
    fuse = FuseEpiloguePass()
    assert not fuse(model).modified
    (refusal,) = fuse.refusals
    assert "step output shape [4, 8] differs from [1, 8]" in refusal.reasons


def test_residual_operand_produced_later_keeps_the_graph_in_order() -> None:
    proto = parse(
        "m (float[4,8] x, float[8,8] w) => (float[4,8] y) {"
        " p = MatMul(x, w) r = Relu(x) y = Add(p, r) }"
    )
    model = load(proto)
    assert FuseEpiloguePass()(model).modified
    assert op_types(model) == ["Relu", "MatMul"]


# --- convert-to-fp16 ---------------------------------------------------------------------------


def test_fp16_conversion_clips_out_of_range_constants_with_one_warning() -> None:
    proto = parse(
        "m (float[3] x) => (float[3] y) <float[3] big = {1e6, -2e5, 1.0}, float[3] ok = {1, 2, 3}>"
        " { a = Mul(x, big) y = Add(a, ok) }"
    )
    model = load(proto)
    convert = ConvertToFp16Pass()
    assert convert(model).modified
    (warning,) = convert.warnings
    assert warning["code"] == "fp16_clipped"
    assert "big" in warning["message"] and "ok" not in warning["message"]
    (reader,) = (n.name for n in model.graph if n.op_type == "Mul")
    assert (
        warning["nodes"] == [reader]
        and f"FP32NodeInstanceNames: [{reader}]" in (warning["suggestion"])
    )
    big = model.graph.initializers["big"].const_value
    assert big is not None
    np.testing.assert_array_equal(big.numpy(), np.array([65504, -65504, 1], dtype=np.float16))


def test_fp16_conversion_names_constants_it_flushes_to_zero_and_their_readers() -> None:
    """A norm's epsilon of 1e-12 is 0 in float16: a division by it gives inf or NaN."""
    proto = parse(
        "m (float[3] x) => (float[3] y) <float eps = {1e-12}, float[3] w = {1e-9, 0, 1}>"
        " { v = Mul(x, x) s = Add(v, eps) r = Sqrt(s) q = Div(x, r) y = Mul(q, w) }"
    )
    model = load(proto)
    convert = ConvertToFp16Pass()
    assert convert(model).modified
    (warning,) = convert.warnings
    assert warning["code"] == "fp16_flushed"
    named = warning["message"].split("become 0: ")[1].split(";")[0]
    assert named == "eps (|x| <= 1e-12)"  # not w: its 1 survives
    (add,) = (n.name for n in model.graph if n.op_type == "Add")
    assert warning["nodes"] == [add] and add in warning["suggestion"]


def test_fp16_model_keeps_a_float32_signature_and_matches_ort() -> None:
    proto = parse(
        "m (float[4,8] x) => (float[4,16] y) "
        f"<float[8,16] w = {{{floats(randn(8, 16))}}}, float[16] b = {{{floats(randn(16))}}}> {{"
        " p = MatMul(x, w) q = Add(p, b) r = Relu(q) f = Cast<to=1>(r) y = Mul(f, f) }"
    )
    model = load(proto)
    assert ConvertToFp16Pass()(model).modified
    assert [v.dtype for v in (*model.graph.inputs, *model.graph.outputs)] == [
        ir.DataType.FLOAT,
        ir.DataType.FLOAT,
    ]
    assert model.graph.initializers["w"].dtype == ir.DataType.FLOAT16
    cast_targets = [n.attributes["to"].as_int() for n in model.graph if n.op_type == "Cast"]
    assert cast_targets == [ir.DataType.FLOAT16, ir.DataType.FLOAT16, ir.DataType.FLOAT]
    assert_same_as_original(proto, model, {"x": randn(4, 8)}, rtol=2e-2, atol=5e-2)


def test_fp16_conversion_adjusts_float_tensor_attributes() -> None:
    proto = parse(
        "m (float[2,3] x) => (float[2,3] y) {"
        " s = Shape(x) big = ConstantOfShape<value=float[1] {100000.0}>(s)"
        " zero = ConstantOfShape(s) a = Add(x, big) y = Add(a, zero) }"
    )
    model = load(proto)
    convert = ConvertToFp16Pass()
    assert convert(model).modified
    fill, zero_fill = (n for n in model.graph if n.op_type == "ConstantOfShape")
    assert zero_fill.attributes["value"].as_tensor().dtype == ir.DataType.FLOAT16
    value = fill.attributes["value"].as_tensor()
    assert value.dtype == ir.DataType.FLOAT16 and float(value.numpy()[0]) == 65504.0
    (warning,) = convert.warnings
    assert (fill.name or "?") in warning["message"]
    assert warning["nodes"] == [n.name for n in model.graph if n.op_type == "Add"][:1]
    (y,) = run_ort(ir.to_proto(model), {"x": np.zeros((2, 3), np.float32)})
    assert y.dtype == np.float32 and np.all(y == 65504.0)


# --- manager and pipeline ----------------------------------------------------------------------


@dataclass
class Options:
    convert_to_fp16: bool = False
    custom_io_list_file: str | None = None
    node_precision_info: str | None = None


def small_cnn() -> onnx.ModelProto:
    """Weights made by ConstantOfShape (like the light models), BN, an epilogue chain."""
    c = 4
    return parse(
        f"m (float[1,3,6,6] x) => (float[1,{c},6,6] y) "
        f"<float[{c}] g = {{{floats(randn(c))}}}, float[{c}] be = {{{floats(randn(c))}}},"
        f" float[{c}] mu = {{{floats(randn(c))}}}, float[{c}] var = {{1, 2, 3, 4}}> {{"
        f" s = Constant<value_ints=[{c}, 3, 3, 3]>() w = ConstantOfShape<value=float[1] {{0.1}}>(s)"
        " i = Identity(x) c = Conv<pads=[1,1,1,1]>(i, w)"
        " n = BatchNormalization(c, g, be, mu, var) y = Relu(n) }"
    )


def test_pipeline_runs_in_order_and_leaves_one_fused_conv() -> None:
    proto = small_cnn()
    model = load(proto)
    passes = graph_pipeline(Options())
    assert [p.name for p in passes] == [
        "canonicalize",
        "fold-constants",
        "gather-slots",
        "eliminate-dead-code",
        "eliminate-common-subexpressions",
        "fold-batchnorm",
        "fold-constants",
        "fold-qdq",
        "fuse-epilogue",
        "eliminate-dead-code",
    ]
    timing = PassTiming()
    seen: list[tuple[str, float]] = []
    assert run_passes(
        model,
        passes,
        timing=timing,
        progress=ProgressReporter(lambda stage, fraction: seen.append((stage, fraction))),
    )
    assert op_types(model) == ["Conv"]
    conv = model.graph.node(0)
    assert [step.op_type for step in epilogue(conv)] == ["Relu"]
    assert len(model.graph.initializers) == 2  # folded W' and B'
    table = timing.render()
    for name in {p.name for p in passes}:
        assert name in table
    assert [stage for stage, _ in seen] == [p.name for p in passes]
    assert seen[-1][1] == 1.0


def test_pipeline_with_fp16_appends_the_conversion_before_the_last_cleanup(
    tmp_path: Path,
) -> None:
    names = [p.name for p in graph_pipeline(Options(convert_to_fp16=True))]
    assert names[-2:] == ["convert-to-fp16", "eliminate-dead-code"]
    io_list = tmp_path / "io.yaml"
    io_list.write_text("- IOName: x\n  Precision: float16\n")
    options = Options(convert_to_fp16=True, custom_io_list_file=str(io_list))
    names = [p.name for p in graph_pipeline(options)]
    assert names[-3:] == ["convert-to-fp16", "apply-custom-io", "eliminate-dead-code"]
    # quantize needs a profile, raise-opset an old model with bfloat16 I/O or a profile
    assert set(names) == set(PASS_NAMES) - {"quantize", "raise-opset"}


def test_disabled_passes_do_not_run_and_unknown_names_are_rejected() -> None:
    model = load(small_cnn())
    timing = PassTiming()
    run_passes(model, graph_pipeline(Options()), timing=timing, disabled={"fuse-epilogue"})
    assert "fuse-epilogue" not in timing.render()
    assert epilogue(next(n for n in model.graph if n.op_type == "Conv")) == ()
    with pytest.raises(CompileError) as info:
        run_passes(model, graph_pipeline(Options()), disabled={"fold-everything"})
    assert info.value.code == "unknown_pass"


class ExplodingPass(GraphPass):
    name = "explode"

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        raise RuntimeError("boom")


def test_a_failing_pass_is_reported_by_name() -> None:
    with pytest.raises(CompileError) as info:
        run_passes(load(small_cnn()), [ExplodingPass()])
    assert info.value.code == "pass_failed" and info.value.message.startswith("explode:")


def test_a_kernel_failure_while_folding_names_the_pass_and_node() -> None:
    proto = parse(
        "m (float[2] x) => (float[2] y) <float[3] a = {1, 2, 3}, int64[1] shape = {2}> {"
        " r = Reshape(a, shape) y = Add(x, r) }"
    )
    model = ir.from_proto(proto)  # not imported: shapes are only what the text declares
    model.graph.node(0).outputs[0].shape = ir.Shape([2])
    model.graph.node(0).outputs[0].dtype = ir.DataType.FLOAT
    model.graph.node(0).name = "/reshape"
    with pytest.raises(CompileError) as info:
        FoldConstantsPass(infer_shapes=lambda m: None)(model)
    assert info.value.code == "pass_failed" and info.value.node == "/reshape"
    assert info.value.message.startswith("fold-constants: node /reshape")
