"""Depth-first schedule by image group (issue 10, item 5): `-aic-enable-depth-first` runs the
network group of images by group of images, each group's kernels cloned from the layer's.

- The grouped program (group after group, or interleaved) computes what ONNX Runtime computes,
  on 1, 4 and 14 cores, fp32 and fp16, and has no race (the happens-before check of
  tests/test_codegen.py); without its waits it breaks.
- A layer's clones read one resident copy of its weights: each core loads it once, when the
  program is activated, and an inference reads no weight from DDR.
- `-aic-depth-first-mem` sizes the groups; without it the cost model decides, and never picks
  a slower schedule than the batch-major one. When depth-first cannot apply a warning says why.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from compiler_core import compile_model, load_qpc, run_qpc
from compiler_core.build import CompileResult
from compiler_core.lowering import depth_first
from compiler_core.lowering.program import KIND_CONSTANT, DmaLoad, Program, RunKernel, stored_bytes
from compiler_core.runtime.executor import Executor
from tests.codegen_models import conv_net, probed_light_model
from tests.models import light_model_input
from tests.test_codegen import (
    TOLERANCE,
    VTCM,
    _assert_close,
    _flags,
    _loaded,
    _ort_run,
    _replace,
    _without_waits,
    races,
)

DEPTH_FIRST = ("-aic-enable-depth-first",)
FORCED = (*DEPTH_FIRST, "-aic-depth-first-mem=8")
"""Depth-first with a group size from the memory bound: applied whatever the cost model says."""


def _conv_feeds(batch: int, size: int = 32) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    return {"x": rng.standard_normal((batch, 3, size, size)).astype(np.float32)}


def _groups(program: Program) -> int:
    """How many image groups the program runs (1: batch-major)."""
    suffixes = {t.name.rsplit(".group", 1)[1] for t in program.tensors if ".group" in t.name}
    return max(1, len(suffixes))


@contextmanager
def _compiled(model: onnx.ModelProto | bytes, flags: list[str]) -> Iterator[CompileResult]:
    result = compile_model(model, flags)
    try:
        yield result
    finally:
        result.cleanup()


def _warnings(result: CompileResult) -> list[str]:
    return [w["message"] for w in result.warnings if w["code"] == "depth_first_not_applied"]


# ------------------------------------------------------------------------------ correctness


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("cores", [1, 4, 14])
def test_image_groups_compute_what_onnxruntime_computes(cores: int, precision: str) -> None:
    model = conv_net(batch=4)
    feeds = _conv_feeds(4)
    with _compiled(model, _flags(cores, precision, *FORCED)) as result:
        program = result.program
        assert _groups(program) == 2 == result.metrics["depth_first_groups"]
        assert not _warnings(result)
        assert not [w for w in result.warnings if w["code"] == "option_without_effect"]
        assert races(program) == []
        got = run_qpc(result.qpc_path, feeds)
    _assert_close(got, _ort_run(model.SerializeToString(), feeds), precision)


@pytest.mark.parametrize(
    "name",
    [
        "light_squeezenet",
        pytest.param("light_densenet121", marks=pytest.mark.slow),
    ],
)
def test_a_light_cnn_at_batch_2_runs_image_by_image_as_onnxruntime_does(name: str) -> None:
    """Two different images through the grouped program; ONNX Runtime runs the batch-1
    model on each (the models declare batch 1). The other light CNNs reshape to a fixed
    batch of 1 before their outputs, so -batchsize=2 does not batch them."""
    model = probed_light_model(name)
    graph = onnx.load_from_string(model).graph
    weights = {i.name for i in graph.initializer}
    (data,) = [i for i in graph.input if i.name not in weights]
    shape = tuple(d.dim_value for d in data.type.tensor_type.shape.dim)
    images = light_model_input((2, *shape[1:]))
    images[1] = images[1][::-1, ::-1, ::-1]  # a second, different image
    per_image = [_ort_run(model, {data.name: images[j : j + 1]}) for j in range(2)]
    want = {k: np.concatenate([p[k] for p in per_image]) for k in per_image[0]}
    with _compiled(model, _flags(4, "fp32", "-batchsize=2", *FORCED)) as result:
        assert _groups(result.program) == 2, _warnings(result)
        assert races(result.program) == []
        got = run_qpc(result.qpc_path, {data.name: images})
    _assert_close(got, want, "fp32")


def _group_order(program: Program) -> list[int]:
    """The group of each kernel, in program order (by the group of the tensor it writes)."""
    order = []
    for kernel in program.kernels:
        names = [program.tensors[t].name for t in kernel.outputs if t >= 0]
        order.append(int(names[0].rsplit(".group", 1)[1]) if ".group" in names[0] else -1)
    return order


@pytest.mark.parametrize("cores", [1, 4, 14])
def test_interleaved_groups_compute_what_onnxruntime_computes(
    cores: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Group 1 starts each layer one layer after group 0 (the shortest lag)."""
    grouped = depth_first.split_into_groups
    monkeypatch.setattr(
        depth_first, "split_into_groups", lambda graph, groups, lag=None: grouped(graph, groups, 1)
    )
    model = conv_net(batch=4)
    feeds = _conv_feeds(4)
    with _loaded(model, _flags(cores, "fp32", *FORCED), feeds) as loaded:
        order = _group_order(loaded.program)
        assert order.index(1) < len(order) - 1 - order[::-1].index(0), order  # interleaved
        assert races(loaded.program) == []
        if cores > 1:  # one core has nothing to wait for
            assert loaded.broken(_without_waits(loaded.program))


