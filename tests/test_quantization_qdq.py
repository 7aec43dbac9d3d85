"""QDQ models (ONNX Runtime's quantize_static, a torch export) fold into int8 kernels: the
program runs QConv/QMatMul/QAdd/QLut... on integer tensors, no Conv/MatMul/Gemm in float, and
its outputs match ONNX Runtime's own int8 execution of the same model within one
quantization step of each output (on x86 CPUs without VNNI, where ORT's int8 kernels saturate,
ORT's unfused execution: tests/ort_int8.py)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from compiler_core.compile import compile_model
from compiler_core.ops.int8 import DOMAIN
from compiler_core.runtime import run_qpc
from tests.ort_int8 import ort_int8_saturates
from tests.quant_models import (
    calibration,
    cnn,
    cnn_bn,
    mlp,
    ort_qdq,
    output_scales,
    pooled,
    run_ort,
)

FLOAT_HMX = {"Conv", "MatMul", "Gemm"}


def kernels(result) -> list[tuple[str, str, str]]:
    return [(k.info.domain, k.info.op_type, k.info.in_dtypes[0]) for k in result.program.kernels]


def check_against_ort(qdq: onnx.ModelProto, samples, cores: int = 1, steps: float = 1.0):
    result = compile_model(qdq, [f"-aic-num-cores={cores}"])
    try:
        ops = kernels(result)
        assert not [op for op in ops if op[1] in FLOAT_HMX], ops
        assert any(domain == DOMAIN for domain, _, _ in ops), ops
        scales = output_scales(qdq)
        worst = 0.0
        for feeds in samples:
            ours = run_qpc(result.qpc_path, feeds)
            theirs = run_ort(qdq, feeds, optimize=not ort_int8_saturates())
            for (name, y), ref in zip(ours.items(), theirs, strict=True):
                diff = float(np.abs(y - ref).max())
                worst = max(worst, diff / scales[name])
                assert diff <= steps * scales[name] * (1 + 1e-5), (name, diff, scales[name])
        return result, worst
    finally:
        result.cleanup()


@pytest.mark.parametrize(
    ("activation", "weight", "per_channel"),
    [("QUInt8", "QInt8", False), ("QInt8", "QInt8", True), ("QUInt8", "QUInt8", True)],
)
def test_ort_qdq_cnn_folds_into_int8_kernels_and_matches_ort_int8(activation, weight, per_channel):
    from onnxruntime.quantization import QuantType

    model = cnn()
    qdq = ort_qdq(
        model,
        calibration(model),
        activation_type=getattr(QuantType, activation),
        weight_type=getattr(QuantType, weight),
        per_channel=per_channel,
    )
    result, worst = check_against_ort(qdq, calibration(model, 4, seed=11))
    ops = {op for _, op, _ in kernels(result)}
    assert {"QConv", "QAvgPool", "QMatMul", "MaxPool"} <= ops, ops
    # the residual QAdd runs in the epilogue of the QConv before it (no DDR round trip)
    fused = [k.op_types for k in result.program.kernels if len(k.op_types) > 1]
    assert ("QConv", "QAdd") in fused, fused


def test_ort_qdq_cnn_on_four_cores_matches_one_core():
    model = cnn()
    qdq = ort_qdq(model, calibration(model), per_channel=True)
    feeds = calibration(model, 1, seed=5)[0]
    one = compile_model(qdq, ["-aic-num-cores=1"])
    four = compile_model(qdq, ["-aic-num-cores=4"])
    a, b = run_qpc(one.qpc_path, feeds), run_qpc(four.qpc_path, feeds)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])


POOLS = {
    "plain": {"kernel_shape": [3, 3], "strides": [2, 2]},
    "pads": {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
    "pads_counted": {
        "kernel_shape": [3, 3],
        "strides": [2, 2],
        "pads": [1, 0, 1, 2],
        "count_include_pad": 1,
    },
    "ceil": {"kernel_shape": [2, 3], "strides": [2, 2], "pads": [0, 1, 1, 0], "ceil_mode": 1},
}


@pytest.mark.parametrize("cores", [1, 4])
@pytest.mark.parametrize("pool", sorted(POOLS))
def test_ort_qdq_windowed_average_pool_runs_int8_and_matches_ort_int8(pool, cores):
    """AveragePool between Q/DQ pairs runs as QAveragePool (exact window sums, the
    multiplier of each window's own count), tiled by rows with halos on 4 cores."""
    model = pooled(**POOLS[pool])
    qdq = ort_qdq(model, calibration(model), per_channel=True)
    assert any(n.op_type == "AveragePool" for n in qdq.graph.node)
    result, _ = check_against_ort(qdq, calibration(model, 4, seed=13), cores=cores)
    ops = [op for _, op, _ in kernels(result)]
    assert "QAveragePool" in ops and "AveragePool" not in ops, ops


def test_ort_qdq_mlp_with_lut_activations_and_activation_matmul():
    model = mlp()
    qdq = ort_qdq(model, calibration(model), per_channel=True)
    result, _ = check_against_ort(qdq, calibration(model, 4, seed=12), cores=2)
    ops = {op for k in result.program.kernels for op in k.op_types}  # epilogue steps too
    assert {"QMatMul", "QLut", "QMul", "QAdd"} <= ops, ops


def test_a_kept_relu_narrows_the_producer_instead_of_a_table():
    """Asked to keep its removable activations, ORT leaves Relu between Q/DQ pairs of one
    scale; we fold it into the producing kernel's saturation (no table pass)."""
    model = cnn()
    qdq = ort_qdq(model, calibration(model), extra_options={"QDQKeepRemovableActivations": True})
    assert any(n.op_type == "Relu" for n in qdq.graph.node)
    result, _ = check_against_ort(qdq, calibration(model, 2, seed=8))
    ops = [op for _, op, _ in kernels(result)]
    assert "Relu" not in ops and ops.count("QLut") == 1, ops  # the Sigmoid's table only


@pytest.mark.parametrize("symmetric", [True, False])
def test_batchnorm_relu_and_clip_after_an_integer_kernel_fold_into_its_epilogue(symmetric):
    """quantize_static without pre-processing leaves each BatchNormalization between Q/DQ
    pairs, and with symmetric activations each Relu gets a scale of its own: both become the
    producing kernel's requantization (gain and new scale in its multiplier, offset in its
    bias, the Relu/Clip in its saturation), so activations stay int8 from the input's
    QuantizeLinear to the output's DequantizeLinear. Fusing drops the producer's own rounding
    to its old scale: within one step of each output of ONNX Runtime's QDQ graph here."""
    from onnxruntime.quantization import QuantType

    model = cnn_bn()
    options = {"ActivationSymmetric": True} if symmetric else {}
    qdq = ort_qdq(
        model,
        calibration(model),
        per_channel=True,
        activation_type=QuantType.QInt8 if symmetric else QuantType.QUInt8,
        extra_options=options,
    )
    kept = {"BatchNormalization", "Relu", "Clip"} if symmetric else {"BatchNormalization"}
    assert kept <= {n.op_type for n in qdq.graph.node}  # asymmetric: ORT drops the Relus
    result, _ = check_against_ort(qdq, calibration(model, 4, seed=21), cores=2)
    ops = [(op, dtype) for _, op, dtype in kernels(result)]
    floats = [op for op, dtype in ops if dtype == "float32"]
    assert floats == ["QuantizeLinear"], ops  # the input's quantize only
    assert [op for op, _ in ops].count("QConv") == 3 and ("QLut", "int8") not in ops, ops
    assert result.metrics["precision"]["fp32"]["kernels"] == 1


def test_a_batchnorm_with_a_negative_gain_stays_float_and_says_why():
    """A fixed-point multiplier is never negative: a channel whose BatchNormalization gain is
    negative keeps the BatchNormalization a float kernel between its pairs (correct, and named
    in the refusals with the reason)."""
    from onnx import numpy_helper

    model = cnn_bn()
    for init in model.graph.initializer:
        if init.name == "bn2.s":
            scale = numpy_helper.to_array(init).copy()
            scale[3] = -scale[3]
            init.CopyFrom(numpy_helper.from_array(scale, "bn2.s"))
    qdq = ort_qdq(model, calibration(model), per_channel=True)
    _, fold = _fold(qdq)
    (refusal,) = [r for r in fold.refusals if r.op_type == "BatchNormalization"]
    assert "gain is not positive" in " ".join(refusal.reasons), refusal
    result, _ = check_against_ort(qdq, calibration(model, 3, seed=21), cores=2)
    assert "BatchNormalization" in [op for _, op, _ in kernels(result)]


def test_float_ops_between_qdq_stay_float_and_correct():
    """Softmax has no int8 kernel: it runs in float between its DQ and Q."""
    import onnx.helper as oh

    model = mlp()
    graph = model.graph
    last = graph.node[-1]
    last.output[0] = "logits"
    graph.node.append(oh.make_node("Softmax", ["logits"], ["y"], axis=-1))
    qdq = ort_qdq(model, calibration(model), op_types_to_quantize=["MatMul", "Add", "Mul"])
    result = compile_model(qdq)
    ops = [op for _, op, _ in kernels(result)]
    assert "Softmax" in ops and "QMatMul" in ops
    for feeds in calibration(model, 2, seed=3):
        ours = run_qpc(result.qpc_path, feeds)["y"]
        ref = run_ort(qdq, feeds)[0]
        assert np.abs(ours - ref).max() < 0.02
    result.cleanup()


def test_float_ops_between_qdq_compute_in_fp16_under_convert_to_fp16():
    """An int8 network as deployed: the ops with no integer kernel (Softmax) compute in fp16,
    half the bytes of fp32 and on the fp16 rates, while the MatMuls stay int8."""
    import onnx.helper as oh

    model = mlp()
    graph = model.graph
    graph.node[-1].output[0] = "logits"
    graph.node.append(oh.make_node("Softmax", ["logits"], ["y"], axis=-1))
    qdq = ort_qdq(model, calibration(model), op_types_to_quantize=["MatMul", "Add", "Mul"])
    result = compile_model(qdq, ["-convert-to-fp16"])
    try:
        precisions = {op: dtype for _, op, dtype in kernels(result)}
        assert precisions["Softmax"] == "float16" and precisions["QMatMul"] == "int8"
        assert "float32" not in precisions.values()
        for feeds in calibration(model, 2, seed=3):
            ours = run_qpc(result.qpc_path, feeds)["y"]
            ref = run_ort(qdq, feeds)[0]
            assert np.abs(ours - ref).max() < 0.02
    finally:
        result.cleanup()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_torch_fake_quant_export_folds_into_int8_kernels(tmp_path):
    torch = pytest.importorskip("torch")

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
            self.fc = torch.nn.Linear(8, 5)

        @staticmethod
        def fq(x, scale: float, zero: int = 0):
            return torch.fake_quantize_per_tensor_affine(x, scale, zero, -128, 127)

        def forward(self, x):
            x = self.fq(x, 0.03)
            w = self.fq(self.conv.weight, 0.005)
            y = torch.nn.functional.conv2d(x, w, self.conv.bias, padding=1)
            y = self.fq(torch.relu(y), 0.02)
            y = self.fq(y.mean(dim=(2, 3)), 0.01)
            fw = self.fq(self.fc.weight, 0.004)
            return self.fq(torch.nn.functional.linear(y, fw, self.fc.bias), 0.02)

    x = torch.randn(1, 3, 12, 12)
    path = tmp_path / "net.onnx"
    torch.onnx.export(Net().eval(), (x,), str(path), opset_version=17, dynamo=False)
    qdq = onnx.load(path)
    assert any(n.op_type == "QuantizeLinear" for n in qdq.graph.node)
    result = compile_model(qdq)
    ops = {op for _, op, _ in kernels(result)}
    assert not ops & FLOAT_HMX, ops
    assert "QConv" in ops, ops
    for seed in range(3):
        x = np.random.default_rng(seed).normal(0, 1, (1, 3, 12, 12)).astype(np.float32)
        feeds = {qdq.graph.input[0].name: x}
        ours = next(iter(run_qpc(result.qpc_path, feeds).values()))
        ref = run_ort(qdq, feeds, optimize=not ort_int8_saturates())[0]
        assert np.abs(ours - ref).max() <= 0.02 * (1 + 1e-5)
    result.cleanup()


# -- why a group stays float ------------------------------------------------------------------


def _qdq_matmul(after: str, **gemm: int) -> onnx.ModelProto:
    """x -> Q -> DQ -> MatMul (or Gemm with `gemm` attributes) with a DQ'd int8 weight; the
    product goes to `after`: "quantize" (Q -> DQ -> y) or "softmax" (Softmax -> y)."""
    from onnx import TensorProto
    from onnx import helper as oh
    from onnx import numpy_helper as nh

    rng = np.random.default_rng(0)
    inits = [
        nh.from_array(np.array(0.05, np.float32), "s"),
        nh.from_array(np.array(128, np.uint8), "z"),
        nh.from_array(rng.integers(-60, 60, (4, 4)).astype(np.int8), "w_q"),
        nh.from_array(np.array(0.02, np.float32), "ws"),
        nh.from_array(np.array(0.1, np.float32), "ys"),
    ]
    op = "Gemm" if gemm else "MatMul"
    nodes = [
        oh.make_node("QuantizeLinear", ["x", "s", "z"], ["x_q"], name="q_x"),
        oh.make_node("DequantizeLinear", ["x_q", "s", "z"], ["x_d"], name="dq_x"),
        oh.make_node("DequantizeLinear", ["w_q", "ws"], ["w_d"], name="dq_w"),
        oh.make_node(op, ["x_d", "w_d"], ["p"], name="product", **gemm),
    ]
    if after == "quantize":
        nodes += [
            oh.make_node("QuantizeLinear", ["p", "ys", "z"], ["p_q"], name="q_p"),
            oh.make_node("DequantizeLinear", ["p_q", "ys", "z"], ["y"], name="dq_p"),
        ]
    else:
        nodes.append(oh.make_node("Softmax", ["p"], ["y"], name="sm"))
    graph = oh.make_graph(
        nodes,
        "qdq",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [4, 4])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [4, 4])],
        inits,
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])


