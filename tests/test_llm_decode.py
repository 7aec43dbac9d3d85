"""Decode on the device: with `-retained-state` a KV cache and its `_RetainedState` output are
one device buffer. The program writes only the new rows into it (a scatter DMA), the host
never moves it, the estimate says so, and greedy decoding equals ONNX Runtime's for 64 steps.

Tolerance policy for fp16 (`-convert-to-fp16` with the cache stored as float16 through the
custom-IO list, as the vendor's LLM flow compiles): the tokens must equal ONNX Runtime's fp32
tokens exactly (the test decoder's top-1 margins are far above fp16 rounding), and every
chosen logit must lie within FP16_LOGITS_ATOL of ONNX Runtime's.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest

from compiler_core.build import CompileResult
from compiler_core.compile import compile_model
from compiler_core.devices import get_device
from compiler_core.lowering.program import DmaScatter, DmaStore, Program, scattered_bytes
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
CTX = PROMPT.shape[1] + STEPS + 8
LAYERS, HEADS, D_MODEL = 2, 2, 32
FP32_LOGITS_ATOL = 1e-4
FP16_LOGITS_ATOL = 0.1
"""fp16 weights, activations and cache against fp32: logits of magnitude ~10 carry ~1e-2."""
DECODE = "batch_size=1,seq_len=1"


@pytest.fixture(scope="module")
def model() -> onnx.ModelProto:
    return kv_decoder(layers=LAYERS, heads=HEADS, d_model=D_MODEL, ctx_len=CTX)


@pytest.fixture(scope="module")
def reference(model: onnx.ModelProto) -> Generation:
    return greedy_decode(ort_runner(model), PROMPT, STEPS, feed_back=True, cache=empty_cache(model))


def _flags(tmp: Path, precision: str, cores: int) -> list[str]:
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
    flags = [
        f"-network-specialization-config={spec}",
        "-retained-state",
        f"-aic-num-cores={cores}",
        "-aic-perf-metrics",
    ]
    if precision == "fp16":
        custom = tmp / "custom_io.yaml"
        names = [n for p in past_names(LAYERS) for n in (p, retained_name(p))]
        custom.write_text("".join(f"- IOName: {n}\n  Precision: float16\n" for n in names))
        flags += ["-convert-to-fp16", f"-custom-IO-list-file={custom}"]
    return flags


@pytest.fixture(scope="module", params=[("fp32", 1), ("fp32", 4), ("fp16", 1), ("fp16", 4)])
def compiled(
    request: pytest.FixtureRequest, model: onnx.ModelProto, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, int, CompileResult]]:
    precision, cores = request.param
    tmp = tmp_path_factory.mktemp(f"{precision}-{cores}")
    result = compile_model(model.SerializeToString(), _flags(tmp, precision, cores))
    yield precision, cores, result
    result.cleanup()


def _row_bytes(program: Program) -> int:
    """Bytes of one new row of every cache: heads x head_dim per layer's key and value."""
    cache = next(program.tensors[i] for i in program.retained)
    itemsize = np.dtype(cache.dtype).itemsize
    return 2 * LAYERS * HEADS * (D_MODEL // HEADS) * itemsize


def test_greedy_decode_equals_onnxruntime_for_64_steps_with_the_cache_on_the_device(
    compiled: tuple[str, int, CompileResult], reference: Generation
) -> None:
    precision, _, result = compiled
    with QpcSession(str(result.qpc_path)) as session:
        got = greedy_decode(session.run, PROMPT, STEPS, feed_back=False)
        assert sorted(session.state) == sorted(past_names(LAYERS))
    assert got.tokens == reference.tokens
    atol = FP16_LOGITS_ATOL if precision == "fp16" else FP32_LOGITS_ATOL
    np.testing.assert_allclose(got.logits, reference.logits, atol=atol, rtol=0)


def test_the_cache_is_written_in_place_by_a_scatter_of_the_new_rows_only(
    compiled: tuple[str, int, CompileResult],
) -> None:
    _, _, result = compiled
    for program in result.programs.values():
        retained = program.retained
        assert sorted(program.tensors[i].name for i in retained) == sorted(past_names(LAYERS))
        for i, o in retained.items():  # one buffer
            assert program.tensors[i].ddr_offset == program.tensors[o].ddr_offset
        cache_offsets = {program.tensors[i].ddr_offset for i in retained}
        scatters = [i for s in program.streams for i in s if isinstance(i, DmaScatter)]
        assert {program.tensors[s.tensor].ddr_offset for s in scatters} == cache_offsets
        stores = [
            i
            for s in program.streams
            for i in s
            if isinstance(i, DmaStore) and program.tensors[i.tensor].ddr_offset in cache_offsets
        ]
        assert stores == []  # no whole-cache rewrite


def test_retained_ports_carry_no_host_bytes_and_the_host_time_counts_real_io_only(
    compiled: tuple[str, int, CompileResult],
) -> None:
    _, _, result = compiled
    metrics = result.metrics["specializations"][DECODE]
    ports = {p["port"]: p for p in metrics["memory_traffic"]["per_port"]}
    retained = set(past_names(LAYERS)) | {retained_name(n) for n in past_names(LAYERS)}
    assert {n for n, p in ports.items() if p.get("retained")} == retained
    assert all(ports[n]["host_bytes"] == 0 for n in retained)
    real = sum(p["host_bytes"] for n, p in ports.items() if n not in retained)
    assert real == 8 + 8 + 48 * 4  # input_ids, position_ids, logits (fp32 at the boundary)
    assert metrics["host_transfer_us"] == pytest.approx(
        real / get_device(metrics["device"]).soc_link_bytes_per_s * 1e6, abs=1e-3
    )


def test_a_decode_step_writes_the_new_rows_and_the_metrics_equal_the_runtime_dmas(
    compiled: tuple[str, int, CompileResult],
) -> None:
    _, _, result = compiled
    program = result.programs[DECODE]
    scattered = sum(
        scattered_bytes(program, i) for s in program.streams for i in s if isinstance(i, DmaScatter)
    )
    assert scattered == _row_bytes(program)
    qpc = load_qpc(str(result.qpc_path))
    executor = Executor(program, qpc.segments["constants.bin"], 8_323_072)
    executor.run({"input_ids": np.array([[5]]), "position_ids": np.array([[9]])})
    metrics = result.metrics["specializations"][DECODE]["memory_traffic"]
    moved = sum(t.ddr_write for t in executor.traffic)
    assert metrics["total"]["ddr_write_bytes"] == moved
    assert sum(t.ddr_read for t in executor.traffic) == metrics["total"]["ddr_read_bytes"]
    qpc.close()


def test_the_ddr_floor_counts_the_cache_read_and_the_rows_written_not_the_ports(
    compiled: tuple[str, int, CompileResult],
) -> None:
    _, _, result = compiled
    program = result.programs[DECODE]
    metrics = result.metrics["specializations"][DECODE]
    cache = sum(program.tensors[i].nbytes for i in program.retained)
    io = 8 + 8 + 48 * 4
    floor = metrics["floor_ddr_bytes"]
    # every cache row is read once (attention spans the context) and one row per cache is
    # written; the retained outputs are not counted again as host traffic
    assert cache + _row_bytes(program) + io <= floor < 2 * cache


def test_a_retained_output_not_written_by_a_scatter_is_copied_on_the_device() -> None:
    """`state + 1` as a retained output: a device copy kernel feeds it back, no host bytes."""
    import onnx.helper as oh
    from onnx import TensorProto

    graph = oh.make_graph(
        [oh.make_node("Add", ["state", "one"], ["state_RetainedState"])],
        "acc",
        [oh.make_tensor_value_info("state", TensorProto.FLOAT, [2, 3])],
        [oh.make_tensor_value_info("state_RetainedState", TensorProto.FLOAT, [2, 3])],
        [onnx.numpy_helper.from_array(np.ones((2, 3), np.float32), "one")],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    result = compile_model(model.SerializeToString(), ["-retained-state", "-aic-perf-metrics"])
    try:
        ports = result.metrics["memory_traffic"]["per_port"]
        assert [p["host_bytes"] for p in ports] == [0, 0]
        assert result.metrics["host_transfer_us"] == 0
        with QpcSession(str(result.qpc_path)) as session:
            for _ in range(3):
                assert session.run({}) == {}
            np.testing.assert_array_equal(session.state["state"], np.full((2, 3), 3.0))
    finally:
        result.cleanup()


def _without_waits_before_cache_loads(program: Program) -> tuple[Program, int]:
    """The program with every SemWait dropped that directly precedes a load of a cache."""
    import dataclasses

    from compiler_core.lowering.program import DmaLoad, SemWait

    cache = {program.tensors[i].ddr_offset for i in program.retained}
    dropped = 0
    streams = []
    for stream in program.streams:
        kept: list = []
        for instr in stream:
            loads_cache = (
                isinstance(instr, DmaLoad) and program.tensors[instr.tensor].ddr_offset in cache
            )
            while loads_cache and kept and isinstance(kept[-1], SemWait):
                kept.pop()
                dropped += 1
            kept.append(instr)
        streams.append(kept)
    return dataclasses.replace(program, streams=streams), dropped


def test_reading_the_cache_before_the_scatter_lands_is_caught_by_the_runtime(
    model: onnx.ModelProto, tmp_path: Path
) -> None:
    """The scatter and the attention's loads of the cache are ordered by semaphores only; a
    program without those waits reads rows not yet written and computes other logits."""
    result = compile_model(model.SerializeToString(), _flags(tmp_path, "fp32", 4))
    try:
        program = result.programs[f"batch_size=1,seq_len={PROMPT.shape[1]}"]
        tampered, dropped = _without_waits_before_cache_loads(program)
        assert dropped > 0
        feeds = {
            "input_ids": PROMPT,
            "position_ids": np.arange(PROMPT.shape[1], dtype=np.int64)[None, :],
        }
        qpc = load_qpc(str(result.qpc_path))
        constants = qpc.segments["constants.bin"]
        want = ort_runner(model)({**feeds, **empty_cache(model)})["logits"]
        good = Executor(program, constants, 8_323_072).run(feeds)["logits"]
        bad = Executor(tampered, constants, 8_323_072).run(feeds)["logits"]
        qpc.close()
        np.testing.assert_allclose(good, want, atol=FP32_LOGITS_ATOL, rtol=0)
        assert not np.allclose(bad, want, atol=1e-2)
    finally:
        result.cleanup()
