"""Lowering, tiling, memory planning and the runtime that proves them right."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler_core import CompileError, compile_model, run_qpc
from compiler_core.lowering.memory import plan_memory
from compiler_core.lowering.placement import CodegenPolicy
from compiler_core.lowering.program import (
    KIND_ACTIVATION,
    DmaLoad,
    DmaStore,
    Program,
    RunKernel,
    SemWait,
    decode_program,
    encode_program,
)
from compiler_core.ops.registry import full_box
from compiler_core.qpc.container import load_qpc
from compiler_core.runtime.executor import Executor, RuntimeFault
from tests.models import transformer_encoder

VTCM = 8_323_072


def _cnn(batch: int = 1, channels: int = 32, size: int = 32, seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)

    def w(name: str, shape: tuple[int, ...]) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.2).astype(np.float32), name)

    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node(
            "Conv", ["r1", "w2"], ["c2"], pads=[1, 1, 1, 1], strides=[2, 2], name="conv2"
        ),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("Conv", ["r2", "w3"], ["c3"], pads=[1, 1, 1, 1], name="conv3"),
        helper.make_node(
            "MaxPool", ["r2"], ["p"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], name="pool"
        ),
        helper.make_node("Add", ["c3", "p"], ["s"], name="residual"),
        helper.make_node("GlobalAveragePool", ["s"], ["g"], name="gap"),
        helper.make_node("Flatten", ["g"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "wf", "bf"], ["y"], transB=1, name="fc"),
    ]
    graph = helper.make_graph(
        nodes,
        "cnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, size, size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 10])],
        [
            w("w1", (channels, 3, 3, 3)),
            w("b1", (channels,)),
            w("w2", (channels, channels, 3, 3)),
            w("w3", (channels, channels, 3, 3)),
            w("wf", (10, channels)),
            w("bf", (10,)),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _reference(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    return ort.InferenceSession(model.SerializeToString()).run(None, feeds)[0]


def _input(batch: int = 1, size: int = 32) -> np.ndarray:
    return np.random.default_rng(7).standard_normal((batch, 3, size, size)).astype(np.float32)


def _program(result) -> tuple[Program, memoryview]:  # type: ignore[no-untyped-def]
    qpc = load_qpc(result.qpc_path)
    return qpc.program(), qpc.segments["constants.bin"]


@pytest.mark.parametrize(
    "flags",
    [
        ["-aic-num-cores=1"],
        ["-aic-num-cores=4"],
        ["-aic-num-cores=16"],
        ["-aic-num-cores=4", "-ols=2"],
        ["-aic-num-cores=4", "-mos=1"],
        ["-aic-num-cores=2", "-vtcm-working-set-limit-ratio=0.02"],
        ["-aic-num-cores=3", "-size-split-granularity=512", "-allocator-dealloc-delay=2"],
    ],
)
def test_every_split_policy_computes_what_onnxruntime_computes(flags: list[str]) -> None:
    model = _cnn(batch=2)
    x = _input(batch=2)
    result = compile_model(model, flags)
    np.testing.assert_allclose(
        run_qpc(result.qpc_path, {"x": x})["y"], _reference(model, {"x": x}), rtol=1e-4, atol=1e-5
    )


def test_a_small_vtcm_budget_cuts_kernels_into_more_tiles_that_fit_it() -> None:
    model = _cnn()
    roomy = compile_model(model, ["-aic-num-cores=1"]).program
    tight = compile_model(model, ["-aic-num-cores=1", "-vtcm-working-set-limit-ratio=0.01"]).program
    budget = int(VTCM * 0.01)
    assert max(tight.vtcm_used) <= budget < max(roomy.vtcm_used)

    def tiles(p: Program) -> int:
        return sum(isinstance(i, RunKernel) for s in p.streams for i in s)

    assert tiles(tight) > tiles(roomy)


def test_mos_caps_the_output_channel_split() -> None:
    model = _cnn(channels=64)
    program = compile_model(model, ["-aic-num-cores=8", "-mos=2"]).program
    conv = next(k for k in program.kernels if k.name == "conv1")
    boxes = {
        i.out_box[1]
        for s in program.streams
        for i in s
        if isinstance(i, RunKernel) and i.kernel == conv.id
    }
    assert len(boxes) <= 2


def test_activations_alive_at_the_same_time_never_share_ddr() -> None:
    # activations kept on chip take no DDR: spill them all to see DDR reuse
    result = compile_model(
        transformer_encoder(), ["-aic-num-cores=2"], policy=CodegenPolicy(on_chip=False)
    )
    program = result.program
    acts = [t for t in program.tensors if t.kind == KIND_ACTIVATION]
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for k in program.kernels:
        for t in (*k.inputs, *k.outputs):
            if t >= 0:
                first.setdefault(t, k.id)
                last[t] = k.id
    by_range: dict[tuple[int, int], list] = {}
    for t in acts:
        by_range.setdefault((t.ddr_offset, t.nbytes), []).append(t)
    roots = [group[0] for group in by_range.values()]
    for t in program.tensors:
        assert 0 <= t.ddr_offset and t.ddr_offset + t.nbytes <= program.ddr_size
    for i, a in enumerate(roots):
        for b in roots[i + 1 :]:
            overlap = (
                a.ddr_offset < b.ddr_offset + b.nbytes and b.ddr_offset < a.ddr_offset + a.nbytes
            )
            if not overlap or a.id not in first or b.id not in first:
                continue
            assert last[a.id] < first[b.id] or last[b.id] < first[a.id], (a.name, b.name)
    assert program.constants_size <= min(t.ddr_offset for t in acts)


def test_liveness_reuse_makes_activation_memory_smaller_than_their_sum() -> None:
    result = compile_model(
        transformer_encoder(), ["-aic-num-cores=1"], policy=CodegenPolicy(on_chip=False)
    )
    metrics = result.metrics
    acts = sum(t.nbytes for t in result.program.tensors if t.kind == KIND_ACTIVATION)
    assert metrics["static_shared_ddr_size"] < acts


def test_a_graph_larger_than_device_ddr_fails_naming_the_shortfall() -> None:
    from compiler_core.devices import get_device
    from compiler_core.importer import import_model
    from compiler_core.lowering.lower import config_from, lower_graph
    from compiler_core.options import CompileOptions

    imported = import_model(_cnn())
    opts = CompileOptions()
    lowered = lower_graph(
        imported.model.graph, imported.opset, config_from(opts, get_device("aic100-pro"))
    )
    with pytest.raises(CompileError) as info:
        plan_memory(lowered, ddr_capacity=100_000)
    assert info.value.code == "ddr_overflow"
    assert "bytes more than the device's 100,000" in info.value.message


def test_an_op_that_cannot_be_cut_to_fit_vtcm_fails_naming_node_and_bytes() -> None:
    graph = helper.make_graph(
        [helper.make_node("Softmax", ["x"], ["y"], axis=1, name="wide_softmax")],
        "wide",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3_000_000])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3_000_000])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(CompileError) as info:
        compile_model(model)
    assert info.value.code == "vtcm_overflow"
    assert info.value.node == "wide_softmax"
    assert "needs 24,000,000 bytes" in info.value.message
    assert "15,676,928 bytes more than the 8,323,072-byte budget" in info.value.message


def test_the_runtime_honours_semaphores_without_them_the_answer_is_wrong() -> None:
    model = _cnn(batch=2)
    x = _input(batch=2)
    result = compile_model(model, ["-aic-num-cores=4"])
    program, constants = _program(result)
    assert any(isinstance(i, SemWait) for s in program.streams for i in s)
    stripped = dataclasses.replace(
        program, streams=[[i for i in s if not isinstance(i, SemWait)] for s in program.streams]
    )
    good = Executor(program, constants, VTCM).run({"x": x})["y"]
    bad = Executor(stripped, constants, VTCM).run({"x": x})["y"]
    want = _reference(model, {"x": x})
    np.testing.assert_allclose(good, want, rtol=1e-4, atol=1e-5)
    assert not np.allclose(bad, want, rtol=1e-4, atol=1e-5)


def test_the_runtime_detects_a_deadlock() -> None:
    result = compile_model(_cnn(), ["-aic-num-cores=2"])
    program, constants = _program(result)
    streams = [list(s) for s in program.streams]
    streams[0].insert(0, SemWait(sem=program.num_semaphores - 1, count=99))
    with pytest.raises(RuntimeFault, match="deadlock"):
        Executor(dataclasses.replace(program, streams=streams), constants, VTCM).run(
            {"x": _input()}
        )


def test_the_runtime_rejects_a_dma_outside_vtcm() -> None:
    result = compile_model(_cnn(), ["-aic-num-cores=1"])
    program, constants = _program(result)
    streams = [list(s) for s in program.streams]
    index = next(i for i, instr in enumerate(streams[0]) if isinstance(instr, DmaLoad))
    load = streams[0][index]
    assert isinstance(load, DmaLoad)
    streams[0][index] = dataclasses.replace(load, vtcm=VTCM - 4)
    with pytest.raises(RuntimeFault, match="VTCM access"):
        Executor(dataclasses.replace(program, streams=streams), constants, VTCM).run(
            {"x": _input()}
        )


def test_the_runtime_rejects_a_write_into_constants() -> None:
    result = compile_model(_cnn(), ["-aic-num-cores=1"])
    program, constants = _program(result)
    const = next(t for t in program.tensors if t.kind == "constant")
    streams = [list(s) for s in program.streams]
    index = next(i for i, instr in enumerate(streams[0]) if isinstance(instr, DmaStore))
    streams[0][index] = DmaStore(const.id, full_box(const.shape), 0, full_box(const.shape))
    with pytest.raises(RuntimeFault, match="write to constant"):
        Executor(dataclasses.replace(program, streams=streams), constants, VTCM).run(
            {"x": _input()}
        )


def test_program_encoding_round_trips() -> None:
    program = compile_model(transformer_encoder(), ["-aic-num-cores=3"]).program
    decoded = decode_program(encode_program(program))
    assert encode_program(decoded) == encode_program(program)
    assert decoded.streams == program.streams


@pytest.mark.parametrize("name", [None, 'w"\x000', "\x001"])
def test_program_tables_are_what_json_writes_whatever_the_names(name: str | None) -> None:
    """The tables' base64 constants are spliced into the JSON text after encoding; a name
    that looks like the splice's placeholder must not change a byte."""
    from compiler_core.lowering.program import _tables_json, _tables_text

    program = compile_model(_cnn(), ["-aic-num-cores=2"]).program
    assert any(k.info.consts for k in program.kernels)  # arrays to splice
    if name is not None:
        first = dataclasses.replace(program.tensors[0], name=name)
        program = dataclasses.replace(program, tensors=[first, *program.tensors[1:]])
    assert _tables_json(program) == _tables_text(program, None).encode("utf-8")
    assert decode_program(encode_program(program)).tensors == program.tensors


