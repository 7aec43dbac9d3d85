"""Precision modes: `-mxfp6-matmul` (MXFP6 weights) and `-convert-to-fp16`, against ONNX Runtime.

The MXFP6 codec is checked against values worked out by hand from the OCP MX v1.0 spec, and the
QPC's weights against a deliberately naive decoder written here (bit by bit, from the storage
layout in docs/qpc-format.md), never against the compiler's own decoder. Tolerances are the
ones docs/compiler.md documents ("Precision").
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler_core.compile import compile_model
from compiler_core.errors import CompileError
from compiler_core.mxfp import decode_mxfp6, encode_mxfp6, mxfp6_nbytes
from compiler_core.qpc.container import (
    ConstantEntry,
    Segment,
    decode_constantsdesc,
    encode_constantsdesc,
    load_qpc,
    qpc_bytes,
)
from compiler_core.qpc.validate import validate_qpc
from compiler_core.runtime import run_qpc
from compiler_core.runtime.numerics import NonFiniteWarning
from tests.models import light_model_input, light_model_path, transformer_encoder


class Tol(NamedTuple):
    rtol: float
    atol: float


FP32_TOL = Tol(rtol=1e-4, atol=1e-5)
FP16_TOL = Tol(rtol=1e-2, atol=1e-2)
MXFP6_TOL = Tol(rtol=5e-2, atol=5e-2)
"""Whole network with MXFP6 weights against ORT fp32 (activations of order 1)."""
MXFP6_MATMUL_REL_ERROR = 0.05
"""One MatMul with N(0, 1) weights: max |error| / max |output| against full-precision ORT."""

BLOCK_BYTES = 25


# ------------------------------------------------------------------- an independent decoder


def e2m3_value(code: int) -> float:
    """Spec: sign bit 5, exponent bits 4-3 (bias 1), mantissa bits 2-0; exponent 0 is
    subnormal (0.mmm x 2^0)."""
    sign = -1.0 if code & 0x20 else 1.0
    exponent, mantissa = (code >> 3) & 0x3, code & 0x7
    if exponent == 0:
        return sign * mantissa / 8
    return sign * 2.0 ** (exponent - 1) * (1 + mantissa / 8)


def naive_decode(data: bytes, shape: tuple[int, ...], axis: int) -> np.ndarray:
    """Rows = the tensor with `axis` moved last, C order; per row ceil(K/32) blocks of 25 bytes:
    E8M0 scale, then 8 groups of 3 bytes each holding 4 codes little-endian, 6 bits apiece."""
    moved = (*shape[:axis], *shape[axis + 1 :], shape[axis])
    k = shape[axis]
    n_blocks = math.ceil(k / 32)
    rows = []
    pos = 0
    for _ in range(math.prod(moved[:-1])):
        row: list[float] = []
        for _ in range(n_blocks):
            scale = data[pos]
            for group in range(8):
                word = int.from_bytes(data[pos + 1 + 3 * group : pos + 4 + 3 * group], "little")
                for i in range(4):
                    value = e2m3_value((word >> (6 * i)) & 0x3F)
                    row.append(math.nan if scale == 255 else value * 2.0 ** (scale - 127))
            pos += BLOCK_BYTES
        rows.append(row[:k])
    assert pos == len(data)
    return np.moveaxis(np.array(rows).reshape(moved), -1, axis)


def one_block(values: list[float]) -> np.ndarray:
    return np.array(values + [0.0] * (32 - len(values)), dtype=np.float32).reshape(32, 1)


def roundtrip(values: list[float]) -> np.ndarray:
    block = one_block(values)
    return decode_mxfp6(encode_mxfp6(block, 0), block.shape, 0, "float32").ravel()[: len(values)]


# ------------------------------------------------------------------------------ codec units


def test_exact_e2m3_values_encode_to_the_bytes_worked_out_from_the_spec() -> None:
    # amax 7.5: floor(log2 7.5) - 2 = 0, so the scale is 2^0, E8M0 code 127 = 0x7F.
    # codes: 7.5 = 0 11 111 (31), 0.5 = 0 00 100 (4, subnormal), 1.5 = 0 01 100 (12),
    # 0.125 = 0 00 001 (1, smallest subnormal), -3.0 = 1 10 100 (52).
    data = encode_mxfp6(one_block([7.5, 0.5, 1.5, 0.125, -3.0]), 0)
    # 31 | 4<<6 | 12<<12 | 1<<18 = 0x04C11F; 52 = 0x000034.
    assert data == bytes([0x7F, 0x1F, 0xC1, 0x04, 0x34, 0x00, 0x00]) + bytes(18)
    assert naive_decode(data, (32, 1), 0).ravel()[:5].tolist() == [7.5, 0.5, 1.5, 0.125, -3.0]


def test_every_subnormal_and_normal_e2m3_magnitude_round_trips_exactly() -> None:
    magnitudes = sorted({abs(e2m3_value(c)) for c in range(32)})
    assert magnitudes[:3] == [0.0, 0.125, 0.25] and magnitudes[-1] == 7.5
    values = magnitudes[1:] + [-m for m in magnitudes[1:]]
    for start in range(0, len(values), 31):
        chunk = [7.5] + values[start : start + 31]  # 7.5 pins the scale at 2^0
        assert roundtrip(chunk).tolist() == chunk


def test_the_shared_scale_is_floor_log2_amax_minus_two() -> None:
    # amax 100: floor(log2 100) = 6, scale 2^4 (code 131); 100 / 16 = 6.25 lies halfway
    # between 6.0 and 6.5: ties to even (6.0, mantissa 100b) -> 96.
    data = encode_mxfp6(one_block([100.0, 1.0]), 0)
    assert data[0] == 131
    assert roundtrip([100.0, 1.0]).tolist() == [96.0, 0.0]  # 1/16 is below half of 1/8
    # amax 0.3: floor(log2 0.3) = -2, scale 2^-4 (code 123); 0.3 * 16 = 4.8 -> 5.0 -> 0.3125.
    data = encode_mxfp6(one_block([0.3]), 0)
    assert data[0] == 123
    assert roundtrip([0.3]).tolist() == [0.3125]


def test_halfway_values_round_to_the_even_mantissa() -> None:
    # With the scale fixed at 2^0 by 4.0: steps are 1/8 below 2, 1/4 in [2, 4), 1/2 in [4, 8).
    ties = [1.0625, 1.1875, 0.0625, 0.1875, 2.125, 5.25, 1.9375]
    expected = [1.0, 1.25, 0.0, 0.25, 2.0, 5.0, 2.0]
    assert roundtrip([4.0, *ties]).tolist() == [4.0, *expected]
    assert roundtrip([4.0, *(-t for t in ties)]).tolist() == [4.0, *(-e for e in expected)]


def test_values_past_the_largest_element_saturate_to_7_5_times_the_scale() -> None:
    # amax 7.9 keeps the scale at 2^0 and rounds to 8, beyond E2M3: saturates to 7.5.
    assert roundtrip([7.9, -7.8, 7.75, 7.7]).tolist() == [7.5, -7.5, 7.5, 7.5]


def test_an_all_zero_block_takes_the_smallest_scale_and_decodes_to_zeros() -> None:
    data = encode_mxfp6(np.zeros((32, 1), np.float32), 0)
    assert data == bytes(BLOCK_BYTES)  # log2(0) = -inf clamps to E8M0 code 0 (2^-127)
    assert not decode_mxfp6(data, (32, 1), 0, "float32").any()


def test_a_block_with_a_non_finite_value_gets_the_nan_scale() -> None:
    data = encode_mxfp6(one_block([1.0, math.inf]), 0)
    assert data[0] == 0xFF
    assert np.isnan(decode_mxfp6(data, (32, 1), 0, "float32")).all()


def test_a_partial_last_block_is_zero_padded_and_blocks_run_along_the_given_axis() -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((40, 3)).astype(np.float32)  # K = 40: blocks of 32 and 8 (+24 pad)
    data = encode_mxfp6(w, 0)
    assert len(data) == mxfp6_nbytes(w.shape, 0) == 3 * 2 * BLOCK_BYTES
    second_block = data[BLOCK_BYTES : 2 * BLOCK_BYTES]
    assert second_block[1 + 6 :] == bytes(18)  # codes 8..31 of the block are padding
    assert np.array_equal(naive_decode(data, w.shape, 0), decode_mxfp6(data, w.shape, 0, "float64"))
    wt = np.ascontiguousarray(w.T)  # the same weight as Gemm transB=1 stores it: K is axis 1
    assert encode_mxfp6(wt, 1) == data


def test_random_weights_decode_within_half_a_top_binade_step_and_reencode_identically() -> None:
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((96, 5)) * np.array([1e-3, 0.1, 1.0, 30.0, 1e4])).astype(np.float32)
    data = encode_mxfp6(w, 0)
    decoded = naive_decode(data, w.shape, 0)
    assert np.array_equal(decode_mxfp6(data, w.shape, 0, "float64"), decoded)
    blocks = w.T.reshape(5, 3, 32)
    scales = 2.0 ** (np.floor(np.log2(np.abs(blocks).max(axis=-1))) - 2)
    bound = np.repeat(scales, 32, axis=-1).reshape(5, 96).T / 2
    assert (np.abs(decoded - w) <= bound).all()
    assert encode_mxfp6(decoded.astype(np.float32), 0) == data


def test_decoded_weights_are_fp16_values_and_saturate_beyond_its_range() -> None:
    data = encode_mxfp6(one_block([1e6, 3e-9]), 0)
    decoded = decode_mxfp6(data, (32, 1), 0, "float32").ravel()
    assert decoded[0] == 65504.0 and decoded[1] == 0.0  # 1e6 -> 983040 -> fp16 max
    assert decode_mxfp6(data, (32, 1), 0, "float16").dtype == np.float16


# ------------------------------------------------------------------------- models and ORT


def _ort(model: onnx.ModelProto | str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    source = model if isinstance(model, str) else model.SerializeToString()
    session = ort.InferenceSession(source, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds), strict=True))


def _linear_model(
    op: str, x_shape: tuple[int, ...], weights: dict[str, np.ndarray], out_shape: tuple[int, ...]
) -> onnx.ModelProto:
    attrs: dict[str, Any] = {"transB": 1} if op == "Gemm" else {}
    node = helper.make_node(op, ["x", *weights], ["y"], name="linear", **attrs)
    graph = helper.make_graph(
        [node],
        "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(out_shape))],
        [numpy_helper.from_array(v, k) for k, v in weights.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _stored_weight(qpc: Path | bytes, name: str) -> tuple[ConstantEntry, bytes]:
    with load_qpc(qpc) as container:
        (entry,) = [e for e in container.constants() if e.name == name]
        data = bytes(
            container.segments["constants.bin"][entry.offset : entry.offset + entry.nbytes]
        )
    return entry, data


class Case(NamedTuple):
    op: str
    x_shape: tuple[int, ...]
    weights: dict[str, tuple[int, ...]]
    out_shape: tuple[int, ...]
    k_axis: int
    """B's reduction axis: where its MXFP6 blocks run."""


