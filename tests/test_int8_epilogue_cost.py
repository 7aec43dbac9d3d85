"""The cost of an integer epilogue step (a QAdd or QMul run on an integer kernel's output
tile): HVX instructions of its fixed-point arithmetic, counted from the step's attributes,
not one vector instruction per 128 codes. A float step keeps one instruction per vector; a
step that reads a second activation (a residual QAdd) costs more than one that reads the
running value and a constant; zero points, a constant term and a narrowed saturation range
each cost what they add to the arithmetic, and nothing when the program has none."""

from __future__ import annotations

import math

from compiler_core.compile import compile_model
from compiler_core.cost_rates import (
    INT8_CLAMP_OPS,
    INT8_OFFSET_OPS,
    INT8_OUTPUT_ZERO_OPS,
    INT8_STEP_OPERAND_VECTOR_OPS,
    INT8_STEP_VECTOR_OPS,
    INT8_VECTOR_LANES,
    epilogue_hvx_cycles,
    int8_step_ops,
)
from compiler_core.cost_timeline import epilogue_ops
from compiler_core.devices import get_device
from tests.quant_models import calibration, cnn, ort_qdq

PRO = get_device("aic100-pro")
TILE = 32 * 1024


def test_a_float_step_is_one_vector_instruction_per_vector() -> None:
    # 64 fp16 lanes per 1024-bit vector, 4 HVX threads
    assert epilogue_hvx_cycles(TILE, ("float16",), (), PRO) == TILE // 64 // 4
    assert epilogue_hvx_cycles(TILE, ("float16", "float16"), (), PRO) == 2 * TILE // 64 // 4
    assert epilogue_hvx_cycles(TILE, (), (), PRO) == 0


def test_an_integer_step_costs_its_requantizing_instructions() -> None:
    alone = epilogue_hvx_cycles(TILE, ("int8",), (INT8_STEP_VECTOR_OPS,), PRO)
    residual = epilogue_hvx_cycles(
        TILE, ("int8",), (INT8_STEP_VECTOR_OPS + INT8_STEP_OPERAND_VECTOR_OPS,), PRO
    )
    vectors = TILE / INT8_VECTOR_LANES
    assert alone == math.ceil(vectors * INT8_STEP_VECTOR_OPS / PRO.hvx_threads)
    assert residual == math.ceil(
        vectors * (INT8_STEP_VECTOR_OPS + INT8_STEP_OPERAND_VECTOR_OPS) / PRO.hvx_threads
    )
    # far more than the one instruction per 128 codes a plain int8 vector op would take
    assert alone >= 10 * math.ceil(vectors / PRO.hvx_threads)
    assert residual > alone


ZERO = {"a_zero": 0, "b_zero": 0, "y_zero": 0}


def test_a_steps_instructions_follow_its_attributes() -> None:
    # the running value and a constant, with an input zero point: the 18 of the docs
    centred = {**ZERO, "a_zero": 3}
    assert int8_step_ops("QAdd", centred, "int8", [False, True]) == INT8_STEP_VECTOR_OPS
    # a residual add with zero points: 18 + 13
    both = {**ZERO, "a_zero": 3, "b_zero": -2}
    residual = INT8_STEP_VECTOR_OPS + INT8_STEP_OPERAND_VECTOR_OPS
    assert int8_step_ops("QAdd", both, "int8", [False, False]) == residual
    # symmetric codes (every zero point 0) add no constant term
    assert int8_step_ops("QAdd", ZERO, "int8", [False, False]) == residual - INT8_OFFSET_OPS
    # an output zero point alone is a saturating int16 add after the first narrowing
    assert (
        int8_step_ops("QAdd", {**ZERO, "y_zero": 5}, "int8", [False, False])
        == residual - INT8_OFFSET_OPS + INT8_OUTPUT_ZERO_OPS
    )
    # a fused Relu narrows int8's range to [0, 127]: one more instruction; uint8's [0, 255]
    # is the type's own
    relu = {**ZERO, "y_min": 0, "y_max": 127}
    assert int8_step_ops("QAdd", relu, "int8", [False, False]) == (
        residual - INT8_OFFSET_OPS + INT8_CLAMP_OPS
    )
    assert int8_step_ops("QAdd", {**ZERO, "y_min": 0, "y_max": 255}, "uint8", [False, False]) == (
        residual - INT8_OFFSET_OPS
    )
    # a QMul by a constant folds the constant into its per-element multiplier
    assert int8_step_ops("QMul", ZERO, "int8", [False, True]) < INT8_STEP_VECTOR_OPS


def test_the_timeline_counts_a_residual_add_as_a_second_activation_operand() -> None:
    model = cnn()
    qdq = ort_qdq(model, calibration(model), per_channel=True)
    result = compile_model(qdq, ["-aic-num-cores=1"])
    try:
        program = result.program
        fused = [k for k in program.kernels if ("QConv", "QAdd") == tuple(k.op_types)[:2]]
        assert fused, [k.op_types for k in program.kernels]
        for kernel in fused:
            # the QAdd step reads the running value and the skip connection (an activation)
            step = kernel.epilogue[0]
            ops = epilogue_ops(program, kernel.inputs, kernel.epilogue)[0]
            assert ops == int8_step_ops(step.op_type, step.attrs, step.out_dtype, [False, False])
            # more than the running value's own arithmetic (widen, scale, narrow)
            assert ops > INT8_STEP_VECTOR_OPS - INT8_OFFSET_OPS
        busy = result.metrics["unit_busy_percent"]
        assert busy["hvx"] > 0
    finally:
        result.cleanup()
