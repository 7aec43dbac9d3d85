"""Deferred constant loads (compiler_core/runtime/deferred.py): a whole-buffer DMA load of a
constant moves no bytes until something needs them as VTCM bytes, and every read sees what
an eager copy would have left there."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler_core import compile_model
from compiler_core.lowering.placement import CodegenPolicy
from compiler_core.lowering.program import DmaLoad, DmaStore, Instr, Program, RunKernel
from compiler_core.qpc.container import load_qpc
from compiler_core.runtime import Executor
from compiler_core.runtime.deferred import DeferredLoads
from compiler_core.runtime.executor import _span
from compiler_core.runtime.replay import ReplayFault

VTCM = 8_323_072


def _random_ops(rng: np.random.Generator, size: int) -> Iterator[tuple[str, int, int, int]]:
    """(kind, start, end, rows) of 20 random VTCM accesses within `size` bytes."""
    for _ in range(20):
        start = int(rng.integers(0, size - 1))
        end = int(rng.integers(start + 1, min(size, start + 120) + 1))
        divisors = [r for r in range(1, end - start + 1) if (end - start) % r == 0]
        kind = ("defer", "write", "write-some", "read")[int(rng.integers(4))]
        yield kind, start, end, int(rng.choice(divisors))


@pytest.mark.parametrize("seed", range(4))
def test_deferred_loads_give_every_read_the_bytes_an_eager_copy_leaves(seed: int) -> None:
    """Random deferred loads (buffers of random row sizes), whole writes, writes of every
    other byte, and reads over overlapping ranges, applied to an eagerly copied memory and
    to a deferred one: every read, and the whole memory at the end, agree."""
    rng = np.random.default_rng(seed)
    size = 400
    for _ in range(300):
        eager, lazy = np.zeros(size, np.uint8), np.zeros(size, np.uint8)
        deferred = DeferredLoads(1)
        for kind, start, end, row in _random_ops(rng, size):
            n = end - start
            value = rng.integers(1, 255, n, dtype=np.uint8)
            if kind == "defer":
                src = value.reshape(n // row, row)
                src.flags.writeable = False
                eager[start:end] = value
                deferred.defer(0, start, end, lazy[start:end].reshape(n // row, row), src)
            elif kind == "write":
                eager[start:end] = value
                deferred.overwrite(0, start, end, whole=True)
                lazy[start:end] = value
            elif kind == "write-some":
                eager[start:end:2] = value[::2]
                deferred.overwrite(0, start, end, whole=False)
                lazy[start:end:2] = value[::2]
            else:
                deferred.settle(0, start, end)
                np.testing.assert_array_equal(lazy[start:end], eager[start:end])
        deferred.settle(0, 0, size)
        np.testing.assert_array_equal(lazy, eager)
        assert deferred.pending == [[]]


def _one_matmul() -> tuple[onnx.ModelProto, np.ndarray, dict[str, np.ndarray]]:
    weight = np.arange(12, dtype=np.float32).reshape(4, 3) - 5.5
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        "one_matmul",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 3])],
        [numpy_helper.from_array(weight, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    feeds = {"x": np.random.default_rng(0).standard_normal((4, 4)).astype(np.float32)}
    return model, weight, feeds


def _streamed(model: onnx.ModelProto) -> tuple[Program, bytes, DmaLoad]:
    """The 1-core program with its weight streamed (loaded per inference), its constants,
    and that load."""
    result = compile_model(model, ["-aic-num-cores=1"], policy=CodegenPolicy(residency=False))
    try:
        with load_qpc(result.qpc_path) as qpc:
            program = qpc.program()
            constants = bytes(qpc.segments["constants.bin"])
    finally:
        result.cleanup()
    weight = program.kernels[0].inputs[1]
    load = next(i for i in program.streams[0] if isinstance(i, DmaLoad) and i.tensor == weight)
    return program, constants, load


def test_a_streamed_weight_its_kernel_reads_whole_is_counted_but_never_copied() -> None:
    model, weight, feeds = _one_matmul()
    program, constants, load = _streamed(model)
    executor = Executor(program, constants, VTCM)
    for _ in range(2):  # the second inference starts with nothing deferred
        got = executor.run(feeds)["y"]
        np.testing.assert_allclose(got, feeds["x"] @ weight, rtol=1e-6)
        assert executor.traffic[0].ddr_read_constant == weight.nbytes
        buffer = executor.machine.vtcm[0][load.vtcm : load.vtcm + weight.nbytes]
        assert not buffer.any(), "the weight's VTCM buffer was written"


def test_a_store_of_a_deferred_buffer_stores_the_constant() -> None:
    """A (tampered) program that stores the weight's buffer instead of running the kernel:
    the store reads VTCM, so the deferred bytes land there first."""
    model, weight, feeds = _one_matmul()
    program, constants, load = _streamed(model)
    y = program.outputs[0]
    store = DmaStore(tensor=y, box=load.buf_box, vtcm=load.vtcm, buf_box=load.buf_box)
    stream: list[Instr] = [
        store if isinstance(instr, RunKernel) else instr
        for instr in program.streams[0]
        if not (isinstance(instr, DmaStore) and instr.tensor == y)
    ]
    tampered = dataclasses.replace(program, streams=[stream])
    got = Executor(tampered, constants, VTCM).run(feeds)["y"]
    np.testing.assert_array_equal(got, weight)


def test_a_box_spans_its_first_to_last_byte_and_a_slab_writes_all_of_them() -> None:
    """A NoC copy of a box into a larger buffer drops the deferred constant rows it writes
    whole only when the box is a slab (every byte of its span written): an all-gather's
    rows of a row-major buffer are, a block of columns is not."""
    buf = ((0, 4), (0, 6))
    assert _span(100, buf, ((1, 3), (0, 6)), "float32") == (124, 172, True)
    assert _span(100, buf, ((1, 3), (2, 4)), "float32") == (132, 164, False)
    assert _span(100, ((2, 6), (0, 6)), ((3, 4), (0, 6)), "float16") == (112, 124, True)
    assert _span(100, buf, buf, "int8") == (100, 124, True)
    assert _span(100, buf, ((1, 1), (0, 6)), "float32") == (100, 100, True)
    assert _span(100, (), (), "float32") == (100, 104, True)


@pytest.mark.parametrize("seed", range(4))
def test_a_replayed_inference_leaves_what_looking_the_records_up_leaves(seed: int) -> None:
    """Random accesses in the same order in three inferences, each on a zeroed memory: the
    first is recorded and the next two replay it; every read, and the whole memory after
    each, agree with an eagerly copied memory."""
    rng = np.random.default_rng(seed)
    size = 400
    for _ in range(100):
        ops = list(_random_ops(rng, size))
        values = [rng.integers(1, 255, end - start, dtype=np.uint8) for _, start, end, _ in ops]
        deferred = DeferredLoads(1)
        lazy = np.zeros(size, np.uint8)
        for inference in range(3):
            eager = np.zeros(size, np.uint8)
            lazy[:] = 0
            deferred.start(fresh=inference == 0)
            for (kind, start, end, row), value in zip(ops, values, strict=True):
                n = end - start
                if kind == "defer":
                    src = value.reshape(n // row, row)
                    src.flags.writeable = False
                    eager[start:end] = value
                    deferred.defer(0, start, end, lazy[start:end].reshape(n // row, row), src)
                elif kind == "write":
                    eager[start:end] = value
                    deferred.overwrite(0, start, end, whole=True)
                    lazy[start:end] = value
                elif kind == "write-some":
                    eager[start:end:2] = value[::2]
                    deferred.overwrite(0, start, end, whole=False)
                    lazy[start:end:2] = value[::2]
                else:
                    deferred.settle(0, start, end)
                    np.testing.assert_array_equal(lazy[start:end], eager[start:end])
            deferred.settle(0, 0, size)
            deferred.finish()
            np.testing.assert_array_equal(lazy, eager)
            assert not deferred.pending[0]


def test_an_access_out_of_the_recorded_order_is_a_fault() -> None:
    deferred = DeferredLoads(1)
    memory = np.zeros(16, np.uint8)
    src = np.ones((4, 4), np.uint8)
    deferred.start(fresh=True)
    deferred.defer(0, 0, 16, memory.reshape(4, 4), src)
    deferred.settle(0, 0, 4)
    deferred.finish()
    deferred.start(fresh=False)
    deferred.defer(0, 0, 16, memory.reshape(4, 4), src)
    with pytest.raises(ReplayFault):
        deferred.settle(0, 4, 8)
    deferred.start(fresh=False)
    deferred.defer(0, 0, 16, memory.reshape(4, 4), src)
    with pytest.raises(ReplayFault):
        deferred.finish()  # one access short