CASES = {
    "matmul_batched_partial_block": Case("MatMul", (2, 5, 200), {"w": (200, 48)}, (2, 5, 48), 0),
    "gemm_transB_with_bias": Case("Gemm", (6, 72), {"w": (40, 72), "c": (40,)}, (6, 40), 1),
}


@pytest.mark.parametrize("fp16", [False, True], ids=["fp32-activations", "fp16"])
@pytest.mark.parametrize("cores", [1, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_mxfp6_weights_match_onnxruntime_on_the_dequantized_weights(
    case: str, cores: int, fp16: bool, record_property: Any
) -> None:
    op, x_shape, shapes, out_shape, axis = CASES[case]
    rng = np.random.default_rng(3)
    weights = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    x = rng.standard_normal(x_shape).astype(np.float32)
    model = _linear_model(op, x_shape, weights, out_shape)
    flags = ["-mxfp6-matmul", f"-aic-num-cores={cores}"] + (["-convert-to-fp16"] * fp16)
    result = compile_model(model, flags)
    ours = run_qpc(result.qpc_path, {"x": x})["y"]

    entry, data = _stored_weight(result.qpc_path, "w")
    assert (entry.encoding, entry.block_axis, entry.shape) == ("mxfp6", axis, shapes["w"])
    assert entry.dtype == ("float16" if fp16 else "float32")
    dequantized = naive_decode(data, shapes["w"], axis).astype(np.float32)
    bias = _stored_weight(result.qpc_path, "c")[0] if "c" in shapes else None
    assert bias is None or bias.encoding is None  # Gemm's C stays raw
    # Small constants are inlined in the kernels' NodeInfo; an MXFP6 weight is not.
    (kernel,) = [k for k in result.program.kernels if k.info.op_type == op]
    assert 1 not in kernel.info.consts

    want = _ort(_linear_model(op, x_shape, {**weights, "w": dequantized}, out_shape), {"x": x})
    tol = FP16_TOL if fp16 else FP32_TOL
    np.testing.assert_allclose(ours, want["y"], rtol=tol.rtol, atol=tol.atol)

    exact = _ort(model, {"x": x})["y"]
    rel = float(np.abs(ours - exact).max() / np.abs(exact).max())
    record_property("max_abs_error_vs_fp32", float(np.abs(ours - exact).max()))
    record_property("max_error_over_max_output", rel)
    assert rel <= MXFP6_MATMUL_REL_ERROR


def test_a_4_mib_fp32_weight_shrinks_to_6_25_bits_per_element_in_the_metrics() -> None:
    rng = np.random.default_rng(4)
    w = rng.standard_normal((1024, 1024)).astype(np.float32)
    model = _linear_model("MatMul", (1, 1024), {"w": w}, (1, 1024))
    plain = compile_model(model).metrics
    mx = compile_model(model, ["-mxfp6-matmul"]).metrics
    assert plain["final_constants_size"] == plain["constants_size_before_layout_conversion"]
    assert mx["constants_size_before_layout_conversion"] == 4 * 1024 * 1024
    assert mx["final_constants_size"] == 1024 * 32 * BLOCK_BYTES == 819_200  # 0.78 MiB
    assert mx["static_constants_size"] == 819_200
    assert mx["ddr_size"] < plain["ddr_size"] - 3_000_000
    constant_reads = mx["memory_traffic"]["total"]["ddr_read_constant_only_bytes"]
    assert constant_reads < plain["memory_traffic"]["total"]["ddr_read_constant_only_bytes"] / 4


def test_mxfp6_compiles_are_byte_identical() -> None:
    model = transformer_encoder()
    first = compile_model(model, ["-mxfp6-matmul", "-aic-num-cores=4"])
    second = compile_model(model, ["-mxfp6-matmul", "-aic-num-cores=4"])
    assert first.qpc == second.qpc


def test_a_constant_also_read_by_another_op_stays_raw_and_no_weight_warns() -> None:
    w = np.random.default_rng(5).standard_normal((32, 32)).astype(np.float32)
    matmul = helper.make_node("MatMul", ["x", "w"], ["m"])
    add = helper.make_node("Add", ["m", "w"], ["y"])
    graph = helper.make_graph(
        [matmul, add],
        "shared",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [32, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [32, 32])],
        [numpy_helper.from_array(w, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    result = compile_model(model, ["-mxfp6-matmul"])
    assert _stored_weight(result.qpc_path, "w")[0].encoding is None
    assert [w["code"] for w in result.warnings] == ["mxfp6_no_weights"]
    x = np.random.default_rng(6).standard_normal((32, 32)).astype(np.float32)
    np.testing.assert_allclose(run_qpc(result.qpc_path, {"x": x})["y"], x @ w + w, rtol=1e-4)


def test_a_tampered_mxfp6_constant_size_fails_validation_and_the_runtime() -> None:
    model = _linear_model("MatMul", (2, 64), {"w": np.ones((64, 8), np.float32)}, (2, 8))
    result = compile_model(model, ["-mxfp6-matmul"])
    assert validate_qpc(result.qpc_path, device="aic100-pro").ok
    with load_qpc(result.qpc_path) as container:
        assert container.network is not None
        assert container.network.requirements.dtypes == ("float32", "mxfp6")
    with load_qpc(result.qpc_path) as container:
        segments = {n: bytes(v) for n, v in container.segments.items() if not n.endswith(".crc")}
    (entry,) = decode_constantsdesc(segments["constantsdesc.bin"])
    assert entry.nbytes == 8 * 2 * BLOCK_BYTES
    bad = ConstantEntry(entry.name, entry.dtype, entry.shape, 0, 8 * BLOCK_BYTES, "mxfp6", 0)
    segments["constantsdesc.bin"] = encode_constantsdesc([bad])
    tampered = qpc_bytes(
        [Segment(n, d, None if n == "constants.bin" else 0) for n, d in segments.items()]
    )
    check = validate_qpc(tampered).check("constants-descriptor")
    assert not check.ok
    assert check.message == (
        "MXFP6 constant 'w' of shape [64, 8] blocked along axis 0 takes 400 B (25 B per "
        "32-element block), constantsdesc says 200 B"
    )
    with pytest.raises(CompileError, match="needs 400 bytes, not 200"):
        run_qpc(tampered, {"x": np.zeros((2, 64), np.float32)})


@pytest.mark.parametrize(
    "flags", [["-mxfp6-matmul"], ["-mxfp6-matmul", "-convert-to-fp16", "-aic-num-cores=4"]]
)
def test_transformer_with_mxfp6_weights_stays_within_tolerance_of_ort_fp32(
    flags: list[str], record_property: Any
) -> None:
    model = transformer_encoder()
    x = np.random.default_rng(1).standard_normal((2, 16, 64)).astype(np.float32)
    result = compile_model(model, flags)
    with load_qpc(result.qpc_path) as container:
        encoded = sorted(e.name for e in container.constants() if e.encoding == "mxfp6")
    assert encoded == ["w1", "w2", "wk", "wo", "wq", "wv"]
    ours = run_qpc(result.qpc_path, {"x": x})["y"]
    want = _ort(model, {"x": x})["y"]
    record_property("max_abs_error", float(np.abs(ours - want).max()))
    np.testing.assert_allclose(ours, want, rtol=MXFP6_TOL.rtol, atol=MXFP6_TOL.atol)


# ------------------------------------------------------------------------ -convert-to-fp16


FP16_LIGHT_MODELS = ["light_shufflenet", "light_densenet121"]
"""Light CNNs whose fp32 activations stay within fp16's range (densenet121 peaks at ~616)."""


@pytest.mark.parametrize("name", FP16_LIGHT_MODELS)
def test_light_cnn_in_fp16_stays_within_tolerance_of_ort_fp32(name: str) -> None:
    path = light_model_path(name)
    result = compile_model(path, ["-convert-to-fp16"])
    program = result.program
    feeds = {
        program.tensors[t].name: light_model_input(program.tensors[t].shape) for t in program.inputs
    }
    ours = run_qpc(result.qpc_path, feeds)
    for key, want in _ort(path, feeds).items():
        np.testing.assert_allclose(
            ours[key], want, rtol=FP16_TOL.rtol, atol=FP16_TOL.atol, err_msg=key
        )


def test_fp16_activations_beyond_its_range_are_not_hidden() -> None:
    # light_squeezenet's synthetic weights drive fp32 activations to ~1.4e10: in fp16 they
    # overflow, and the output says so (non-finite) instead of looking plausible; the run
    # says where (tests/test_numerics.py).
    path = light_model_path("light_squeezenet")
    result = compile_model(path, ["-convert-to-fp16"])
    program = result.program
    feeds = {
        program.tensors[t].name: light_model_input(program.tensors[t].shape) for t in program.inputs
    }
    with pytest.warns(NonFiniteWarning):
        (out,) = run_qpc(result.qpc_path, feeds).values()
    assert not np.isfinite(out).all()


@pytest.mark.parametrize("cores", [1, 4])
def test_transformer_in_fp16_stays_within_tolerance_of_ort_fp32(cores: int) -> None:
    model = transformer_encoder()
    x = np.random.default_rng(1).standard_normal((2, 16, 64)).astype(np.float32)
    result = compile_model(model, ["-convert-to-fp16", f"-aic-num-cores={cores}"])
    ours = run_qpc(result.qpc_path, {"x": x})["y"]
    np.testing.assert_allclose(
        ours, _ort(model, {"x": x})["y"], rtol=FP16_TOL.rtol, atol=FP16_TOL.atol
    )