def test_identical_inputs_give_byte_identical_qpcs(tmp_path) -> None:  # type: ignore[no-untyped-def]
    model = _cnn()
    a = compile_model(model, ["-aic-num-cores=4", f"-aic-binary-dir={tmp_path / 'a'}"])
    b = compile_model(
        model.SerializeToString(), ["-aic-num-cores=4", f"-aic-binary-dir={tmp_path / 'b'}"]
    )
    assert a.qpc == b.qpc
    c = compile_model(model, ["-aic-num-cores=2", f"-aic-binary-dir={tmp_path / 'c'}"])
    assert c.qpc != a.qpc


def test_fp16_mode_stays_within_its_documented_tolerance_of_onnxruntime() -> None:
    model = transformer_encoder()
    x = np.random.default_rng(3).standard_normal((2, 16, 64)).astype(np.float32)
    result = compile_model(model, ["-convert-to-fp16", "-aic-num-cores=2"])
    ours = run_qpc(result.qpc_path, {"x": x})["y"]
    assert ours.dtype == np.float32
    assert "float16" in {d for k in result.program.kernels for d in k.info.out_dtypes}
    np.testing.assert_allclose(ours, _reference(model, {"x": x}), rtol=1e-2, atol=1e-2)


def test_run_qpc_names_missing_and_misshapen_inputs() -> None:
    result = compile_model(_cnn())
    with pytest.raises(CompileError, match="missing"):
        run_qpc(result.qpc_path, {})
    with pytest.raises(CompileError, match="shape"):
        run_qpc(result.qpc_path, {"x": np.zeros((1, 3, 8, 8), np.float32)})


