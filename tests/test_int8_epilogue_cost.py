"""The cost of an integer epilogue step (a QAdd or QMul run on an integer kernel's output
tile): HVX instructions of its fixed-point arithmetic, not one vector instruction per 128
codes. A float step keeps one instruction per vector; a step that reads a second activation
(a residual QAdd) costs more than one that reads the running value and a constant."""

from __future__ import annotations

import math

from compiler_core.compile import compile_model
from compiler_core.cost_rates import (
    INT8_STEP_OPERAND_VECTOR_OPS,
    INT8_STEP_VECTOR_OPS,
    INT8_VECTOR_LANES,
    epilogue_hvx_cycles,
)
from compiler_core.cost_timeline import epilogue_operands
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
    alone = epilogue_hvx_cycles(TILE, ("int8",), (0,), PRO)
    residual = epilogue_hvx_cycles(TILE, ("int8",), (1,), PRO)
    vectors = TILE / INT8_VECTOR_LANES
    assert alone == math.ceil(vectors * INT8_STEP_VECTOR_OPS / PRO.hvx_threads)
    assert residual == math.ceil(
        vectors * (INT8_STEP_VECTOR_OPS + INT8_STEP_OPERAND_VECTOR_OPS) / PRO.hvx_threads
    )
    # far more than the one instruction per 128 codes a plain int8 vector op would take
    assert alone >= 10 * math.ceil(vectors / PRO.hvx_threads)
    assert residual > alone


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
            assert epilogue_operands(program, kernel.inputs, kernel.epilogue)[0] == 1
        busy = result.metrics["unit_busy_percent"]
        assert busy["hvx"] > 0
    finally:
        result.cleanup()
