"""Parts of one buffer that several cores fill (each core multicasting its channels of a layer's
output to every core, the all-gather of a layer cut by channels) are ordered by the bytes each
part writes, not by the whole buffer: the copies land side by side without one core waiting
for another's, and the program still computes ONNX Runtime's outputs. Before, every part
waited for the previous core's (a chain of 16 copies per layer at batch 1 on 16 cores)."""

from __future__ import annotations

from functools import cache

import numpy as np
import onnx

from compiler_core import compile_model
from compiler_core.lowering.program import (
    NocCopy,
    Program,
    SemPost,
    SemWait,
    box_byte_range,
    box_nbytes,
)
from compiler_core.runtime import run_qpc
from tests.codegen_models import conv_net
from tests.quant_models import run_ort

CORES = 4


def test_a_box_spans_the_bytes_from_its_first_element_to_its_last() -> None:
    buffer = ((0, 1), (0, 64), (0, 7), (0, 7))
    # one core's channels of a feature map: exactly its bytes
    channels = ((0, 1), (16, 32), (0, 7), (0, 7))
    assert box_byte_range(channels, buffer, "int8") == (16 * 49, 32 * 49)
    assert box_byte_range(channels, buffer, "float16") == (2 * 16 * 49, 2 * 32 * 49)
    # rows of every channel: from the first channel's first row to the last channel's last
    rows = ((0, 1), (0, 64), (2, 4), (0, 7))
    assert box_byte_range(rows, buffer, "int8") == (2 * 7, 63 * 49 + 4 * 7)
    # the whole buffer, and a buffer that does not start at the tensor's origin
    assert box_byte_range(buffer, buffer, "int8") == (0, box_nbytes(buffer, "int8"))
    held = ((0, 1), (32, 64), (0, 7), (0, 7))
    assert box_byte_range(((0, 1), (48, 64), (0, 7), (0, 7)), held, "int8") == (16 * 49, 32 * 49)


@cache
def _channel_cut_net() -> onnx.ModelProto:
    """Small maps with many channels: cut by output channels, each layer's input gathered."""
    return conv_net(batch=1, channels=256, size=2)


def _posted_after(program: Program) -> dict[int, object]:
    """Each semaphore: the instruction its post follows (what a wait on it waits for)."""
    found: dict[int, object] = {}
    for stream in program.streams:
        for before, instr in zip(stream, stream[1:], strict=False):
            if isinstance(instr, SemPost):
                found[instr.sem] = before
    return found


def test_cores_filling_one_buffer_do_not_wait_for_each_others_parts() -> None:
    model = _channel_cut_net()
    result = compile_model(model, [f"-aic-num-cores={CORES}"])
    try:
        program = result.program
        posted = _posted_after(program)
        gathers = 0
        for stream in program.streams:
            for wait, instr in zip(stream, stream[1:], strict=False):
                if not isinstance(instr, NocCopy) or bin(instr.cores).count("1") < 2:
                    continue
                gathers += 1
                if not isinstance(wait, SemWait):
                    continue
                other = posted[wait.sem]
                if not (isinstance(other, NocCopy) and other.tensor == instr.tensor):
                    continue
                if other.vtcm != instr.vtcm or other.buf_box != instr.buf_box:
                    continue
                # another core's part of the same buffer: waited for only where they overlap
                dtype = program.tensors[instr.tensor].dtype
                lo, hi = box_byte_range(instr.box, instr.buf_box, dtype)
                olo, ohi = box_byte_range(other.box, other.buf_box, dtype)
                assert lo < ohi and olo < hi, (instr, other)
        assert gathers >= 2 * CORES, gathers
        feeds = {
            model.graph.input[0].name: np.random.default_rng(3)
            .standard_normal((1, 3, 2, 2))
            .astype(np.float32)
        }
        ours = run_qpc(result.qpc_path, feeds)
        (theirs,) = run_ort(model, feeds)
        np.testing.assert_allclose(next(iter(ours.values())), theirs, rtol=1e-4, atol=1e-5)
    finally:
        result.cleanup()
