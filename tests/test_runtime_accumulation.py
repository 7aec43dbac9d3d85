"""How the runtime's matrix kernels sum, and what it may keep between inferences.

fp32 products run through numpy's BLAS in fp32: results may depend on the tiling by fp32
rounding only, outputs whose weight rows are equal stay exactly equal (the ONNX light CNNs,
whose weights are all constant-filled, depend on it), and widened constants are only ever
handed to a kernel whose buffer provably holds that constant (docs/compiler.md, "Numerics").
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler_core import QpcSession, compile_model, run_qpc
from compiler_core.lowering.program import DmaLoad, Program
from compiler_core.ops import REGISTRY, NodeInfo, TileCtx
from compiler_core.ops.registry import full_box
from compiler_core.qpc.container import load_qpc
from compiler_core.runtime.copies import ConstantCopies
from compiler_core.runtime.executor import Executor
from tests.models import transformer_encoder

VTCM = 8_323_072
RNG = np.random.default_rng(13)


def _node(
    op: str, inputs: list[np.ndarray], out_shape: tuple[int, ...], **attrs: object
) -> NodeInfo:
    return NodeInfo(
        op_type=op,
        name=op,
        attrs=dict(attrs),
        in_shapes=tuple(tuple(x.shape) for x in inputs),
        in_dtypes=tuple(str(x.dtype) for x in inputs),
        out_shapes=(out_shape,),
        out_dtypes=("float32",),
        opset=17,
    )


def _run(node: NodeInfo, inputs: list[np.ndarray]) -> np.ndarray:
    opdef = REGISTRY.lookup(node.op_type, "", node.opset)
    assert opdef is not None
    return opdef.compute(node, list(inputs), TileCtx.whole(node))[0]


@pytest.mark.parametrize("op", ["Conv", "MatMul", "Gemm"])
def test_outputs_of_equal_weight_rows_are_bit_equal(op: str) -> None:
    # large, varied inputs: an fp32 BLAS sum of them lands a rounding apart from column to
    # column; equal weight rows must still give equal outputs, as exact arithmetic does
    if op == "Conv":
        x = (RNG.standard_normal((1, 24, 9, 11)) * 1e6).astype(np.float32)
        w = np.full((40, 24, 3, 3), 0.37, np.float32)
        node = _node(op, [x, w], (1, 40, 9, 11), pads=[1, 1, 1, 1])
        y, channels = _run(node, [x, w]), 1
    elif op == "MatMul":
        x = (RNG.standard_normal((3, 17, 300)) * 1e6).astype(np.float32)
        w = np.full((300, 64), -1.3, np.float32)
        y, channels = _run(_node(op, [x, w], (3, 17, 64)), [x, w]), -1
    else:
        x = (RNG.standard_normal((5, 300)) * 1e6).astype(np.float32)
        w = np.full((70, 300), 0.11, np.float32)
        b = np.zeros(70, np.float32)
        y, channels = _run(_node(op, [x, w, b], (5, 70), transB=1), [x, w, b]), -1
    first = np.take(y, [0], axis=channels)
    assert np.abs(first).max() > 1e6
    assert np.array_equal(y, np.broadcast_to(first, y.shape))


def test_core_counts_agree_within_fp32_rounding() -> None:
    """fp32 sums depend on the tile shapes, by fp32 rounding only (docs: 1e-6 of the output's
    largest value at most; measured 1.2e-7 on this encoder)."""
    model = transformer_encoder()
    x = np.random.default_rng(1).standard_normal((2, 16, 64)).astype(np.float32)
    outputs = {}
    for cores in (1, 3, 8):
        result = compile_model(model, [f"-aic-num-cores={cores}"])
        try:
            outputs[cores] = run_qpc(result.qpc_path, {"x": x})["y"]
        finally:
            result.cleanup()
    scale = float(np.abs(outputs[1]).max())
    for cores in (3, 8):
        assert float(np.abs(outputs[cores] - outputs[1]).max()) <= 1e-6 * scale


def test_a_buffer_holds_a_constant_until_any_byte_of_it_is_written() -> None:
    copies = ConstantCopies(2)
    held = (5, ((0, 4), (0, 8)))
    copies.wrote(0, 1024, 1152, held)
    assert copies.holds(0, 1024, held)
    assert not copies.holds(1, 1024, held)  # another core's VTCM
    assert not copies.holds(0, 1024, (6, held[1]))  # another tensor
    copies.wrote(0, 0, 1024, None)  # ends where the buffer starts: untouched
    assert copies.holds(0, 1024, held)
    copies.wrote(0, 1151, 1200, None)  # its last byte
    assert not copies.holds(0, 1024, held)
    copies.wrote(1, 64, 192, held)
    copies.seal_resident()
    copies.forget_scratch()
    assert copies.holds(1, 64, held)  # loaded at activation: kept
    wide = copies.widened(held, held[1], np.ones((4, 8), np.float16), np.float32)
    assert wide.dtype == np.float32 and not wide.flags.writeable
    assert copies.widened(held, held[1], np.zeros((4, 8), np.float16), np.float32) is wide
    silent = ConstantCopies(1, tracking=False)
    silent.wrote(0, 0, 64, held)
    assert not silent.holds(0, 0, held)


def _fp16_matmul() -> tuple[onnx.ModelProto, np.ndarray, np.ndarray]:
    w = RNG.standard_normal((64, 48)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        "mm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 48])],
        [numpy_helper.from_array(w, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model, w, RNG.standard_normal((8, 64)).astype(np.float32)


def _without_weight_loads(program: Program, weight: int) -> Program:
    def keep(stream: list) -> list:  # type: ignore[type-arg]
        return [i for i in stream if not (isinstance(i, DmaLoad) and i.tensor == weight)]

    return dataclasses.replace(
        program, setup=[keep(s) for s in program.setup], streams=[keep(s) for s in program.streams]
    )


def test_fp16_weights_widen_once_but_only_from_what_vtcm_holds() -> None:
    model, w, x = _fp16_matmul()
    want = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
    result = compile_model(model, ["-aic-num-cores=1", "-convert-to-fp16"])
    try:
        with load_qpc(result.qpc_path) as qpc:
            program, constants = qpc.program(), qpc.segments["constants.bin"]
            matmul = next(k for k in program.kernels if k.op_types == ("MatMul",))
            weight = matmul.inputs[1]
            assert program.tensors[weight].dtype == "float16"
            executor = Executor(program, constants, VTCM)
            first = executor.run({"x": x})
            again = executor.run({"x": x})  # from the widened copy kept by the first run
            assert executor.copies._wide, "the fp16 weight was not kept widened"
            tampered = _without_weight_loads(program, weight)
            unloaded = Executor(tampered, constants, VTCM).run({"x": x})
    finally:
        result.cleanup()
    (name,) = first
    np.testing.assert_allclose(first[name], want, rtol=1e-2, atol=5e-2)
    np.testing.assert_array_equal(again[name], first[name])
    # without its load the weight buffer holds zeros, and the kernel computes with them
    np.testing.assert_array_equal(unloaded[name], np.zeros_like(want))


def test_full_box_of_a_widened_operand_is_its_own_key() -> None:
    copies = ConstantCopies(1)
    whole = (3, full_box((4, 4)))
    a = copies.widened(whole, ((0, 2), (0, 4)), np.ones((2, 4), np.float16), np.float32)
    b = copies.widened(whole, ((2, 4), (0, 4)), np.zeros((2, 4), np.float16), np.float32)
    assert a.sum() == 8 and b.sum() == 0


def test_a_session_reads_each_inference_inputs_0d_ones_included() -> None:
    """Streams are decoded once: every DMA must keep a view of DDR, also for a 0-d tensor,
    whose plain index `a[()]` is a copy taken when the stream was decoded."""
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "two"], ["y"], name="double")],
        "scalar",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])],
        [numpy_helper.from_array(np.array(2.0, np.float32), "two")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    result = compile_model(model, ["-aic-num-cores=1"])
    try:
        with QpcSession(result.qpc_path) as session:
            for value in (1.5, -4.0, 0.25):
                got = session.run({"x": np.array(value, np.float32)})["y"]
                assert got.shape == () and float(got) == 2 * value
    finally:
        result.cleanup()
