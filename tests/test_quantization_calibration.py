"""Calibration: -dump-profile records what the float model's tensors held (checked against
ONNX Runtime's float run), -load-profile quantizes from it under every schema, calibration
method, precision and bias type; per-channel weights; op types kept float; calibration inputs
as .npz or a list file; bad profiles and inputs named with their flag."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx.helper as oh
import pytest

from compiler_core.compile import compile_model
from compiler_core.errors import CompileError
from compiler_core.quant.profile import TensorStats, read_profile
from compiler_core.quant.ranges import abs_histogram, threshold
from compiler_core.runtime import run_qpc
from tests.quant_models import calibration, cnn, pooled, run_ort

MODEL = cnn()


@pytest.fixture(scope="module")
def calib(tmp_path_factory):
    """The model, its calibration set as .npz and the profile dumped from it."""
    root = tmp_path_factory.mktemp("calib")
    onnx.save(MODEL, root / "model.onnx")
    samples = calibration(MODEL, 6)
    np.savez(root / "calib.npz", x=np.stack([s["x"] for s in samples]))
    profile = root / "profile.json"
    result = compile_model(
        root / "model.onnx",
        [f"-dump-profile={profile}", f"-input-list-file={root / 'calib.npz'}"],
    )
    result.cleanup()
    return root, samples, profile


def relative_error(result, samples) -> float:
    worst = 0.0
    for feeds in samples:
        ours = run_qpc(result.qpc_path, feeds)["y"]
        ref = run_ort(MODEL, feeds)[0]
        worst = max(worst, float(np.abs(ours - ref).max() / np.abs(ref).max()))
    return worst


def quantized(calib, *flags: str):
    root, _, profile = calib
    return compile_model(root / "model.onnx", [f"-load-profile={profile}", *flags])


def test_profile_holds_the_float_models_ranges_as_onnxruntime_computes_them(calib):
    root, samples, profile = calib
    doc = json.loads(profile.read_text())
    assert doc["format"] == "qpcfarm-quantization-profile" and doc["version"] == 1
    assert doc["samples"] == 5 and doc["num_histogram_bins"] == 512  # 1 of 6 held back
    assert doc["inputs"] == [{"name": "x", "dtype": "float32", "shape": [1, 3, 16, 16]}]
    probe = onnx.ModelProto()
    probe.CopyFrom(MODEL)
    for name in ("c1", "r1", "a", "sg"):
        probe.graph.output.append(oh.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    samples = samples[:5]  # the last one is held back for the accuracy report
    runs = [run_ort(probe, s, optimize=False) for s in samples]
    outputs = ["y", "c1", "r1", "a", "sg"]
    for name in ("x", "r1", "a", "sg"):
        if name == "x":
            values = np.stack([s["x"] for s in samples])
        else:
            values = np.stack([r[outputs.index(name)] for r in runs])
        stats = doc["tensors"][name]
        assert stats["min"] == pytest.approx(float(values.min()), rel=1e-5, abs=1e-6)
        assert stats["max"] == pytest.approx(float(values.max()), rel=1e-5, abs=1e-6)
        assert sum(stats["counts"]) == values.size
        assert len(stats["counts"]) == 512
    assert "c1" not in doc["tensors"] or doc["tensors"]["c1"]["min"] < 0  # Relu not fused


def test_loaded_profile_compiles_int8_kernels_close_to_float(calib):
    _, samples, _ = calib
    result = quantized(calib)
    ops = [k.info.op_type for k in result.program.kernels]
    assert {"QConv", "QAdd", "QLut", "QAvgPool", "QMatMul"} <= set(ops), ops
    assert not {"Conv", "Gemm", "Add", "Relu", "Sigmoid"} & set(ops), ops
    assert relative_error(result, samples) < 0.03
    result.cleanup()


@pytest.mark.parametrize(
    "method",
    ["None", "Percentile", "KLMinimization", "KLMinimizationV2", "MSE", "SQNR"],
)
def test_every_calibration_method_compiles_and_stays_close(calib, method):
    _, samples, _ = calib
    flags = [f"-quantization-calibration={method}"]
    if method == "Percentile":
        flags.append("-percentile-calibration-value=99.99")
    result = quantized(calib, *flags)
    assert relative_error(result, samples) < (0.6 if method.startswith("KL") else 0.1)
    result.cleanup()


def heavy_tailed() -> TensorStats:
    rng = np.random.default_rng(0)
    values = np.concatenate([rng.laplace(0, 1, 100_000), [40.0, -38.0]])
    counts, edges = np.histogram(values, 512, (values.min(), values.max()))
    return TensorStats(float(values.min()), float(values.max()), edges[0], edges[-1], counts)


def test_methods_clip_outliers_that_minmax_keeps():
    stats = heavy_tailed()
    counts, edges = abs_histogram(stats)
    top = threshold(counts, edges, "None", 127)
    assert top == pytest.approx(40.0, rel=0.01)
    p999 = threshold(counts, edges, "Percentile", 127, 99.9)
    assert 5.0 < p999 < 10.0  # Laplace(1): 99.9% of |x| lies below ln(1000) = 6.9
    for method in ("KLMinimization", "KLMinimizationV2", "MSE", "SQNR"):
        t = threshold(counts, edges, method, 127)
        assert 2.0 < t < 0.8 * top, (method, t)
    assert threshold(counts, edges, "SQNR", 127) <= threshold(counts, edges, "MSE", 127)


def activation_types(result) -> set[str]:
    return {k.info.in_dtypes[0] for k in result.program.kernels if k.info.op_type == "QConv"}


def test_schemas_choose_types_and_zero_points(calib):
    sym = quantized(calib, "-quantization-schema-activations=symmetric")
    assert activation_types(sym) == {"int8"}
    assert all(k.info.attrs.get("x_zero", 0) == 0 for k in sym.program.kernels)
    uint = quantized(calib)  # symmetric_with_uint8: Relu outputs are unsigned
    assert activation_types(uint) == {"int8", "uint8"}
    asym = quantized(calib, "-quantization-schema-activations=asymmetric")
    assert activation_types(asym) == {"uint8"}
    assert any(k.info.attrs.get("x_zero", 0) != 0 for k in asym.program.kernels)
    pow2 = quantized(calib, "-quantization-schema-activations=symmetric_with_power2_scale")
    quantize = next(k for k in pow2.program.kernels if k.info.op_type == "QuantizeLinear")
    scale = float(quantize.info.consts[1])
    assert np.log2(scale) == int(np.log2(scale))
    for r in (sym, uint, asym, pow2):
        r.cleanup()


def test_int32_bias_and_int8_bias(calib):
    int8 = quantized(calib)
    int32 = quantized(calib, "-quantization-precision-bias=Int32")
    first = lambda r: next(k for k in r.program.kernels if k.info.op_type == "QConv")  # noqa: E731
    assert first(int8).info.in_dtypes[2] == "int8" and len(first(int8).info.in_shapes) == 6
    assert first(int32).info.in_dtypes[2] == "int32" and len(first(int32).info.in_shapes) == 5


def test_int16_is_more_accurate_than_int8(calib):
    _, samples, _ = calib
    int8 = quantized(calib)
    int16 = quantized(calib, "-quantization-precision=Int16")
    assert "int16" in activation_types(int16)
    assert relative_error(int16, samples) < relative_error(int8, samples) / 4


def test_per_channel_weights_beat_per_tensor_on_uneven_channels(tmp_path):
    model = cnn(seed=4)
    w1 = next(i for i in model.graph.initializer if i.name == "w1")
    array = onnx.numpy_helper.to_array(w1).copy()
    array *= np.logspace(-2, 0, 8, dtype=np.float32)[:, None, None, None]
    w1.CopyFrom(onnx.numpy_helper.from_array(array, "w1"))
    onnx.save(model, tmp_path / "m.onnx")
    samples = calibration(model, 6)
    np.savez(tmp_path / "c.npz", x=np.stack([s["x"] for s in samples]))
    base = [f"-dump-profile={tmp_path / 'p.json'}", f"-input-list-file={tmp_path / 'c.npz'}"]
    errors = {}
    for flags in ([], ["-enable-channelwise", "-enable-rowwise"]):
        result = compile_model(tmp_path / "m.onnx", [*base, *flags])
        worst = 0.0
        for feeds in samples:
            ours = run_qpc(result.qpc_path, feeds)["y"]
            ref = run_ort(model, feeds)[0]
            worst = max(worst, float(np.abs(ours - ref).max()))
        errors[bool(flags)] = worst
        rq = next(k for k in result.program.kernels if k.info.op_type == "QConv").info
        assert rq.in_shapes[4] == (8, 2)
    assert errors[True] < errors[False]


def sigmoid_precision(result) -> str:
    """The type the kernel holding the Sigmoid node computes it in."""
    for k in result.program.kernels:
        if k.info.op_type == "Sigmoid":
            return k.info.out_dtypes[0]
        if "Sigmoid" in k.op_types:
            return k.epilogue[k.op_types.index("Sigmoid") - 1].out_dtype
        if k.info.op_type == "QLut":  # the only table of this model
            return k.info.in_dtypes[0]
    raise AssertionError("no Sigmoid")


def test_kept_op_types_stay_float_or_fp16(calib):
    assert sigmoid_precision(quantized(calib)) in ("int8", "uint8")
    kept = quantized(calib, "-keep-original-precision-for-nodes=Sigmoid")
    assert sigmoid_precision(kept) == "float32"
    assert "QConv" in {k.info.op_type for k in kept.program.kernels}
    assert sigmoid_precision(quantized(calib, "-execute-nodes-in-fp16=Sigmoid")) == "float16"
    float_fp16 = compile_model(MODEL, ["-execute-nodes-in-fp16=Sigmoid"])
    assert sigmoid_precision(float_fp16) == "float16"
    assert ("Conv", "float32") in {
        (k.info.op_type, k.info.in_dtypes[0]) for k in float_fp16.program.kernels
    }


def test_no_quant_dumps_the_profile_and_compiles_float(calib, tmp_path):
    root, _, _ = calib
    profile = tmp_path / "p.json"
    result = compile_model(
        root / "model.onnx",
        [f"-dump-profile={profile}", f"-input-list-file={root / 'calib.npz'}", "-no-quant"],
    )
    assert profile.is_file()
    assert "Conv" in {k.info.op_type for k in result.program.kernels}


def test_list_file_of_raw_and_npy_inputs_gives_the_same_profile(calib, tmp_path):
    root, samples, profile = calib
    lines = []
    for i, s in enumerate(samples):
        if i % 2:
            s["x"].tofile(tmp_path / f"x{i}.raw")
            lines.append(f"x{i}.raw")
        else:
            np.save(tmp_path / f"x{i}.npy", s["x"])
            lines.append(f"x:={tmp_path / f'x{i}.npy'}")
    (tmp_path / "list.txt").write_text("# calibration\n" + "\n".join(lines) + "\n")
    out = tmp_path / "again.json"
    compile_model(
        root / "model.onnx",
        [f"-dump-profile={out}", f"-input-list-file={tmp_path / 'list.txt'}", "-no-quant"],
    )
    assert json.loads(out.read_text())["tensors"] == json.loads(profile.read_text())["tensors"]


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ("x.raw\n", "does not exist"),
        ("y:=a.npy\n", "no input 'y'"),
        ("a.npy b.npy\n", "2 files for 1 inputs"),
    ],
)
def test_bad_list_files_name_the_flag(calib, tmp_path, content, words):
    root, _, _ = calib
    np.save(tmp_path / "a.npy", np.zeros((1, 3, 16, 16), np.float32))
    np.save(tmp_path / "b.npy", np.zeros((1, 3, 16, 16), np.float32))
    (tmp_path / "list.txt").write_text(content)
    with pytest.raises(CompileError) as info:
        compile_model(
            root / "model.onnx",
            [f"-dump-profile={tmp_path / 'p.json'}", f"-input-list-file={tmp_path / 'list.txt'}"],
        )
    assert info.value.flag == "-input-list-file" and words in info.value.message


def test_npz_with_wrong_shape_or_missing_input_is_named(calib, tmp_path):
    root, _, _ = calib
    np.savez(tmp_path / "bad.npz", x=np.zeros((2, 3, 8, 8), np.float32))
    np.savez(tmp_path / "none.npz", z=np.zeros((1, 3, 16, 16), np.float32))
    for name, words in (("bad.npz", "shape [2, 3, 8, 8]"), ("none.npz", "no array for input x")):
        with pytest.raises(CompileError) as info:
            compile_model(
                root / "model.onnx",
                [f"-dump-profile={tmp_path / 'p.json'}", f"-input-list-file={tmp_path / name}"],
            )
        assert info.value.flag == "-input-list-file" and words in info.value.message


def test_bad_profiles_are_named_with_load_profile(calib, tmp_path):
    root, _, _ = calib
    cases = {
        "missing.json": None,
        "text.json": "not json",
        "other.json": json.dumps({"format": "something else"}),
        "range.json": json.dumps(
            {
                "format": "qpcfarm-quantization-profile",
                "version": 1,
                "tensors": {"x": {"min": 2, "max": 1, "hist_min": 0, "hist_max": 2, "counts": []}},
            }
        ),
    }
    for name, text in cases.items():
        if text is not None:
            (tmp_path / name).write_text(text)
        with pytest.raises(CompileError) as info:
            compile_model(root / "model.onnx", [f"-load-profile={tmp_path / name}"])
        assert info.value.flag == "-load-profile" and name in info.value.message
    profile = read_profile(calib[2])
    assert profile.samples == 5


def test_constant_schemas_choose_weight_types_and_zero_points(calib):
    _, samples, _ = calib

    def first_conv(result):
        return next(k for k in result.program.kernels if k.info.op_type == "QConv").info

    asym = quantized(calib, "-quantization-schema-constants=asymmetric")
    conv = first_conv(asym)
    assert conv.in_dtypes[1] == "uint8" and conv.in_shapes[3] is not None  # w zero points
    assert relative_error(asym, samples) < 0.05
    pow2 = quantized(calib, "-quantization-schema-constants=symmetric_with_power2_scale")
    conv = first_conv(pow2)
    assert conv.in_dtypes[1] == "int8" and conv.in_shapes[3] is None
    assert relative_error(pow2, samples) < 0.05


def test_matmul_bias_add_becomes_the_kernels_bias(tmp_path):
    """MatMul -> Add(constant per column): the constant is added in the int32 accumulator of
    the QMatMul (no separate QAdd pass), for a float model quantized from a profile and for a
    QDQ model written that way."""
    from tests.quant_models import mlp

    model = mlp()
    onnx.save(model, tmp_path / "mlp.onnx")
    samples = calibration(model, 8)
    np.savez(tmp_path / "c.npz", x=np.stack([s["x"] for s in samples]))
    for bias in ("Int8", "Int32"):
        result = compile_model(
            tmp_path / "mlp.onnx",
            [
                f"-dump-profile={tmp_path / 'p.json'}",
                f"-input-list-file={tmp_path / 'c.npz'}",
                f"-quantization-precision-bias={bias}",
            ],
        )
        first = result.program.kernels[1]
        assert first.info.op_type == "QMatMul" and first.info.in_shapes[2] == (32,)
        assert "Add" in " ".join(first.nodes)
        adds = [k for k in result.program.kernels if k.info.op_type == "QAdd"]
        assert len(adds) == 1  # the Sub only
        assert result.accuracy["held_back"]["outputs"]["y"]["cosine_similarity"] > 0.99


def test_loaded_profile_quantizes_a_windowed_average_pool(tmp_path):
    model = pooled(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    onnx.save(model, tmp_path / "model.onnx")
    samples = calibration(model, 6)
    np.savez(tmp_path / "calib.npz", x=np.stack([s["x"] for s in samples]))
    profile = tmp_path / "profile.json"
    common = [f"-input-list-file={tmp_path / 'calib.npz'}"]
    compile_model(tmp_path / "model.onnx", [f"-dump-profile={profile}", *common]).cleanup()
    result = compile_model(tmp_path / "model.onnx", [f"-load-profile={profile}", *common])
    ops = [k.info.op_type for k in result.program.kernels]
    assert "QAveragePool" in ops and "AveragePool" not in ops, ops
    for feeds in samples:
        ours = run_qpc(result.qpc_path, feeds)["y"]
        ref = run_ort(model, feeds)[0]
        assert np.abs(ours - ref).max() < 0.03 * np.abs(ref).max()
    result.cleanup()
