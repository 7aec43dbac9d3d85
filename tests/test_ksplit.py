"""Reduction-axis (K) splits (issue 10, item 4): a MatMul/Gemm cut along K into partial
products on several cores, then a reduction (NoC copies of the partials + ReduceSum, with
the fused epilogue) cut over the output.

- The split computes what ONNX Runtime computes on 1, 4 and 14 cores, fp32 and fp16, with a
  fused bias and activation, and has no race between the cores' streams.
- The chooser takes a K split where the model says it is faster (a head with few columns
  and a deep K) and not where an output cut is (many columns, or many rows).
- The reduction's semaphore waits carry weight; the runtime's byte counts are the metrics;
  no estimate beats a physical floor.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler_core import compile_model, load_qpc
from compiler_core.build import CompileResult
from compiler_core.devices import get_device
from compiler_core.lowering.ksplit import slice_counts
from compiler_core.lowering.placement import CodegenPolicy
from compiler_core.lowering.program import NocCopy, Program, RunKernel, SemWait
from compiler_core.lowering.tiling import TilingRequest
from compiler_core.ops import REGISTRY
from compiler_core.ops.partial_matmul import slice_bounds
from compiler_core.ops.registry import NodeInfo
from compiler_core.runtime.executor import Executor
from tests.test_codegen import TOLERANCE, VTCM, Loaded, _replace, _rows, races

DEVICE = "aic100-standard"


def head(
    rows: int, depth: int, columns: int, *, trans_b: bool = False, seed: int = 0
) -> onnx.ModelProto:
    """Gemm (with C) + Relu: a classifier head or a decode step's projection."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((columns, depth) if trans_b else (depth, columns)) / np.sqrt(depth)
    c = rng.standard_normal(columns)
    graph = helper.make_graph(
        [
            helper.make_node("Gemm", ["x", "w", "c"], ["g"], transB=int(trans_b)),
            helper.make_node("Relu", ["g"], ["y"]),
        ],
        "head",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, depth])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, columns])],
        [
            numpy_helper.from_array(w.astype(np.float32), "w"),
            numpy_helper.from_array(c.astype(np.float32), "c"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def projection(rows: int, depth: int, columns: int, seed: int = 1) -> onnx.ModelProto:
    """MatMul on a [1, rows, depth] activation + bias Add + Relu (fused as an epilogue)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((depth, columns)) / np.sqrt(depth)
    b = rng.standard_normal(columns)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["m"]),
            helper.make_node("Add", ["m", "b"], ["a"]),
            helper.make_node("Relu", ["a"], ["y"]),
        ],
        "projection",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, rows, depth])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, rows, columns])],
        [
            numpy_helper.from_array(w.astype(np.float32), "w"),
            numpy_helper.from_array(b.astype(np.float32), "b"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _feeds(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    value = model.graph.input[0]
    shape = [d.dim_value for d in value.type.tensor_type.shape.dim]
    return {value.name: np.random.default_rng(5).standard_normal(shape).astype(np.float32)}


def _ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options).run(None, feeds)[0]


def _flags(cores: int, precision: str = "fp32") -> list[str]:
    return [
        f"-aic-num-cores={cores}",
        f"-aic-device={DEVICE}",
        *(["-convert-to-fp16"] if precision == "fp16" else []),
    ]


def _program(result: CompileResult) -> Program:
    with load_qpc(result.qpc_path) as qpc:
        return qpc.program()


def _ops(program: Program) -> list[str]:
    return [k.info.op_type for k in program.kernels]


def _run(result: CompileResult, feeds: dict[str, np.ndarray]) -> tuple[np.ndarray, Executor]:
    with load_qpc(result.qpc_path) as qpc:
        program = qpc.program()
        executor = Executor(program, qpc.segments["constants.bin"], VTCM)
        outputs = executor.run(feeds)
    return outputs[program.tensors[program.outputs[0]].name], executor


def _latency(model: onnx.ModelProto, cores: int, k_splits: bool, precision: str = "fp16") -> float:
    result = compile_model(model, _flags(cores, precision), policy=CodegenPolicy(k_splits=k_splits))
    try:
        return float(result.metrics["estimated_device_latency_us"])
    finally:
        result.cleanup()


# --------------------------------------------------------------------------- correctness


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("cores", [1, 4, 14])
@pytest.mark.parametrize(
    "model",
    [
        pytest.param(lambda: head(1, 8192, 16), id="gemm-head"),
        pytest.param(lambda: head(2, 16384, 16, trans_b=True), id="gemm-transB"),
        pytest.param(lambda: projection(1, 16384, 24), id="matmul-bias"),
    ],
)
def test_a_k_split_with_a_fused_epilogue_computes_what_onnxruntime_computes(
    model: object, cores: int, precision: str
) -> None:
    onnx_model = model()  # type: ignore[operator]
    feeds = _feeds(onnx_model)
    result = compile_model(onnx_model, _flags(cores, precision))
    try:
        program = _program(result)
        ops = _ops(program)
        if cores == 1:
            assert "PartialMatMul" not in ops  # nothing to reduce across
        else:
            assert "PartialMatMul" in ops and "ReduceSum" in ops, ops
            reduction = program.kernels[ops.index("ReduceSum")]
            # the bias and the Relu run after the partials are added, not on each partial
            assert "Relu" in [e.op_type for e in reduction.epilogue]
            assert not program.kernels[ops.index("PartialMatMul")].epilogue
        assert not races(program), races(program)
        got, _ = _run(result, feeds)
    finally:
        result.cleanup()
    rtol, atol = TOLERANCE[precision]
    np.testing.assert_allclose(got, _ort(onnx_model, feeds), rtol=rtol, atol=atol)


def test_k_slices_are_whole_hmx_blocks_and_cover_k() -> None:
    bounds = slice_bounds(2048, 14)
    assert bounds[0] == 0 and bounds[-1] == 2048 and len(bounds) == 15
    assert all(b % 32 == 0 for b in bounds)
    assert all(hi > lo for lo, hi in zip(bounds, bounds[1:], strict=False))


# ------------------------------------------------------------------------------- chooser


@pytest.mark.parametrize(
    ("model", "cores"),
    [
        pytest.param(lambda: head(1, 8192, 16), 14, id="head-1x8192x16-14c"),
        pytest.param(lambda: head(1, 8192, 16), 4, id="head-1x8192x16-4c"),
        pytest.param(lambda: projection(1, 16384, 32), 14, id="matmul-1x16384x32-14c"),
    ],
)
def test_the_chooser_takes_a_k_split_where_the_model_says_it_is_faster(
    model: object, cores: int
) -> None:
    """A few columns and a deep K: an output cut leaves cores idle (or pads each core's
    columns to a whole HMX block), a K split gives every core 1/P of the product."""
    onnx_model = model()  # type: ignore[operator]
    result = compile_model(onnx_model, _flags(cores, "fp16"))
    try:
        assert "PartialMatMul" in _ops(_program(result))
        with_k = float(result.metrics["estimated_device_latency_us"])
    finally:
        result.cleanup()
    assert with_k < _latency(onnx_model, cores, k_splits=False)


def _request(rows: int, depth: int, columns: int, cores: int) -> TilingRequest:
    opdef = REGISTRY.lookup("MatMul", "", 17)
    assert opdef is not None
    info = NodeInfo(
        op_type="MatMul",
        name="m",
        attrs={},
        in_shapes=((1, rows, depth), (depth, columns)),
        in_dtypes=("float16", "float16"),
        out_shapes=((1, rows, columns),),
        out_dtypes=("float16",),
    )
    return TilingRequest(info, opdef, (), (), cores, 1, None, VTCM, 1 << 20)


@pytest.mark.parametrize(
    ("rows", "depth", "columns"),
    [
        pytest.param(1, 2048, 2048, id="decode-projection-1x2048x2048"),
        pytest.param(64, 2048, 1024, id="tall-64x2048x1024"),
    ],
)
def test_the_chooser_keeps_an_output_cut_where_that_is_faster(
    rows: int, depth: int, columns: int
) -> None:
    """Enough columns for every core: an output cut reads each weight once and adds nothing;
    a K split (considered: these shapes may be K-split) would add partials and a reduction."""
    assert slice_counts(_request(rows, depth, columns, 14), 14)
    model = projection(rows, depth, columns)
    result = compile_model(model, _flags(14, "fp16"))
    try:
        assert "PartialMatMul" not in _ops(_program(result))
        chosen = float(result.metrics["estimated_device_latency_us"])
    finally:
        result.cleanup()
    assert chosen == _latency(model, 14, k_splits=False)


def test_only_matmuls_with_a_deep_k_and_few_rows_are_k_split_candidates() -> None:
    assert slice_counts(_request(1, 2048, 16, 14), 14) == [2, 7, 14]
    assert slice_counts(_request(1, 2048, 16, 1), 1) == []  # one core: nothing to reduce
    assert slice_counts(_request(1536, 2048, 16, 14), 14) == []  # partials > the activation
    assert slice_counts(_request(1, 96, 16, 14), 14) == []  # slices under two HMX blocks


# ---------------------------------------------------------------- synchronisation, traffic


@pytest.fixture(scope="module")
def k_split_4() -> Loaded:
    model = head(1, 8192, 16)
    feeds = _feeds(model)
    result = compile_model(model, _flags(4))
    try:
        with load_qpc(result.qpc_path) as qpc:
            loaded = Loaded(
                qpc.program(),
                memoryview(bytes(qpc.segments["constants.bin"])),
                feeds,
                _ort(model, feeds),
            )
    finally:
        result.cleanup()
    assert "PartialMatMul" in _ops(loaded.program)
    assert not loaded.broken(loaded.program)
    return loaded


def test_removing_a_wait_of_the_reduction_breaks_the_answer_or_is_a_race(
    k_split_4: Loaded,
) -> None:
    """A reduction tile adds partials that other cores copied into its VTCM: it waits for
    those copies. Without any one of its waits the answer goes wrong or the race check finds
    the read of a partial that no semaphore orders after its copy."""
    program = k_split_4.program
    reduce_id = _ops(program).index("ReduceSum")
    partials = program.kernels[_ops(program).index("PartialMatMul")].outputs[0]
    assert any(isinstance(i, NocCopy) and i.tensor == partials for s in program.streams for i in s)
    guarded = []
    for core, stream in enumerate(program.streams):
        for index, instr in enumerate(stream):
            if isinstance(instr, RunKernel) and instr.kernel == reduce_id:
                before = index - 1
                while before >= 0 and isinstance(stream[before], SemWait):
                    guarded.append((core, before))
                    before -= 1
    assert guarded
    for core, index in guarded:
        tampered = _replace(program, core, index, None)
        assert races(tampered, limit=1) or k_split_4.broken(tampered), (core, index)


def test_the_bytes_the_runtime_moves_are_the_metrics_of_a_k_split(tmp_path: Path) -> None:
    model = head(1, 8192, 16)
    result = compile_model(model, _flags(14))
    try:
        assert "PartialMatMul" in _ops(_program(result))
        compiled = [
            [
                row["ddr_read_bytes"],
                row["constant_only_bytes"],
                row["ddr_write_bytes"],
                row["multicast_bytes"],
                row["noc_bytes"],
            ]
            for row in result.metrics["memory_traffic"]["per_core"]
        ]
        _, executor = _run(result, _feeds(model))
    finally:
        result.cleanup()
    assert _rows(executor.traffic) == compiled
    assert sum(row[4] for row in compiled) > 0  # the partials cross the NoC


@pytest.mark.parametrize("cores", [4, 14])
def test_no_k_split_estimate_beats_a_physical_floor(cores: int) -> None:
    result = compile_model(head(1, 8192, 16), _flags(cores, "fp16"))
    try:
        m = result.metrics
        assert "PartialMatMul" in _ops(_program(result))
    finally:
        result.cleanup()
    latency = m["estimated_latency_us"]
    assert 0 < m["floor_compute_us"] <= latency and 0 < m["floor_ddr_us"] <= latency
    device = get_device(DEVICE)
    peak = device.hmx_fp16_macs_per_cycle * cores * device.clock_hz
    assert m["aic_hmx_mac_estimate"] >= 8192 * 16  # every MAC of the product, once
    assert m["floor_compute_us"] >= 0.999 * m["aic_hmx_mac_estimate"] / peak * 1e6


def test_mxfp6_weights_keep_their_matmul_whole_along_k() -> None:
    """MXFP6 encodes the B operands of MatMul/Gemm kernels, which read B whole along K: the
    compile that asks for it does not K-split (and still encodes the weight)."""
    model = head(1, 8192, 16)
    result = compile_model(model, [*_flags(4, "fp16"), "-mxfp6-matmul"])
    try:
        assert "PartialMatMul" not in _ops(_program(result))
        assert "mxfp6_no_weights" not in {w.get("code") for w in result.warnings}
    finally:
        result.cleanup()
