"""Profiling: the cost model's timeline, stats buffers by level, PMU rules, metrics, warnings."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler_core.build import CompileResult
from compiler_core.compile import compile_model
from compiler_core.cost_rates import THREADS
from compiler_core.cost_timeline import Calendar, KernelRun, build_timeline
from compiler_core.devices import get_device
from compiler_core.errors import CompileError
from compiler_core.lowering.program import DmaLoad, DmaStore, RunKernel, SemPost, SemWait
from compiler_core.options import CompileOptions
from compiler_core.profiling.opstats import load_layout
from compiler_core.profiling.pmu import BY_ID, CATALOGUE, RECIPES
from compiler_core.profiling.stats_layout import OP_FIELDS, decode_stats
from compiler_core.runtime import run_qpc

DOCS = Path(__file__).resolve().parent.parent / "docs" / "profiling.md"


def matmul_model(
    m: int = 64, k: int = 256, n: int = 128, *, relu: bool = False, seed: int = 0
) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    w = numpy_helper.from_array((rng.standard_normal((k, n)) * 0.1).astype(np.float32), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h" if relu else "y"], name="mm")]
    if relu:
        nodes.append(helper.make_node("Relu", ["h"], ["y"], name="act"))
    graph = helper.make_graph(
        nodes,
        "mm_net",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [m, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, n])],
        [w],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def add_model(size: int = 1 << 18) -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("Add", ["a", "b"], ["y"], name="add")],
        "add_net",
        [
            helper.make_tensor_value_info("a", TensorProto.FLOAT, [1, size]),
            helper.make_tensor_value_info("b", TensorProto.FLOAT, [1, size]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, size])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def feeds(model: onnx.ModelProto, seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for value in model.graph.input:
        shape = [d.dim_value for d in value.type.tensor_type.shape.dim]
        out[value.name] = rng.standard_normal(shape).astype(np.float32)
    return out


def profile(
    result: CompileResult, inputs: dict[str, np.ndarray], tmp: Path, n: int = 1
) -> tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]]]:
    out_dir = tmp / "stats"
    outputs = run_qpc(result.qpc_path, inputs, profiling_out_dir=out_dir, iterations=n)
    layout, _ = load_layout(result.qpc_path)
    files = sorted(out_dir.glob("stats-inf-*.bin"))
    assert len(files) == n
    return outputs, [decode_stats(layout, f.read_bytes()) for f in files]


def column(table: np.ndarray, fields: tuple[str, ...], name: str) -> np.ndarray:
    return table[:, fields.index(name)].astype(np.int64)


# ----------------------------------------------------------------------------- cost model


def test_timeline_starts_nothing_after_a_wait_before_its_semaphore_is_posted() -> None:
    result = compile_model(matmul_model(relu=True), ["-aic-num-cores=4"])
    program = result.program
    timeline = build_timeline(program, CompileOptions().device)
    assert timeline.complete
    raised = {i.sem: i.time for i in timeline.increments}
    waits = 0
    for core, stream in enumerate(program.streams):
        times = timeline.issued[core]
        assert len(times) == len(stream)
        barrier = 0
        for instr, (start, end) in zip(stream, times, strict=True):
            if isinstance(instr, SemWait):
                barrier = max(barrier, raised[instr.sem])
                waits += 1
            assert start >= barrier and end >= start
    assert waits > 0


def test_a_post_is_raised_only_when_everything_before_it_on_its_core_is_done() -> None:
    result = compile_model(matmul_model(relu=True), ["-aic-num-cores=4"])
    timeline = build_timeline(result.program, CompileOptions().device)
    for core, stream in enumerate(result.program.streams):
        done = 0
        for instr, (_, end) in zip(stream, timeline.issued[core], strict=True):
            if isinstance(instr, SemPost):
                assert end >= done
            done = max(done, end)


def test_fp32_on_hmx_is_estimated_16x_slower_than_fp16() -> None:
    fp32 = compile_model(matmul_model(256, 512, 512), ["-aic-num-cores=1"]).program
    fp16 = compile_model(
        matmul_model(256, 512, 512), ["-aic-num-cores=1", "-convert-to-fp16"]
    ).program
    device = CompileOptions().device
    macs = 256 * 512 * 512
    for program, rate in (
        (fp32, device.hmx_fp16_macs_per_cycle // 16),
        (fp16, device.hmx_fp16_macs_per_cycle),
    ):
        timeline = build_timeline(program, device)
        hmx = sum(r.threads["hmx"].busy for r in timeline.runs if "hmx" in r.threads)
        assert sum(r.hmx_macs for r in timeline.runs) == macs
        tiles = sum(r.tiles for r in timeline.runs if r.hmx_macs)
        assert hmx == pytest.approx(macs / rate + 16 * tiles, rel=0.01)


def integer_matmul_model(m: int, k: int, n: int) -> onnx.ModelProto:
    rng = np.random.default_rng(2)
    w = numpy_helper.from_array(rng.integers(-8, 8, (k, n), dtype=np.int8), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", ["x", "w"], ["y"], name="mm")],
        "int8_net",
        [helper.make_tensor_value_info("x", TensorProto.INT8, [m, k])],
        [helper.make_tensor_value_info("y", TensorProto.INT32, [m, n])],
        [w],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_integer_kernels_are_charged_at_the_int8_rate_of_the_published_tops() -> None:
    device = get_device("aic100-standard")
    program = compile_model(
        integer_matmul_model(256, 512, 512), ["-aic-num-cores=1", "-aic-device=aic100-standard"]
    ).program
    timeline = build_timeline(program, device)
    hmx = sum(r.threads["hmx"].busy for r in timeline.runs if "hmx" in r.threads)
    tiles = sum(r.tiles for r in timeline.runs if r.hmx_macs)
    macs = 256 * 512 * 512
    assert sum(r.hmx_macs for r in timeline.runs) == macs
    assert hmx == pytest.approx(macs / device.hmx_int8_macs_per_cycle + 16 * tiles, rel=0.01)
    assert device.hmx_int8_macs_per_cycle == round(325e12 / (14 * device.clock_hz * 2))


def test_a_tile_that_does_not_fill_the_hmx_blocks_pays_for_whole_blocks() -> None:
    # 36 output channels take two 32-channel blocks: 64/36 of the MACs' time
    device = CompileOptions().device
    narrow = compile_model(matmul_model(64, 256, 36), ["-aic-num-cores=1", "-convert-to-fp16"])
    timeline = build_timeline(narrow.program, device)
    run = next(r for r in timeline.runs if r.hmx_macs)
    assert run.hmx_macs == 64 * 256 * 36
    assert run.hmx_padded_macs == 64 * 256 * 64
    busy = run.threads["hmx"].busy - 16 * run.tiles
    assert busy == pytest.approx(64 * 256 * 64 / device.hmx_fp16_macs_per_cycle, abs=run.tiles)
    assert narrow.metrics["hmx_useful_macs"] < narrow.metrics["hmx_padded_macs"]


def test_the_ddr_calendar_is_shared_by_transfers_that_overlap_in_time() -> None:
    rate = 100.0
    alone = Calendar(rate).book(0, 1_000_000, 64.0)
    shared = Calendar(rate)
    first = shared.book(0, 1_000_000, 64.0)
    second = shared.book(0, 1_000_000, 64.0)
    assert first == alone  # one engine alone is capped by its own rate
    assert second > first  # the second gets what the first left of the bandwidth
    # together they cannot beat the bandwidth: 2 MB at 100 B/cycle
    assert max(first, second) >= 2_000_000 / rate - 256


def test_ddr_bandwidth_is_shared_by_the_cores_running_at_the_same_time() -> None:
    device = CompileOptions().device

    def runs(model: onnx.ModelProto, cores: int) -> list[KernelRun]:
        program = compile_model(model, [f"-aic-num-cores={cores}"]).program
        return build_timeline(program, device).runs

    one, four = runs(add_model(), 1), runs(add_model(), 4)
    assert len(four) == 4
    # each of four cores moves a quarter of the bytes, but over a quarter of the SoC's
    # bandwidth, so its DMA time shrinks far less than 4x (one core alone is capped by its
    # DMA engine)
    assert 1.5 < one[0].dma_cycles / max(r.dma_cycles for r in four) < 3.0
    # compute is per core: a quarter of the MACs takes a quarter of the cycles
    one, four = runs(matmul_model(256, 512, 512), 1), runs(matmul_model(256, 512, 512), 4)
    assert one[0].compute_cycles / four[0].compute_cycles == pytest.approx(4.0, rel=0.01)


def test_every_core_has_four_hvx_one_hmx_and_one_dma_thread_and_units_land_on_theirs() -> None:
    result = compile_model(matmul_model(relu=True), ["-aic-num-cores=2"])
    timeline = build_timeline(result.program, CompileOptions().device)
    assert THREADS == ("hvx0", "hvx1", "hvx2", "hvx3", "hmx", "dma")
    for run in timeline.runs:
        unit = result.program.kernels[run.kernel].unit
        assert set(run.threads) <= set(THREADS)
        assert ("hmx" in run.threads) == (unit == "hmx")
        assert run.threads["dma"].busy == run.dma_cycles
        for use in run.threads.values():
            assert run.start <= use.start <= use.end <= run.end
            assert use.busy <= use.end - use.start


def test_the_first_kernel_waits_for_the_input_doorbell_of_the_host_transfer() -> None:
    model = add_model()
    result = compile_model(model, ["-aic-num-cores=1"])
    device = CompileOptions().device
    timeline = build_timeline(result.program, device)
    landed = 2 * (1 << 18) * 4  # both inputs, in port order
    assert timeline.port_ring[1] == math.ceil(
        landed / device.soc_link_bytes_per_s * device.clock_hz
    )
    stream, times = result.program.streams[0], timeline.issued[0]
    loads = [t for i, t in zip(stream, times, strict=True) if isinstance(i, DmaLoad)]
    run = next(t for i, t in zip(stream, times, strict=True) if isinstance(i, RunKernel))
    # each input's load waits for its own doorbell; the kernel for both loads
    assert [start for start, _ in loads] == timeline.port_ring[:2]
    assert run[0] >= max(end for _, end in loads) > timeline.port_ring[1]
    assert timeline.port_wait[0] > 0 and timeline.port_wait[1] > 0


# -------------------------------------------------------------------------- stats levels


SECTIONS = {
    40: {"header", "core_thread"},
    50: {"header", "core_thread", "ports", "sem_increments"},
    70: {"header", "core_thread", "ports", "sem_increments", "ops"},
    100: {"header", "core_thread", "ports", "sem_increments", "ops", "ops_pmu"},
}


@pytest.mark.parametrize("level", [40, 50, 70, 100])
def test_each_stats_level_lays_out_its_sections_and_the_levels_are_additive(level: int) -> None:
    result = compile_model(matmul_model(), ["-aic-num-cores=2", f"-stats-level={level}"])
    layout, _ = load_layout(result.qpc_path)
    assert {s.name for s in layout.sections} == SECTIONS[level]
    assert layout.level == level


def test_pmu_and_ddr_sections_exist_only_with_their_flags() -> None:
    plain_result = compile_model(matmul_model(), [])
    plain = load_layout(plain_result.qpc_path)[0]
    assert plain.section("pmu") is None and plain.section("ddr") is None
    result = compile_model(
        matmul_model(), ["-aic-num-cores=2", "-ddr-stats", "-aic-pmu-events=11,30"]
    )
    flagged = load_layout(result.qpc_path)[0]
    pmu = flagged.section("pmu")
    ddr = flagged.section("ddr")
    assert pmu is not None and pmu.fields == ("0x11", "0x30") and pmu.rows == 2 * 6
    assert ddr is not None and ddr.rows == 2


def test_the_memory_plan_places_the_stats_buffer_in_ddr_apart_from_every_tensor() -> None:
    small = compile_model(matmul_model(), ["-aic-num-cores=2"])
    big = compile_model(
        matmul_model(),
        ["-aic-num-cores=2", "-stats-level=100", "-ddr-stats", "-aic-pmu-recipe=KernelUtil"],
    )
    for result in (small, big):
        layout, _ = load_layout(result.qpc_path)
        program = result.program
        lo, hi = layout.ddr_offset, layout.ddr_offset + layout.size
        assert hi == program.ddr_size and lo >= program.constants_size
        for t in program.tensors:
            assert t.ddr_offset + t.nbytes <= lo or t.ddr_offset >= hi, t.name
        assert result.metrics["stats_buffer_size"] == layout.size
    size = [load_layout(r.qpc_path)[0].size for r in (small, big)]
    assert size[1] > size[0]
    assert big.program.ddr_size - small.program.ddr_size == size[1] - size[0]


def test_level_40_reports_per_core_thread_durations_and_ddr_traffic_per_core(
    tmp_path: Path,
) -> None:
    model = matmul_model(relu=True)
    result = compile_model(model, ["-aic-num-cores=2", "-ddr-stats"])
    x = feeds(model)
    outputs, raws = profile(result, x, tmp_path)
    expected = ort.InferenceSession(model.SerializeToString()).run(None, x)[0]
    np.testing.assert_allclose(outputs["y"], expected, rtol=1e-4, atol=1e-5)
    layout, _ = load_layout(result.qpc_path)
    raw = raws[0]
    fields = layout.section("core_thread").fields  # type: ignore[union-attr]
    ct = raw["core_thread"].reshape(2, 6, len(fields))
    for core in range(2):
        pcycles = ct[core, :, fields.index("inference_pcycles")]
        ucycles = ct[core, :, fields.index("inference_ucycles")]
        assert len(set(pcycles.tolist())) == 1 and pcycles[0] > 0
        assert (ucycles <= pcycles).all()
        assert ucycles[THREADS.index("dma")] > 0 and ucycles[THREADS.index("hmx")] > 0
        assert (ct[core, :, fields.index("activation_pcycles")] > 0).all()
    # DDR traffic per core equals the bytes the core's DMA instructions move
    program = result.program
    for core, stream in enumerate(program.streams):
        moved = {DmaLoad: 0, DmaStore: 0}
        for i in stream:
            if isinstance(i, DmaLoad | DmaStore):
                size = int(np.prod([b - a for a, b in i.box]))
                moved[type(i)] += size * np.dtype(program.tensors[i.tensor].dtype).itemsize
        read, _const, written, _multicast, _noc = raw["ddr"][core].tolist()
        assert (read, written) == (moved[DmaLoad], moved[DmaStore])


def test_level_50_records_doorbells_per_port_and_every_semaphore_increment(tmp_path: Path) -> None:
    model = add_model(1 << 14)
    result = compile_model(model, ["-aic-num-cores=2", "-stats-level=50"])
    _, raws = profile(result, feeds(model), tmp_path)
    layout, _ = load_layout(result.qpc_path)
    assert layout.ports == ("a", "b", "y")
    ports = raws[0]["ports"]
    device = CompileOptions().device
    nbytes = (1 << 14) * 4
    ring = [
        math.ceil(n / device.soc_link_bytes_per_s * device.clock_hz) for n in (nbytes, 2 * nbytes)
    ]
    assert ports[:2, 1].tolist() == ring  # input doorbells ring as the inputs land
    assert ports[:, 2].tolist() == [nbytes] * 3
    end = int(raws[0]["core_thread"][:, 1].max())
    assert ports[2, 1] + ports[2, 0] == end  # the output waits from done to the end
    assert raws[0]["sem_increments"].shape[0] == len(layout.op_rows)
    assert (raws[0]["sem_increments"][:, 0] > 0).all()


def test_level_70_has_a_row_per_operator_and_core_with_the_tiles_really_run(tmp_path: Path) -> None:
    model = matmul_model(relu=True)
    result = compile_model(model, ["-aic-num-cores=4", "-stats-level=70"])
    _, raws = profile(result, feeds(model), tmp_path)
    layout, _ = load_layout(result.qpc_path)
    program = result.program
    tiles: dict[tuple[int, int], int] = {}
    for core, stream in enumerate(program.streams):
        for instr in stream:
            if isinstance(instr, RunKernel):
                tiles[(instr.kernel, core)] = tiles.get((instr.kernel, core), 0) + 1
    assert set(layout.op_rows) == set(tiles)
    ops = raws[0]["ops"]
    for i, key in enumerate(layout.op_rows):
        assert ops[i][OP_FIELDS.index("tiles")] == tiles[key]
    pcycles = raws[0]["core_thread"].reshape(4, 6, 4)[:, 0, 1]
    for core in range(4):
        rows = [i for i, (_, c) in enumerate(layout.op_rows) if c == core]
        total = sum(
            int(ops[i][OP_FIELDS.index("cycles")] + ops[i][OP_FIELDS.index("wait_before")])
            for i in rows
        )
        assert total == pcycles[core]


def test_level_100_counts_extended_pmu_per_operator(tmp_path: Path) -> None:
    m, k, n = 64, 256, 128
    model = matmul_model(m, k, n)
    result = compile_model(
        model, ["-aic-num-cores=2", "-stats-level=100", "-aic-pmu-recipe=HmxMacs"]
    )
    _, raws = profile(result, feeds(model), tmp_path)
    layout, _ = load_layout(result.qpc_path)
    assert layout.extended_events == RECIPES["HmxMacs"]
    section = layout.section("ops_pmu")
    assert section is not None and section.fields[0] == "0x11"
    assert int(raws[0]["ops_pmu"][:, 0].sum()) == m * k * n


def test_pmu_counters_count_per_core_and_thread(tmp_path: Path) -> None:
    m, k, n = 64, 256, 128
    model = matmul_model(m, k, n)
    result = compile_model(model, ["-aic-num-cores=2", "-ddr-stats", "-aic-pmu-recipe=AxiRd"])
    _, raws = profile(result, feeds(model), tmp_path)
    layout, _ = load_layout(result.qpc_path)
    assert layout.pmu_events == RECIPES["AxiRd"]
    pmu = raws[0]["pmu"].reshape(2, 6, len(layout.pmu_events))
    dma = THREADS.index("dma")
    for core in range(2):
        assert pmu[core, dma, 0] == raws[0]["ddr"][core][0]  # AXI_RD_BYTES = DDR read
        assert pmu[core, dma, 2] == raws[0]["ddr"][core][1]  # constants read
        assert (pmu[core, :dma, 0] == 0).all()  # AXI bytes count on the DMA thread only
    macs = compile_model(model, ["-aic-num-cores=2", "-aic-pmu-events=11,3F"])
    _, raws = profile(macs, feeds(model), tmp_path / "macs")
    pmu = raws[0]["pmu"].reshape(2, 6, 2)
    assert int(pmu[:, THREADS.index("hmx"), 0].sum()) == m * k * n
    assert int(pmu[:, :, 1].sum()) == 0  # 0x3F is outside the catalogue: counts zero


# ------------------------------------------------------------------------------------- PMU


def test_pmu_catalogue_has_unique_ids_and_recipes_use_at_most_8_catalogued_events() -> None:
    assert len({e.id for e in CATALOGUE}) == len(CATALOGUE)
    assert set(RECIPES) == {"AxiRd", "AxiWr", "AxiRdWr", "KernelUtil", "HmxMacs"}
    for events in RECIPES.values():
        assert 0 < len(events) <= 8 and all(e in BY_ID for e in events)


def test_docs_list_every_catalogued_event_and_every_recipe() -> None:
    text = DOCS.read_text()
    for event in CATALOGUE:
        assert re.search(rf"0x{event.id:02X}\s*\|\s*`?{event.name}`?", text), event.name
    for recipe, events in RECIPES.items():
        row = next(line for line in text.splitlines() if line.startswith(f"| `{recipe}`"))
        assert all(BY_ID[e].name in row for e in events), recipe


def test_an_event_outside_the_catalogue_is_accepted_with_a_warning_that_it_counts_zero() -> None:
    result = compile_model(matmul_model(), ["-aic-pmu-events=3F,11"])
    warning = next(w for w in result.warnings if w["code"] == "pmu_event_not_modelled")
    assert "0x3F" in warning["message"] and "zero" in warning["message"]
    assert "0x11" not in warning["message"]


def test_pmu_recipe_and_events_are_exclusive_and_at_most_8_events_are_allowed() -> None:
    with pytest.raises(CompileError, match="one or the other"):
        compile_model(matmul_model(), ["-aic-pmu-recipe=AxiRd", "-aic-pmu-events=30"])
    with pytest.raises(CompileError):
        compile_model(matmul_model(), ["-aic-pmu-events=1,2,3,4,5,6,7,8,9"])
    with pytest.raises(CompileError):
        compile_model(matmul_model(), ["-aic-pmu-recipe=Nope"])


# --------------------------------------------------------------------------- normalisation


def test_stats_batchsize_normalises_reported_figures_to_one_inference(tmp_path: Path) -> None:
    from compiler_core.profiling.opstats import analyse

    model = matmul_model()
    one = compile_model(model, ["-stats-level=70"])
    four = compile_model(model, ["-stats-level=70", "-stats-batchsize=4"])
    stats = []
    for name, result in (("one", one), ("four", four)):
        run_qpc(result.qpc_path, feeds(model), profiling_out_dir=tmp_path / name)
        raw = (tmp_path / name / "stats-inf-00000.bin").read_bytes()
        stats.append(analyse(result.qpc_path, [raw]))
    assert stats[1].batchsize == 4
    assert stats[1].inference_pcycles == pytest.approx(stats[0].inference_pcycles / 4)
    for a, b in zip(stats[0].ops, stats[1].ops, strict=True):
        assert b.cycles == pytest.approx(a.cycles / 4)
        assert b.share_percent == pytest.approx(a.share_percent)
    # the raw buffers are the device's counts: the same but for the header's batch size
    raws = [
        decode_stats(s.layout, (tmp_path / n / "stats-inf-00000.bin").read_bytes())
        for s, n in zip(stats, ("one", "four"), strict=True)
    ]
    assert (raws[0]["ops"] == raws[1]["ops"]).all()


def test_stats_batchsize_defaults_to_the_batch_size() -> None:
    result = compile_model(matmul_model(), ["-batchsize=3"])
    layout, _ = load_layout(result.qpc_path)
    assert layout.batchsize == 3


# ------------------------------------------------------------------ perf metrics and warnings


def test_perf_metrics_are_estimated_and_consistent() -> None:
    result = compile_model(matmul_model(relu=True), ["-aic-num-cores=2", "-convert-to-fp16"])
    metrics = result.metrics
    program = result.program
    assert metrics["estimated"] is True
    assert metrics["aic_hmx_mac_estimate"] == 64 * 256 * 128
    assert (
        metrics["aic_hmx_mac_estimate"] + metrics["aic_non_hmx_mac_estimate"]
        == metrics["original_mac_estimate"]
    )
    hist = metrics["operation_size_histogram"]
    assert sum(r["ops"] for r in hist) == len(program.kernels)
    assert hist[-1]["cumulative_percent"] == 100
    total = metrics["memory_traffic"]["total"]
    weights = 256 * 128 * 2  # fp16
    # resident: loaded once at activation, never per inference
    assert total["ddr_read_constant_only_bytes"] == 0
    assert metrics["activation_ddr_read_bytes"] == weights  # read once, however many copies
    assert metrics["resident_constants_bytes"] >= weights
    assert metrics["resident_constants_bytes_per_core"] >= weights // 2
    assert (
        total["activation_spill_read_bytes"]
        == total["ddr_read_bytes"] - total["ddr_read_constant_only_bytes"]
    )
    ports = {p["port"]: p for p in metrics["memory_traffic"]["per_port"]}
    assert ports["x"]["direction"] == "in" and ports["x"]["host_bytes"] == 64 * 256 * 4
    assert [c["core"] for c in metrics["per_core"]] == ["c00", "c01"]
    assert [c["vtcm_bytes"] for c in metrics["per_core"]] == program.vtcm_used
    assert metrics["kernels"] == metrics["kernels_hmx"] + metrics["kernels_hvx"]
    clock = metrics["clock_mhz"] * 1e6
    assert metrics["estimated_latency_us"] == pytest.approx(
        metrics["estimated_cycles"] / clock * 1e6, rel=1e-3
    )
    # queued inferences overlap the host transfers: the device's own time or PCIe bounds them
    assert metrics["estimated_device_latency_us"] <= metrics["estimated_latency_us"]
    link = CompileOptions().device.soc_link_bytes_per_s  # the SoC's PCIe port, 13.5 GB/s
    assert metrics["host_transfer_us"] == pytest.approx(
        (64 * 256 + 64 * 128) * 4 / link * 1e6, rel=1e-3
    )
    bound = max(metrics["estimated_device_latency_us"], metrics["host_transfer_us"])
    assert metrics["estimated_inferences_per_second"] == pytest.approx(64 / bound * 1e6, rel=1e-3)


def _codes(result: CompileResult) -> dict[str, dict[str, Any]]:
    return {w["code"]: w for w in result.warnings}


def test_fp32_compute_warning_names_the_nodes_and_suggests_fp16() -> None:
    flags = ["-aic-perf-warnings", "-aic-num-cores=1"]
    warned = _codes(compile_model(matmul_model(256, 512, 512), flags))
    assert warned["fp32_compute"]["nodes"] == ["mm"]
    assert "-convert-to-fp16" in warned["fp32_compute"]["suggestion"]
    fp16 = _codes(compile_model(matmul_model(256, 512, 512), [*flags, "-convert-to-fp16"]))
    assert "fp32_compute" not in fp16
    quiet = _codes(compile_model(matmul_model(256, 512, 512), ["-aic-num-cores=1"]))
    assert "fp32_compute" not in quiet  # only with -aic-perf-warnings


def test_a_kernel_cut_to_fit_vtcm_is_warned_with_the_ratio_to_raise() -> None:
    model = matmul_model(256, 1024, 1024)
    result = compile_model(
        model, ["-aic-perf-warnings", "-aic-num-cores=1", "-vtcm-working-set-limit-ratio=0.1"]
    )
    warning = _codes(result)["vtcm_overflow_split"]
    assert warning["nodes"] == ["mm"]
    assert "-vtcm-working-set-limit-ratio" in warning["suggestion"]


def test_a_serial_kernel_leaves_cores_idle_and_both_are_warned() -> None:
    # The TopK alone: beside a Relu split over the 4 cores, the other cores are no longer
    # idle enough to warn since the multicasts stopped waiting on each other (147e247).
    graph = helper.make_graph(
        [helper.make_node("TopK", ["x", "k"], ["v", "i"], axis=1, name="topk")],
        "serial",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1 << 16])],
        [
            helper.make_tensor_value_info("v", TensorProto.FLOAT, [1, 8]),
            helper.make_tensor_value_info("i", TensorProto.INT64, [1, 8]),
        ],
        [numpy_helper.from_array(np.array([8], dtype=np.int64), "k")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    codes = _codes(compile_model(model, ["-aic-perf-warnings", "-aic-num-cores=4"]))
    assert codes["serial_kernel"]["nodes"] == ["topk"]
    assert "idle_cores" in codes and "-aic-num-cores" in codes["idle_cores"]["suggestion"]


def test_activations_that_do_not_fit_on_chip_are_warned_as_spill_with_a_flag_to_try() -> None:
    # 2048 x 2048 fp16 products are 8 MiB: with both inputs in VTCM, the result cannot stay.
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["a", "b"], ["y"], name="mm")],
        "two_activations",
        [
            helper.make_tensor_value_info("a", TensorProto.FLOAT, [2048, 2048]),
            helper.make_tensor_value_info("b", TensorProto.FLOAT, [2048, 2048]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2048, 2048])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    result = compile_model(model, ["-aic-perf-warnings", "-aic-num-cores=8", "-convert-to-fp16"])
    warning = _codes(result)["spill_to_ddr"]
    assert warning["nodes"][0] == "mm"  # the producer of what did not fit comes first
    assert "MiB" in warning["message"]
    assert "-aic-num-cores" in warning["suggestion"]


def test_every_warning_has_a_code_nodes_and_a_suggestion() -> None:
    result = compile_model(matmul_model(256, 512, 512), ["-aic-perf-warnings", "-aic-num-cores=4"])
    assert result.warnings
    for warning in result.warnings:
        assert set(warning) >= {"code", "message", "nodes", "suggestion"}
        assert re.fullmatch(r"[a-z0-9_]+", warning["code"]) and warning["suggestion"]