def test_hint_options_that_cannot_act_say_why_in_the_warnings() -> None:
    # depth-first splits the batch into image groups: at batch 1 there is nothing to split
    result = compile_model(_cnn(), ["-aic-enable-depth-first"])
    (note,) = [w for w in result.warnings if w["code"] == "depth_first_not_applied"]
    assert "batch is 1" in note["message"]
    # multicasting the weights several cores read is what this compiler always does
    quiet = compile_model(_cnn(), ["-multicast-weights"])
    assert not any(w["code"] == "option_without_effect" for w in quiet.warnings)


@pytest.mark.parametrize("cores", [1, 4])
def test_an_epilogue_reading_the_base_ops_own_input_gets_its_own_tile(cores: int) -> None:
    rng = np.random.default_rng(5)
    weight = numpy_helper.from_array(
        (rng.standard_normal((8, 8, 3, 3)) * 0.2).astype(np.float32), "w"
    )
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], name="conv"),
            helper.make_node("Add", ["c", "x"], ["y"], name="residual"),
        ],
        "residual",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8, 16, 16])],
        [weight],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = rng.standard_normal((2, 8, 16, 16)).astype(np.float32)
    result = compile_model(model, [f"-aic-num-cores={cores}"])
    assert [k.op_types for k in result.program.kernels] == [("Conv", "Add")]
    assert result.program.kernels[0].nodes == ("conv", "residual")
    np.testing.assert_allclose(
        run_qpc(result.qpc_path, {"x": x})["y"], _reference(model, {"x": x}), rtol=1e-4, atol=1e-5
    )