def test_removing_the_semaphore_waits_breaks_a_depth_first_program() -> None:
    model = conv_net(batch=4)
    with _loaded(model, _flags(4, "fp32", *FORCED), _conv_feeds(4)) as loaded:
        program = loaded.program
        assert _groups(program) == 2
        assert loaded.broken(_without_waits(program))
        assert races(_without_waits(program), limit=1)
        waits = [
            (c, i)
            for c, stream in enumerate(program.streams)
            for i, instr in enumerate(stream)
            if type(instr).__name__ == "SemWait"
        ]
        broken = [w for w in waits if races(_replace(program, *w, None), limit=1)]
        assert broken, "no wait of the grouped program orders anything"


# --------------------------------------------------------------------------- resident weights


def test_a_layers_clones_read_one_resident_copy_loaded_once() -> None:
    model = conv_net(batch=4)
    feeds = _conv_feeds(4)
    with _compiled(model, _flags(4, "fp32", *FORCED)) as result:
        program = result.program
        metrics = result.metrics
        with load_qpc(result.qpc_path) as qpc:
            executor = Executor(program, qpc.segments["constants.bin"], VTCM)
            executor.run(feeds)
    assert _groups(program) == 2
    loads = Counter(
        (core, load.tensor)
        for stream in program.setup
        for load in stream
        if isinstance(load, DmaLoad)
        for core in range(program.num_cores)
        if load.cores >> core & 1
    )
    assert loads and max(loads.values()) == 1  # every core loads each weight once
    # every clone of a layer reads its weight at the same place on a core
    where: dict[tuple[int, int], set[int]] = {}
    readers: Counter[int] = Counter()
    for core, stream in enumerate(program.streams):
        for instr in stream:
            if not isinstance(instr, RunKernel):
                continue
            kernel = program.kernels[instr.kernel]
            for tid, operand in zip(kernel.inputs, instr.inputs, strict=True):
                if operand is not None and program.tensors[tid].kind == KIND_CONSTANT:
                    where.setdefault((core, tid), set()).update(p.vtcm for p in operand.pieces)
                    readers[tid] += 1
    assert all(len(offsets) == 1 for offsets in where.values())
    assert all(offset < program.resident for o in where.values() for offset in o)
    setup_bytes = sum(
        stored_bytes(program.tensors[i.tensor], i.box)
        for s in program.setup
        for i in s
        if isinstance(i, DmaLoad)
    )
    assert sum(t.ddr_read for t in executor.activation_traffic) == setup_bytes > 0
    assert metrics["activation_ddr_read_bytes"] == setup_bytes
    assert [t.as_row()[1] for t in executor.traffic] == [0] * program.num_cores
    assert metrics["memory_traffic"]["total"]["ddr_read_constant_only_bytes"] == 0


