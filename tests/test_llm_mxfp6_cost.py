"""MXFP6 weights are priced with their decompression: a streamed MXFP6 weight crosses DDR at its
stored size and is decoded to fp16 on the HVX (16 weights a cycle per core, see
cost_rates.MXFP6_DECODE_VECTOR_OPS) before the tile's HMX work; resident weights stay decoded."""

from __future__ import annotations

import math

import numpy as np
import onnx.helper as oh
import pytest
from onnx import TensorProto, numpy_helper

from compiler_core.compile import compile_model
from compiler_core.cost_rates import MXFP6_DECODE_VECTOR_OPS
from compiler_core.cost_timeline import build_timeline, tile_compute
from compiler_core.lowering.program import KIND_CONSTANT, RunKernel

K, N = 4096, 2048  # 16 MiB of fp16 weights: more than one core's VTCM, so they stream


def _matmul() -> bytes:
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((K, N)).astype(np.float16), "w")
    graph = oh.make_graph(
        [oh.make_node("MatMul", ["x", "w"], ["y"])],
        "mm",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT16, [1, K])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT16, [1, N])],
        [w],
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)]).SerializeToString()


@pytest.mark.parametrize("cores", [1, 4])
def test_streamed_mxfp6_weights_pay_their_hvx_decode_before_hmx(cores: int) -> None:
    """Each tile decodes the weights it streams (resident ones were decoded at activation)."""
    flags = ["-aic-device=aic100-standard", f"-aic-num-cores={cores}", "-mxfp6-matmul"]
    result = compile_model(_matmul(), flags)
    try:
        program, device = result.program, result.options.device
        decode = 0
        for stream in program.streams:
            for instr in stream:
                if not isinstance(instr, RunKernel):
                    continue
                cost = tile_compute(program, instr, device)
                kernel = program.kernels[instr.kernel]
                weights = [
                    op
                    for tid, op in zip(kernel.inputs, instr.inputs, strict=True)
                    if op is not None
                    and program.tensors[tid].kind == KIND_CONSTANT
                    and any(piece.vtcm >= program.resident for piece in op.pieces)
                ]
                elements = sum(math.prod(b - a for a, b in op.box) for op in weights)
                rate = device.hvx_threads * 64 / MXFP6_DECODE_VECTOR_OPS
                assert cost.decode_cycles == math.ceil(elements / rate)
                assert cost.cycles == cost.decode_cycles + max(
                    cost.main_cycles, cost.epilogue_cycles
                )
                decode += cost.decode_cycles
        if cores == 1:  # nothing of the weight is resident: every weight is decoded once
            assert decode >= K * N / (device.hvx_threads * 64 / MXFP6_DECODE_VECTOR_OPS)
        timeline = build_timeline(program, device)
        hvx = sum(max(timeline.thread_busy(c)[t] for t in ("hvx0", "hvx1")) for c in range(cores))
        assert hvx >= decode  # the decode runs on the HVX threads
    finally:
        result.cleanup()


def test_fp16_weights_pay_no_decode() -> None:
    result = compile_model(_matmul(), ["-aic-device=aic100-standard", "-aic-num-cores=1"])
    try:
        program, device = result.program, result.options.device
        costs = [
            tile_compute(program, i, device)
            for s in program.streams
            for i in s
            if isinstance(i, RunKernel)
        ]
        assert costs and all(c.decode_cycles == 0 for c in costs)
    finally:
        result.cleanup()