def test_constants_folded_into_a_conv_keep_their_node_names() -> None:
    rng = np.random.default_rng(6)
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
            helper.make_node("Mul", ["c", "s"], ["m"], name="scale"),
            helper.make_node("Add", ["m", "b"], ["y"], name="shift"),
        ],
        "affine",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 6, 6])],
        [
            numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w"),
            numpy_helper.from_array(rng.standard_normal((4, 1, 1)).astype(np.float32), "s"),
            numpy_helper.from_array(rng.standard_normal((4, 1, 1)).astype(np.float32), "b"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    result = compile_model(model)
    assert [k.nodes for k in result.program.kernels] == [("conv", "scale", "shift")]
    x = rng.standard_normal((1, 3, 8, 8)).astype(np.float32)
    np.testing.assert_allclose(
        run_qpc(result.qpc_path, {"x": x})["y"], _reference(model, {"x": x}), rtol=1e-4, atol=1e-5
    )


def test_a_long_chain_waits_only_on_its_neighbours_and_stays_right() -> None:
    nodes, prev = [], "x"
    for i in range(200):
        nodes.append(helper.make_node("Transpose", [prev], [f"v{i}"], perm=[1, 0], name=f"t{i}"))
        prev = f"v{i}"
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 64])],
        [helper.make_tensor_value_info(prev, TensorProto.FLOAT, [8, 64])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    result = compile_model(model, ["-aic-num-cores=4"])
    program = result.program
    for stream in program.streams:
        waits_per_kernel: dict[int, int] = {}
        current = -1
        for instr in stream:
            if isinstance(instr, RunKernel):
                current = instr.kernel
            elif isinstance(instr, SemWait):
                waits_per_kernel[current] = waits_per_kernel.get(current, 0) + 1
        # each other core at most twice per kernel: its parts have arrived (read after
        # write), and it has finished with the buffer they overwrite (write after read);
        # never a wait for any earlier kernel
        assert max(waits_per_kernel.values(), default=0) <= 2 * 3
    x = np.random.default_rng(8).standard_normal((8, 64)).astype(np.float32)
    np.testing.assert_array_equal(
        run_qpc(result.qpc_path, {"x": x})[prev], _reference(model, {"x": x})
    )


def test_a_kernel_with_hundreds_of_fused_operands_encodes_and_runs() -> None:
    # 300 Adds of graph inputs fuse into one kernel with 301 operands: program.bin counts
    # operands in 32 bits (a byte overflowed at 256)
    count = 300
    nodes, prev = [], "x0"
    for i in range(1, count + 1):
        nodes.append(helper.make_node("Add", [prev, f"x{i}"], [f"s{i}"], name=f"add{i}"))
        prev = f"s{i}"
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x0"], ["r"], name="relu")] + nodes[1:],
        "long_fusion",
        [
            helper.make_tensor_value_info(f"x{i}", TensorProto.FLOAT, [4, 8])
            for i in range(count + 1)
        ],
        [helper.make_tensor_value_info(prev, TensorProto.FLOAT, [4, 8])],
    )
    graph.node[1].input[0] = "r"
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    rng = np.random.default_rng(9)
    feeds = {f"x{i}": rng.standard_normal((4, 8)).astype(np.float32) for i in range(count + 1)}
    result = compile_model(model, ["-aic-num-cores=2"])
    assert max(len(k.inputs) for k in result.program.kernels) > 255
    np.testing.assert_allclose(
        run_qpc(result.qpc_path, feeds)[prev], _reference(model, feeds), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("cores", [1, 4, 14])
def test_a_grouped_conv_is_cut_by_output_channels_inside_its_groups(cores: int) -> None:
    rng = np.random.default_rng(11)
    weight = numpy_helper.from_array(
        (rng.standard_normal((18, 4, 3)) * 0.2).astype(np.float32), "w"
    )
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], group=3, pads=[1, 1], name="grouped")],
        "grouped",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 12, 9])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 18, 9])],
        [weight],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = rng.standard_normal((1, 12, 9)).astype(np.float32)
    result = compile_model(model, [f"-aic-num-cores={cores}"])
    channels = {i.out_box[1] for s in result.program.streams for i in s if isinstance(i, RunKernel)}
    if cores == 14:  # 9 positions cannot keep 14 cores busy: the channels are cut too
        assert len(channels) > 1
    np.testing.assert_allclose(
        run_qpc(result.qpc_path, {"x": x})["y"], _reference(model, {"x": x}), rtol=1e-5, atol=1e-5
    )