# ------------------------------------------------------------------------------ the choice


def test_the_cost_model_never_picks_a_slower_schedule_than_batch_major() -> None:
    model = conv_net(batch=8)
    with _compiled(model, _flags(14, "fp16")) as plain:
        batch_major = plain.metrics["estimated_device_latency_us"]
    with _compiled(model, _flags(14, "fp16", *DEPTH_FIRST)) as chosen:
        assert chosen.metrics["estimated_device_latency_us"] <= batch_major
        if _groups(chosen.program) == 1:  # kept batch-major: the warning gives both figures
            (message,) = _warnings(chosen)
            assert "not applied" in message and "batch-major" in message


def test_the_memory_bound_sizes_the_groups() -> None:
    """Larger images: one image's activations take about 5 MiB at their peak, so a bound of
    8 MiB makes groups of one image and one of 32 MiB groups of two (of a batch of 4)."""
    model = conv_net(batch=4, channels=32, size=192)
    groups = {}
    for mem in (8, 32):
        flags = _flags(4, "fp32", *DEPTH_FIRST, f"-aic-depth-first-mem={mem}")
        with _compiled(model, flags) as result:
            groups[mem] = _groups(result.program)
    assert groups[8] > groups[32] >= 2


def test_at_batch_1_the_warning_says_depth_first_cannot_apply() -> None:
    with _compiled(conv_net(batch=1), _flags(1, "fp32", *DEPTH_FIRST)) as result:
        (message,) = _warnings(result)
        assert "batch is 1" in message
        assert _groups(result.program) == 1


def test_a_network_that_mixes_images_stays_batch_major_and_says_so() -> None:
    """y = x - mean over the batch: image j's output needs every image."""
    graph = helper.make_graph(
        [
            helper.make_node("Relu", ["x"], ["r"], name="relu"),
            helper.make_node("ReduceMean", ["r"], ["m"], axes=[0], keepdims=1, name="mean"),
            helper.make_node("Sub", ["r", "m"], ["y"], name="centre"),
        ],
        "mixes",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8, 16])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    feeds = {"x": np.random.default_rng(7).standard_normal((4, 8, 16)).astype(np.float32)}
    with _compiled(model, _flags(4, "fp32", *FORCED)) as result:
        (message,) = _warnings(result)
        assert "cannot apply" in message and "mean" in message
        assert _groups(result.program) == 1
        got = run_qpc(result.qpc_path, feeds)
    rtol, atol = TOLERANCE["fp32"]
    np.testing.assert_allclose(
        got["y"], _ort_run(model.SerializeToString(), feeds)["y"], rtol, atol
    )


def test_activations_that_spill_at_batch_8_stay_on_chip_in_image_groups() -> None:
    """On one core, 8 images' activations do not fit VTCM: the batch-major program spills
    them (and its warning suggests depth-first); groups of images keep them on chip."""
    model = conv_net(batch=8, channels=32, size=128)
    with _compiled(model, _flags(1, "fp16", "-aic-perf-warnings")) as plain:
        (spill,) = [w for w in plain.warnings if w["code"] == "spill_to_ddr"]
        assert "-aic-enable-depth-first" in spill["suggestion"]
        spilled = plain.metrics["memory_traffic"]["total"]["ddr_read_bytes"]
        batch_major = plain.metrics["estimated_device_latency_us"]
    with _compiled(model, _flags(1, "fp16", "-aic-perf-warnings", *DEPTH_FIRST)) as grouped:
        assert _groups(grouped.program) > 1
        assert not [w for w in grouped.warnings if w["code"] == "spill_to_ddr"]
        assert grouped.metrics["memory_traffic"]["total"]["ddr_read_bytes"] < spilled
        assert grouped.metrics["estimated_device_latency_us"] < batch_major