def _fold(proto: onnx.ModelProto):
    from compiler_core.importer import import_model
    from compiler_core.passes.fold_qdq import FoldQDQPass

    model = import_model(proto).model
    fold = FoldQDQPass()
    fold(model)
    return model, fold


def test_a_group_that_folds_leaves_no_refusal() -> None:
    model, fold = _fold(_qdq_matmul("quantize"))
    assert "QMatMul" in [n.op_type for n in model.graph]
    assert fold.refusals == []


def test_a_product_read_by_a_float_op_stays_float_and_says_why() -> None:
    model, fold = _fold(_qdq_matmul("softmax"))
    assert "MatMul" in [n.op_type for n in model.graph]
    (refusal,) = fold.refusals
    assert (refusal.node, refusal.op_type) == ("product", "MatMul")
    assert refusal.reasons == ("the output is read by Softmax sm, not a QuantizeLinear",)


def test_a_gemm_that_transposes_a_stays_float_and_says_why() -> None:
    model, fold = _fold(_qdq_matmul("quantize", transA=1))
    assert "Gemm" in [n.op_type for n in model.graph]
    (refusal,) = fold.refusals
    assert refusal.reasons == ("alone: Gemm transposes A (transA=1)",)


def test_aic_perf_warnings_name_the_nodes_left_float_and_why() -> None:
    model = _qdq_matmul("softmax")
    quiet = compile_model(model, [])
    loud = compile_model(model, ["-aic-perf-warnings"])
    try:
        assert "qdq_not_folded" not in [w["code"] for w in quiet.warnings]
        (warning,) = [w for w in loud.warnings if w["code"] == "qdq_not_folded"]
        assert warning["kind"] == "perf" and warning["nodes"] == ["product"]
        assert "product (MatMul): the output is read by Softmax sm" in warning["message"]
    finally:
        quiet.cleanup()
        loud.cleanup()