def test_a_wide_grouped_conv_whose_whole_channels_overflow_vtcm_compiles() -> None:
    # 768 channels, kernel 128, 16 groups: 19 MB per tile in fp32 when channels could not be cut
    rng = np.random.default_rng(12)
    weight = numpy_helper.from_array(
        (rng.standard_normal((768, 48, 128)) * 0.01).astype(np.float32), "w"
    )
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], group=16, pads=[64, 63], name="wide")],
        "wide_grouped",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 768, 200])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 768, 200])],
        [weight],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    result = compile_model(model, ["-aic-num-cores=14"])
    assert max(result.program.vtcm_used) <= VTCM


def _repeated_blocks(blocks: int = 3, channels: int = 64, size: int = 28) -> onnx.ModelProto:
    """`blocks` alike conv + relu layers (each with its own weights and bias), then a pool."""
    rng = np.random.default_rng(3)
    nodes, inits, x = [], [], "x"
    for b in range(blocks):
        w = (rng.standard_normal((channels, channels, 3, 3)) * 0.05).astype(np.float32)
        bias = rng.standard_normal(channels).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"w{b}"), numpy_helper.from_array(bias, f"b{b}")]
        nodes.append(helper.make_node("Conv", [x, f"w{b}", f"b{b}"], [f"c{b}"], pads=[1] * 4))
        nodes.append(helper.make_node("Relu", [f"c{b}"], [f"r{b}"]))
        x = f"r{b}"
    nodes.append(helper.make_node("GlobalAveragePool", [x], ["y"]))
    graph = helper.make_graph(
        nodes,
        "blocks",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, channels, size, size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, channels, 1, 1])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("cores", [4, 14])
def test_alike_kernels_share_their_split_search_and_the_program_is_unchanged(
    cores: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The split chooser prices each kernel signature once (compile time); a kernel alike but
    for its name, weights and bias must get exactly the program it would get on its own."""
    from compiler_core.lowering import splits

    model = _repeated_blocks()
    flags = [f"-aic-num-cores={cores}"]
    searched: dict[int, int] = {}  # chooser -> kernels it searched cuts for
    cuts_of = splits.SplitChooser._cuts_of

    def counting(self: splits.SplitChooser, ks: splits.KernelSplit) -> object:
        searched[id(self)] = searched.get(id(self), 0) + 1
        return cuts_of(self, ks)

    monkeypatch.setattr(splits.SplitChooser, "_cuts_of", counting)
    shared = encode_program(compile_model(model, flags).program)
    # 4 kernels (3 convs with their relus, the pool); conv 0 reads the graph input from DDR,
    # convs 1 and 2 are alike: 3 searches per chooser
    assert set(searched.values()) == {3}
    searched.clear()
    monkeypatch.setattr(splits, "_signature", lambda ks: ("unshared", id(ks)))
    alone = encode_program(compile_model(model, flags).program)
    assert set(searched.values()) == {4} and alone == shared
    x = np.random.default_rng(1).standard_normal((1, 64, 28, 28)).astype(np.float32)
    result = compile_model(model, flags)
    np.testing.assert_allclose(
        run_qpc(result.qpc_path, {"x": x})["y"], _reference(model, {"x": x}), rtol=1e-4, atol=1e-5
    )


def test_a_buffers_only_schedule_has_every_buffer_of_the_full_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Placement decides what fits from buffers-only builds (no ops): they must plan exactly
    the buffers of the schedule later written with ops."""
    from compiler_core.lowering import emit, placement

    compared: list[int] = []

    def checked(graph, place, buffers_only=False, memo=None):  # type: ignore[no-untyped-def]
        built = emit.build_schedule(graph, place, buffers_only, memo)
        if buffers_only:
            full = emit.build_schedule(graph, place)
            assert built.buffers == full.buffers and built.chip_bytes == full.chip_bytes
            assert not built.ops and full.ops
            compared.append(len(full.buffers))
        return built

    monkeypatch.setattr(placement, "build_schedule", checked)
    for flags in (["-aic-num-cores=4"], ["-aic-num-cores=14", "-batchsize=2"]):
        compile_model(_cnn(batch=2), flags)
    compile_model(transformer_encoder(), ["-aic-num-cores=4"])
    assert len(compared) >= 3 and min(compared) > 0
