"""An MXINT8 KV cache: retained state stored on the device as OCP MX int8 blocks, selected per
tensor in the custom-IO list (Precision mxint8) or for every cache with -mxint8-kv-cache;
counted at its stored size, really quantized on write and dequantized on read.

Tolerance policy: the tokens of 64 greedy steps must equal ONNX Runtime's fp32 tokens, and
every chosen logit must lie within MXINT8_LOGITS_ATOL of ONNX Runtime's (an MXINT8 element
keeps 7 bits below its block's largest power of two: a relative error up to 2^-7 per cached
value, on top of fp16 compute).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from compiler_core.build import CompileResult
from compiler_core.compile import compile_model
from compiler_core.errors import CompileError
from compiler_core.lowering.program import DmaScatter, scattered_bytes
from compiler_core.mxint8 import BLOCK_BYTES, decode_rows, encode_rows, mxint8_nbytes, quantize
from compiler_core.qpc.container import load_qpc
from compiler_core.runtime import Executor, QpcSession
from tests.decoder_model import (
    Generation,
    empty_cache,
    greedy_decode,
    kv_decoder,
    ort_runner,
    past_names,
    retained_name,
)

PROMPT = np.array([[3, 17, 5, 40, 22, 9, 11, 30]], np.int64)
STEPS = 64
CTX = 80
LAYERS, HEADS, D_MODEL = 2, 2, 64  # head_dim 32: one MX block per cached row and head
MXINT8_LOGITS_ATOL = 0.25
DECODE = "batch_size=1,seq_len=1"


# --- the format -------------------------------------------------------------------------------


def test_a_block_shares_the_power_of_two_of_its_largest_magnitude_and_keeps_7_bits() -> None:
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((50, 64)) * rng.uniform(0.01, 100, (50, 1))
    blocks = encode_rows(rows)
    assert blocks.shape == (50, 2 * BLOCK_BYTES)
    scales = blocks.reshape(50, 2, BLOCK_BYTES)[..., 0].astype(int) - 127
    amax = np.abs(rows.reshape(50, 2, 32)).max(axis=-1)
    np.testing.assert_array_equal(scales, np.floor(np.log2(amax)))
    back = decode_rows(blocks, 64, "float64")
    step = np.repeat(2.0 ** (scales - 6), 32, axis=1)
    error = np.abs(back - rows)
    saturated = np.abs(rows) > 127 * step  # above the largest element: clamped to 127 steps
    assert np.all(error[~saturated] <= step[~saturated] / 2 + 1e-12)
    assert np.all(error[saturated] <= step[saturated])


def test_zero_blocks_decode_to_zero_and_non_finite_blocks_to_nan() -> None:
    rows = np.zeros((2, 40))
    rows[1, 3] = np.inf
    back = decode_rows(encode_rows(rows), 40, "float32")
    assert np.all(back[0] == 0)
    assert np.all(np.isnan(back[1, :32])) and np.all(back[1, 32:] == 0)
    assert mxint8_nbytes((1, 2, 80, 40)) == 160 * 2 * BLOCK_BYTES
    np.testing.assert_array_equal(quantize(np.zeros((3, 32), np.float16)), 0)


# --- the compile and the runtime --------------------------------------------------------------


@pytest.fixture(scope="module")
def model() -> onnx.ModelProto:
    return kv_decoder(layers=LAYERS, heads=HEADS, d_model=D_MODEL, ctx_len=CTX)


@pytest.fixture(scope="module")
def reference(model: onnx.ModelProto) -> Generation:
    return greedy_decode(ort_runner(model), PROMPT, STEPS, feed_back=True, cache=empty_cache(model))


def _compile(
    model: onnx.ModelProto, tmp: Path, cores: int, mx: dict[str, str] | None
) -> CompileResult:
    spec = tmp / "spec.json"
    spec.write_text(
        json.dumps(
            {
                "specializations": [
                    {"batch_size": "1", "seq_len": str(PROMPT.shape[1])},
                    {"batch_size": "1", "seq_len": "1"},
                ]
            }
        )
    )
    precision = {n: "float16" for p in past_names(LAYERS) for n in (p, retained_name(p))}
    precision.update(mx or {})
    custom = tmp / "custom_io.yaml"
    custom.write_text("".join(f"- IOName: {n}\n  Precision: {p}\n" for n, p in precision.items()))
    flags = [
        f"-network-specialization-config={spec}",
        "-retained-state",
        f"-aic-num-cores={cores}",
        "-convert-to-fp16",
        f"-custom-IO-list-file={custom}",
        "-aic-perf-metrics",
    ]
    return compile_model(model.SerializeToString(), flags + ([] if mx else ["-mxint8-kv-cache"]))


@pytest.mark.parametrize("cores", [1, 4])
def test_an_mxint8_cache_decodes_onnxruntime_tokens_for_64_steps(
    model: onnx.ModelProto, reference: Generation, tmp_path: Path, cores: int
) -> None:
    result = _compile(model, tmp_path, cores, None)
    try:
        with QpcSession(str(result.qpc_path)) as session:
            got = greedy_decode(session.run, PROMPT, STEPS, feed_back=False)
        assert got.tokens == reference.tokens
        np.testing.assert_allclose(got.logits, reference.logits, atol=MXINT8_LOGITS_ATOL, rtol=0)
        # really stored as blocks: the logits differ from an fp16 cache's
        assert not np.array_equal(got.logits, reference.logits)
    finally:
        result.cleanup()


def test_the_cache_is_counted_and_moved_at_its_stored_size(
    model: onnx.ModelProto, tmp_path: Path
) -> None:
    result = _compile(model, tmp_path, 4, None)
    try:
        program = result.programs[DECODE]
        stored = mxint8_nbytes((1, HEADS, CTX, D_MODEL // HEADS))
        for i, o in program.retained.items():
            assert program.tensors[i].nbytes == program.tensors[o].nbytes == stored
        row = 2 * LAYERS * HEADS * BLOCK_BYTES  # one new row of each cache: one block per head
        scatters = [i for s in program.streams for i in s if isinstance(i, DmaScatter)]
        assert sum(scattered_bytes(program, i) for i in scatters) == row
        qpc = load_qpc(str(result.qpc_path))
        executor = Executor(program, qpc.segments["constants.bin"], 8_323_072)
        executor.run({"input_ids": np.array([[5]]), "position_ids": np.array([[9]])})
        qpc.close()
        total = result.metrics["specializations"][DECODE]["memory_traffic"]["total"]
        assert total["ddr_write_bytes"] == sum(t.ddr_write for t in executor.traffic)
        assert total["ddr_read_bytes"] == sum(t.ddr_read for t in executor.traffic)
        assert total["ddr_write_bytes"] == row + PROMPT.shape[0] * 48 * 4  # + fp32 logits
    finally:
        result.cleanup()


def test_the_custom_io_list_selects_mxint8_per_tensor(
    model: onnx.ModelProto, tmp_path: Path
) -> None:
    result = _compile(
        model, tmp_path, 1, {"past_key.0": "mxint8", "past_key.0_RetainedState": "mxint8"}
    )
    try:
        program = result.programs[DECODE]
        sizes = {program.tensors[i].name: program.tensors[i].nbytes for i in program.retained}
        plain = HEADS * CTX * (D_MODEL // HEADS) * 2
        assert sizes.pop("past_key.0") == mxint8_nbytes((1, HEADS, CTX, D_MODEL // HEADS))
        assert set(sizes.values()) == {plain}
    finally:
        result.cleanup()


def test_mxint8_on_a_tensor_that_is_not_retained_state_is_refused(
    model: onnx.ModelProto, tmp_path: Path
) -> None:
    with pytest.raises(CompileError, match="'logits' is not a retained input") as info:
        _compile(model, tmp_path, 1, {"logits": "mxint8"})
    assert info.value.code == "invalid_option"


def test_the_flag_alone_stores_every_cache_as_mxint8_in_the_compute_precision(
    model: onnx.ModelProto, reference: Generation, tmp_path: Path
) -> None:
    spec = tmp_path / "spec.json"
    spec.write_text(
        json.dumps(
            {
                "specializations": [
                    {"batch_size": "1", "seq_len": "8"},
                    {"batch_size": "1", "seq_len": "1"},
                ]
            }
        )
    )
    flags = [
        f"-network-specialization-config={spec}",
        "-retained-state",
        "-convert-to-fp16",
        "-mxint8-kv-cache",
    ]
    result = compile_model(model.SerializeToString(), flags)
    try:
        program = result.programs[DECODE]
        stored = mxint8_nbytes((1, HEADS, CTX, D_MODEL // HEADS))
        assert {program.tensors[i].nbytes for i in program.retained} == {stored}
        with QpcSession(str(result.qpc_path)) as session:
            got = greedy_decode(session.run, PROMPT, 16, feed_back=False)
        assert got.tokens == reference.tokens[:16]
    finally:
        result.cleanup()