def _boundary_params(qdq: onnx.ModelProto, op: str, name: str) -> tuple[float, int]:
    """The scale and zero point of the QuantizeLinear reading input `name` (op
    QuantizeLinear) or of the DequantizeLinear writing output `name`."""
    from onnx import numpy_helper

    inits = {i.name: numpy_helper.to_array(i) for i in qdq.graph.initializer}
    for node in qdq.graph.node:
        if node.op_type == op and name in (node.input[0], node.output[0]):
            return float(inits[node.input[1]]), int(inits[node.input[2]])
    raise AssertionError(f"no {op} at {name}")


@pytest.mark.parametrize("fp16", [False, True], ids=["float32-islands", "convert-to-fp16"])
def test_integer_custom_io_moves_the_boundary_quantize_and_dequantize_to_the_host(tmp_path, fp16):
    """`-custom-IO-list-file` with int8 for the input and the output: the host sends the
    input's codes (quantized with the model's own QuantizeLinear parameters) and receives the
    output's codes; the program has no float kernel left, a quarter of the input bytes cross
    the host link, and the codes dequantized are ONNX Runtime's result within one step. With
    -convert-to-fp16 (float islands in fp16, as int8 networks are deployed) the entries look
    through the boundary Casts the conversion put beside the quantize and the dequantize."""
    model = cnn_bn()
    qdq = ort_qdq(model, calibration(model), per_channel=True)
    listing = tmp_path / "io.yaml"
    listing.write_text("- IOName: x\n  Precision: int8\n- IOName: y\n  Precision: int8\n")
    flags = ["-aic-num-cores=2", *(["-convert-to-fp16"] if fp16 else [])]
    floats = compile_model(qdq, flags)
    ints = compile_model(qdq, [*flags, f"-custom-IO-list-file={listing}"])
    try:
        ops = [(op, dtype) for _, op, dtype in kernels(ints)]
        assert all(dtype == "int8" for _, dtype in ops), ops
        assert ints.metrics["host_transfer_us"] < floats.metrics["host_transfer_us"]
        xs, xz = _boundary_params(qdq, "QuantizeLinear", "x")
        ys, yz = _boundary_params(qdq, "DequantizeLinear", "y")
        for feeds in calibration(model, 3, seed=5):
            codes = np.clip(np.rint(feeds["x"] / np.float32(xs)) + xz, -128, 127).astype(np.int8)
            y = run_qpc(ints.qpc_path, {"x": codes})["y"]
            assert y.dtype == np.int8
            ref = run_ort(qdq, feeds, optimize=False)[0]
            real = (y.astype(np.float32) - yz) * np.float32(ys)
            assert np.abs(real - ref).max() <= ys * (1 + 1e-5)
    finally:
        floats.cleanup()
        ints.cleanup()


def test_integer_custom_io_on_a_float_boundary_names_the_entry(tmp_path):
    from compiler_core.errors import CompileError

    model = cnn_bn()
    qdq = ort_qdq(model, calibration(model), per_channel=True)
    listing = tmp_path / "io.yaml"
    listing.write_text("- IOName: x\n  Precision: uint8\n")  # its QuantizeLinear writes int8
    with pytest.raises(CompileError, match=r"'x' \(uint8\).*QuantizeLinear"):
        compile_model(qdq, ["-aic-num-cores=1", f"-custom-IO-list-file={listing}"])
    listing.write_text("- IOName: x\n  Precision: int8\n")
    with pytest.raises(CompileError, match=r"'x' \(int8\) must be read only by QuantizeLinear"):
        compile_model(model, ["-aic-num-cores=1", f"-custom-IO-list-file={listing}"])
