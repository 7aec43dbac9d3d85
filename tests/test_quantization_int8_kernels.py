"""The int8 kernels compute in exact integer arithmetic: fixed-point multipliers are the float32
multipliers exactly, rounding is half to even on the exact product, accumulation wraps at 32
bits; a QMatMul/QConv program gives the integer reference's codes on 1 and 4 cores; the cost
model prices them at the int8 HMX rate and the metrics say which nodes run int8."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import onnx
import onnx.helper as oh
import pytest
from onnx import TensorProto
from onnx import numpy_helper as nh

from compiler_core.compile import compile_model
from compiler_core.cost_rates import tile_cost
from compiler_core.ops import REGISTRY
from compiler_core.ops.int8 import DOMAIN, fixed_point, requant_table, round_shift
from compiler_core.runtime import run_qpc
from tests.quant_models import calibration, cnn, ort_qdq

RNG = np.random.default_rng(15)


def exact_round(value: Fraction) -> int:
    """Round half to even, on an exact rational."""
    floor = value.numerator // value.denominator
    rest = value - floor
    if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and floor % 2 == 1):
        return floor + 1
    return floor


def test_fixed_point_is_the_float32_multiplier_exactly():
    values = np.concatenate([RNG.uniform(1e-6, 4.0, 200), [2.0**-30, 0.5, 1.0, 3.0, 1e-12]]).astype(
        np.float32
    )
    mant, shift = fixed_point(values)
    for v, m, s in zip(values, mant, shift, strict=True):
        if v < 2.0**-38:
            continue
        assert Fraction(int(m), 2 ** int(s)) == Fraction(float(v)), v
        assert 0 <= m < 2**24


def test_round_shift_is_half_to_even_on_the_exact_value():
    xs = RNG.integers(-(2**40), 2**40, 500, dtype=np.int64)
    xs = np.concatenate([xs, [-6, -5, -3, -2, -1, 0, 1, 2, 3, 5, 6]])
    for s in (0, 1, 2, 7, 20):
        got = round_shift(xs, s)
        want = [exact_round(Fraction(int(x), 2**s)) for x in xs]
        np.testing.assert_array_equal(got, want)


def qmatmul_model(
    a_shape, b, bias, rq, a_zero, y_zero, y_dtype=TensorProto.INT8
) -> onnx.ModelProto:
    node = oh.make_node(
        "QMatMul", ["a", "b", "bias", "", "rq"], ["y"], domain=DOMAIN, x_zero=a_zero, y_zero=y_zero
    )
    graph = oh.make_graph(
        [node],
        "qmatmul",
        [oh.make_tensor_value_info("a", TensorProto.UINT8, a_shape)],
        [oh.make_tensor_value_info("y", y_dtype, [*a_shape[:-1], b.shape[1]])],
        [nh.from_array(b, "b"), nh.from_array(bias, "bias"), nh.from_array(rq, "rq")],
    )
    model = oh.make_model(
        graph, opset_imports=[oh.make_opsetid("", 17), oh.make_opsetid(DOMAIN, 1)]
    )
    model.ir_version = 9
    return model


@pytest.mark.parametrize("cores", [1, 4])
def test_qmatmul_program_gives_the_integer_reference_codes(cores):
    k, n = 96, 40
    a = RNG.integers(0, 256, (2, 16, k), dtype=np.uint8)
    b = RNG.integers(-127, 128, (k, n), dtype=np.int8)
    bias = RNG.integers(-5000, 5000, (n,), dtype=np.int32)
    multipliers = RNG.uniform(1e-4, 3e-4, n).astype(np.float32)
    rq = requant_table(multipliers)
    model = qmatmul_model([2, 16, k], b, bias, rq, a_zero=128, y_zero=-3)
    result = compile_model(model, [f"-aic-num-cores={cores}"])
    y = run_qpc(result.qpc_path, {"a": a})["y"]
    acc = (a.astype(np.int64) - 128) @ b.astype(np.int64) + bias
    mults = [Fraction(float(m)) for m in multipliers]
    want = np.array(
        [
            [[exact_round(int(v) * mults[j]) for j, v in enumerate(row)] for row in mat]
            for mat in acc
        ]
    )
    np.testing.assert_array_equal(y, np.clip(want - 3, -128, 127).astype(np.int8))
    result.cleanup()


def test_accumulator_wraps_at_32_bits_as_the_hardware_does():
    from compiler_core.ops.int8 import _wrap_int32

    assert int(_wrap_int32(np.array([2**31]))[0]) == -(2**31)
    assert int(_wrap_int32(np.array([-(2**31) - 1]))[0]) == 2**31 - 1


def test_int8_kernels_are_priced_at_the_int8_rate_and_weights_take_one_byte():
    model = cnn()
    qdq = ort_qdq(model, calibration(model), per_channel=True)
    quant = compile_model(qdq)
    floats = compile_model(model, ["-convert-to-fp16"])
    device = quant.options.device

    def conv_cycles(result, op_type):
        kernel = next(k for k in result.program.kernels if k.info.op_type == op_type)
        opdef = REGISTRY.lookup(kernel.info.op_type, kernel.info.domain)
        box = tuple((0, d) for d in kernel.info.out_shapes[0])
        return tile_cost(kernel.info, "hmx", kernel.macs, (), box, [], opdef, device).main_cycles

    assert conv_cycles(quant, "QConv") < conv_cycles(floats, "Conv")
    weights = {t.name: t for t in quant.program.tensors if t.kind == "constant"}
    assert any(t.dtype == "int8" for t in weights.values())
    precision = quant.metrics["precision"]
    assert precision["int8"]["hmx_macs"] > 0 and "Conv" not in str(precision.get("fp32", ""))
    assert any("Conv" in n for n in precision["int8"]["nodes"])
    assert "fp16" in floats.metrics["precision"]
    quant.cleanup()
    floats.cleanup()


def test_round_divide_is_half_to_even_on_the_exact_quotient():
    from compiler_core.ops.int8 import _round_divide

    n = RNG.integers(-(2**40), 2**40, 400, dtype=np.int64)
    n = np.concatenate([n, [-9, -3, -2, 2, 3, 6, 9, 10]])
    d = RNG.integers(1, 50, n.size, dtype=np.int64)
    want = [exact_round(Fraction(int(a), int(b))) for a, b in zip(n, d, strict=True)]
    np.testing.assert_array_equal(_round_divide(n, d), want)
    as_ints = _round_divide(n.astype(object), d.astype(object) << 40)
    want = [exact_round(Fraction(int(a), int(b) << 40)) for a, b in zip(n, d, strict=True)]
    np.testing.assert_array_equal(as_ints.astype(np.int64), want)


@pytest.mark.parametrize("cores", [1, 4])
@pytest.mark.parametrize("include_pad", [0, 1])
def test_qaverage_pool_program_gives_the_integer_reference_codes(cores, include_pad):
    """Each window's exact sum times s_x / s_y over its own count (pads, ceil_mode edges),
    rounded half to even once."""
    x = RNG.integers(0, 256, (2, 5, 12, 11), dtype=np.uint8)
    multiplier = np.float32(0.8731)
    mant, shift = fixed_point(multiplier)
    pads, kernel, strides = [1, 0, 1, 1], [3, 2], [2, 2]
    node = oh.make_node(
        "QAveragePool",
        ["x"],
        ["y"],
        domain=DOMAIN,
        kernel_shape=kernel,
        strides=strides,
        pads=pads,
        ceil_mode=1,
        count_include_pad=include_pad,
        x_zero=128,
        y_zero=-3,
        mult=int(mant),
        shift=int(shift),
    )
    rows, cols = 7, 6  # ceil((12 + 2 - 3) / 2) + 1: the last row window passes the pad
    graph = oh.make_graph(
        [node],
        "qavgpool",
        [oh.make_tensor_value_info("x", TensorProto.UINT8, x.shape)],
        [oh.make_tensor_value_info("y", TensorProto.INT8, [2, 5, rows, cols])],
    )
    model = oh.make_model(
        graph, opset_imports=[oh.make_opsetid("", 17), oh.make_opsetid(DOMAIN, 1)]
    )
    model.ir_version = 9
    result = compile_model(model, [f"-aic-num-cores={cores}"])
    y = run_qpc(result.qpc_path, {"x": x})["y"]
    result.cleanup()
    centred = x.astype(np.int64) - 128
    m = Fraction(float(multiplier))
    want = np.zeros((2, 5, rows, cols), np.int64)
    for i in range(rows):
        r0 = i * strides[0] - pads[0]
        r_taps = range(r0, r0 + kernel[0])
        r_in = [r for r in r_taps if 0 <= r < 12]
        r_count = sum(-pads[0] <= r < 12 + pads[2] for r in r_taps) if include_pad else len(r_in)
        for j in range(cols):
            c0 = j * strides[1] - pads[1]
            c_taps = range(c0, c0 + kernel[1])
            c_in = [c for c in c_taps if 0 <= c < 11]
            c_count = (
                sum(-pads[1] <= c < 11 + pads[3] for c in c_taps) if include_pad else len(c_in)
            )
            sums = centred[:, :, r_in][:, :, :, c_in].sum(axis=(2, 3))
            for n, c in np.ndindex(2, 5):
                q = exact_round(int(sums[n, c]) * m / (r_count * c_count))
                want[n, c, i, j] = min(max(q - 3, -128), 127)
    np.testing.assert_array_equal(y, want.astype(np.int8))
