"""Code generation (issue 10): the schedules the compiler emits, held to ONNX Runtime, to the
functional runtime and to the limits of the modelled chip.

- Every schedule (resident weights, on-chip activations, multicast and double buffering, each
  switched off in turn, and all on) computes what ONNX Runtime computes on 1, 4 and 14 cores,
  in fp32 and fp16, and has no race: `races` follows the semaphores between the cores' streams
  and finds any two accesses to the same bytes, one a write, that no semaphore orders. The
  runtime runs the cores one after another, so a missing wait shows there only when that
  order happens to expose it. The light CNNs' own outputs are constants whatever the
  schedule does, so they are checked at probes (tests/codegen_models.py).
- The semaphore waits and the multicast core masks carry weight: without one, the answer goes
  wrong or the runtime refuses the program.
- Resident weights load once, when the program is activated, and inferences cannot write them.
- The bytes the runtime's DMAs move are the compile-time traffic metrics and the -ddr-stats.
- No estimate beats a physical floor, more cores are faster, and a weight that several cores
  read is read from DDR once.

A representative part of the matrix runs by default; the rest is marked slow (`-m slow`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from compiler_core import QpcSession, compile_model, load_qpc, run_qpc
from compiler_core.build import CompileResult
from compiler_core.devices import get_device
from compiler_core.lowering.placement import CodegenPolicy
from compiler_core.lowering.program import (
    KIND_CONSTANT,
    KIND_ONCHIP,
    DmaLoad,
    DmaStore,
    Instr,
    NocCopy,
    Operand,
    Piece,
    Program,
    RunKernel,
    SemPost,
    SemWait,
    box_nbytes,
    cores_in,
    stored_bytes,
)
from compiler_core.ops.registry import Box
from compiler_core.profiling.opstats import load_layout
from compiler_core.profiling.stats_layout import decode_stats
from compiler_core.runtime.executor import Executor, RuntimeFault, Traffic
from tests.codegen_models import bench_models, conv_net, mlp, probed_light_model
from tests.decoder_model import Generation, empty_cache, greedy_decode, kv_decoder, ort_runner
from tests.models import LIGHT_MODELS, light_model_input, light_model_path, transformer_encoder

VTCM = 8_323_072
"""The VTCM the runtime gives each core (the device's usable VTCM)."""

TOLERANCE = {"fp32": (1e-4, 1e-5), "fp16": (1e-2, 1e-2)}
"""rtol, atol against ONNX Runtime fp32 (docs/compiler.md, "Precision")."""

POLICIES = {
    "all-on": CodegenPolicy(),
    "no-residency": CodegenPolicy(residency=False),
    "no-on-chip": CodegenPolicy(on_chip=False),
    "no-multicast": CodegenPolicy(multicast=False),
    "no-double-buffer": CodegenPolicy(double_buffer=False),
}
CORES = (1, 4, 14)
FP16_LIGHT_MODELS = ("light_densenet121", "light_inception_v2", "light_shufflenet")
"""The light CNNs whose activations stay inside the float16 range (tests/test_precision.py)."""


# ------------------------------------------------------------------------ happens-before check

_NOBODY = -1
"""No access yet."""
_BEFORE = -2
"""Written before the inference: inputs, and the resident constants (by activation)."""


def _itemsize(dtype: str) -> int:
    return 1 if dtype == "bool" else np.dtype(dtype).itemsize


def _bytes_of(base: int, shape: tuple[int, ...], box: Box, itemsize: int) -> slice | np.ndarray:
    """The byte positions of `box` of a C-order array of `shape` stored at `base`: a slice
    when they are contiguous, else an index array."""
    rank = len(shape)
    full_from = rank
    while full_from > 0 and box[full_from - 1] == (0, shape[full_from - 1]):
        full_from -= 1
    if all(hi - lo == 1 for lo, hi in box[: max(0, full_from - 1)]):
        start, stride, count = 0, 1, 1
        for (lo, hi), dim in zip(reversed(box), reversed(shape), strict=True):
            start += lo * stride
            stride *= dim
            count *= hi - lo
        return slice(base + start * itemsize, base + (start + count) * itemsize)
    elements = np.arange(int(np.prod(shape, dtype=np.int64)), dtype=np.int64).reshape(shape)
    chosen = elements[tuple(slice(lo, hi) for lo, hi in box)].reshape(-1, 1)
    return (base + chosen * itemsize + np.arange(itemsize)).ravel()


class _Memory:
    """Per byte: the core that last wrote it and when (in that core's own count of
    instructions), and when each reader last read it."""

    def __init__(self, size: int, readers: int) -> None:
        self.writer = np.full(size, _NOBODY, np.int8)
        self.written_at = np.zeros(size, np.int32)
        self.read_at = np.zeros((readers, size), np.int32)


def races(program: Program, limit: int = 10) -> list[str]:
    """Accesses of two cores to the same bytes, one a write, that no chain of semaphores
    orders; reads of bytes nothing wrote in this inference; a deadlock.

    Each core carries a vector clock: its own instruction count, and for every other core the
    latest of its instructions known to be complete (a SemPost publishes the poster's clock,
    a SemWait takes it in). Within a core, program order holds. A core's VTCM is read only
    by the core itself (kernels, stores, the source of its NoC copies); DDR by any core.
    Constants in DDR are read-only and not tracked.
    """
    cores = program.num_cores
    base = program.constants_size
    ddr = _Memory(program.ddr_size - base, cores)
    vtcm = [
        _Memory(max(max(program.vtcm_used, default=0), program.resident), 1) for _ in range(cores)
    ]
    for memory in vtcm:
        memory.writer[: program.resident] = _BEFORE
    for tid in program.inputs:
        t = program.tensors[tid]
        ddr.writer[t.ddr_offset - base : t.ddr_offset - base + t.nbytes] = _BEFORE
    found: list[str] = []

    def unordered(memory: _Memory, where: slice | np.ndarray, core: int, clock: np.ndarray):
        writer = memory.writer[where]
        remote = (writer >= 0) & (writer != core)
        if not remote.any():
            return []
        who = writer[remote].astype(np.int64)
        late = memory.written_at[where][remote] > clock[who]
        return sorted(set(who[late].tolist()))

    def read(memory: _Memory, where: slice | np.ndarray, row: int, core: int, clock, what: str):
        if (memory.writer[where] == _NOBODY).any():
            found.append(f"{what} reads bytes nothing wrote")
        if late := unordered(memory, where, core, clock):
            found.append(f"{what} reads what core(s) {late} wrote, unordered")
        memory.read_at[row][where] = clock[core]

    def write(
        memory: _Memory, where: slice | np.ndarray, owner: int | None, core: int, clock, what: str
    ):
        if late := unordered(memory, where, core, clock):
            found.append(f"{what} overwrites what core(s) {late} wrote, unordered")
        readers = [(0, owner)] if owner is not None else list(enumerate(range(cores)))
        for row, reader in readers:
            if reader != core and (memory.read_at[row][where] > clock[reader]).any():
                found.append(f"{what} overwrites what core {reader} reads, unordered")
        memory.writer[where] = core
        memory.written_at[where] = clock[core]

    def in_ddr(tid: int, box: Box) -> slice | np.ndarray | None:
        t = program.tensors[tid]
        if t.nbytes == 0 or t.ddr_offset + t.nbytes <= base:
            return None  # a constant, or nothing at all
        return _bytes_of(t.ddr_offset - base, t.shape, box, _itemsize(t.dtype))

    def in_vtcm(offset: int, held: Box, box: Box, tid: int) -> slice | np.ndarray:
        inside = tuple((lo - at, hi - at) for (lo, hi), (at, _) in zip(box, held, strict=True))
        shape = tuple(hi - lo for lo, hi in held)
        return _bytes_of(offset, shape, inside, _itemsize(program.tensors[tid].dtype))

    def execute(core: int, index: int, instr: Instr, clock: np.ndarray) -> None:
        what = f"core {core} instruction {index} ({type(instr).__name__})"
        if isinstance(instr, DmaLoad | NocCopy):
            if isinstance(instr, DmaLoad):
                source = in_ddr(instr.tensor, instr.box)
                if source is not None:
                    read(ddr, source, core, core, clock, what)
            else:
                source = in_vtcm(instr.src_vtcm, instr.src_box, instr.box, instr.tensor)
                read(vtcm[core], source, 0, core, clock, what)
            for target in cores_in(instr.cores):
                where = in_vtcm(instr.vtcm, instr.buf_box, instr.box, instr.tensor)
                write(vtcm[target], where, target, core, clock, f"{what} into core {target}")
        elif isinstance(instr, DmaStore):
            source = in_vtcm(instr.vtcm, instr.buf_box, instr.box, instr.tensor)
            read(vtcm[core], source, 0, core, clock, what)
            stored = in_ddr(instr.tensor, instr.box)
            if stored is not None:
                write(ddr, stored, None, core, clock, what)
        elif isinstance(instr, RunKernel):
            kernel = program.kernels[instr.kernel]
            what += f" of {kernel.name}"
            for tid, operand in zip(kernel.inputs, instr.inputs, strict=True):
                if operand is None or tid < 0:
                    continue
                for piece in operand.pieces:
                    part = tuple(
                        (max(lo, plo), min(hi, phi))
                        for (lo, hi), (plo, phi) in zip(operand.box, piece.box, strict=True)
                    )
                    read(
                        vtcm[core], in_vtcm(piece.vtcm, piece.box, part, tid), 0, core, clock, what
                    )
            for tid, operand in zip(kernel.outputs, instr.outputs, strict=True):
                if operand is not None and tid >= 0:
                    piece = operand.pieces[0]
                    where = in_vtcm(piece.vtcm, piece.box, operand.box, tid)
                    write(vtcm[core], where, core, core, clock, what)

    posts: dict[int, list[np.ndarray]] = {}
    clocks = [np.zeros(cores, np.int64) for _ in range(cores)]
    pcs = [0] * cores
    while len(found) < limit:
        progressed = False
        for core, stream in enumerate(program.streams):
            clock = clocks[core]
            while pcs[core] < len(stream) and len(found) < limit:
                instr = stream[pcs[core]]
                if isinstance(instr, SemWait):
                    posted = posts.get(instr.sem, [])
                    if len(posted) < instr.count:
                        break
                    for seen in posted[: instr.count]:
                        np.maximum(clock, seen, out=clock)
                elif isinstance(instr, SemPost):
                    posts.setdefault(instr.sem, []).append(clock.copy())
                else:
                    clock[core] += 1
                    execute(core, pcs[core], instr, clock)
                pcs[core] += 1
                progressed = True
        if all(pc == len(s) for pc, s in zip(pcs, program.streams, strict=True)):
            break
        if not progressed:
            found.append("deadlock")
            break
    return found


# --------------------------------------------------------------------------- helpers


def _flags(cores: int, precision: str = "fp32", *extra: str) -> list[str]:
    return [
        f"-aic-num-cores={cores}",
        *(["-convert-to-fp16"] if precision == "fp16" else []),
        *extra,
    ]


def _assert_race_free(result: CompileResult) -> None:
    for name, program in result.programs.items():
        found = races(program)
        assert not found, f"{name}: " + "; ".join(found)


def _ort_run(model: bytes, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(model, options)
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds), strict=True))


def _assert_close(got: dict[str, np.ndarray], want: dict[str, np.ndarray], precision: str) -> None:
    rtol, atol = TOLERANCE[precision]
    assert set(got) == set(want)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=rtol, atol=atol, err_msg=name)


@dataclass
class Loaded:
    """A compiled program as the runtime sees it, with the inputs it is run on."""

    program: Program
    constants: memoryview
    feeds: dict[str, np.ndarray]
    want: np.ndarray
    """The (first) output ONNX Runtime computes."""

    def run(self, program: Program) -> np.ndarray | RuntimeFault:
        """The first output of one inference of `program` (the compiled one or a tampered
        copy), or the fault the runtime raised."""
        executor = Executor(program, self.constants, VTCM)
        try:
            outputs = executor.run(self.feeds)
        except RuntimeFault as fault:
            return fault
        return outputs[self.program.tensors[self.program.outputs[0]].name]

    def broken(self, program: Program) -> bool:
        """The runtime refuses `program` or its answer is not ONNX Runtime's."""
        got = self.run(program)
        return isinstance(got, RuntimeFault) or not np.allclose(
            got, self.want, rtol=TOLERANCE["fp32"][0], atol=TOLERANCE["fp32"][1]
        )


@contextmanager
def _loaded(
    model: onnx.ModelProto,
    flags: list[str],
    feeds: dict[str, np.ndarray],
    policy: CodegenPolicy | None = None,
) -> Iterator[Loaded]:
    """Compile, load, and check that the untouched program gives ONNX Runtime's answer."""
    result = compile_model(model, flags, policy=policy)
    want = next(iter(_ort_run(model.SerializeToString(), feeds).values()))
    try:
        with load_qpc(result.qpc_path) as qpc:
            loaded = Loaded(qpc.program(), qpc.segments["constants.bin"], feeds, want)
            assert not loaded.broken(loaded.program), "the untouched program is already wrong"
            yield loaded
    finally:
        result.cleanup()


def _transformer_input() -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(1).standard_normal((2, 16, 64)).astype(np.float32)}


def _mlp_input(
    rows: int = 256, width: int = 256, batch: int | None = None
) -> dict[str, np.ndarray]:
    shape = (rows, width) if batch is None else (batch, rows, width)
    return {"x": np.random.default_rng(2).standard_normal(shape).astype(np.float32)}


def _conv_input(batch: int = 2) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(3).standard_normal((batch, 3, 32, 32)).astype(np.float32)}


def _replace(program: Program, core: int, index: int, instr: Instr | None) -> Program:
    """The program with one instruction replaced (None: removed)."""
    streams = [list(s) for s in program.streams]
    if instr is None:
        del streams[core][index]
    else:
        streams[core][index] = instr
    return dataclasses.replace(program, streams=streams)


def _positions(program: Program, want: Callable[[Instr], bool]) -> list[tuple[int, int]]:
    return [
        (c, i) for c, s in enumerate(program.streams) for i, instr in enumerate(s) if want(instr)
    ]


def _is_multicast(instr: Instr) -> bool:
    return isinstance(instr, DmaLoad | NocCopy) and len(cores_in(instr.cores)) > 1


@pytest.fixture(scope="module")
def transformer_4() -> Iterator[Loaded]:
    """The test transformer on 4 cores, everything on: activations stay on chip and move
    between cores by NoC copies, several of them multicast."""
    with _loaded(transformer_encoder(), _flags(4), _transformer_input()) as loaded:
        yield loaded


@pytest.fixture(scope="module")
def mlp_4_streamed() -> Iterator[Loaded]:
    """The MLP on 4 cores with weights streamed every inference: cut by rows, every core needs
    all of each weight, and one multicast DMA brings it to them."""
    with _loaded(mlp(), _flags(4), _mlp_input(), CodegenPolicy(residency=False)) as loaded:
        yield loaded


# ------------------------------------------------------------------ 1. correctness (item 9)


@dataclass(frozen=True)
class Case:
    model: str
    """A light CNN, "transformer" or "decoder"."""
    cores: int
    precision: str
    policy: str

    @property
    def id(self) -> str:
        return f"{self.model}-{self.cores}c-{self.precision}-{self.policy}"


DEFAULT_CASES = {
    Case("transformer", 1, "fp32", "all-on"),
    Case("transformer", 4, "fp32", "all-on"),
    Case("transformer", 14, "fp32", "all-on"),
    Case("transformer", 1, "fp16", "all-on"),
    Case("transformer", 4, "fp16", "all-on"),
    Case("transformer", 14, "fp16", "all-on"),
    Case("transformer", 4, "fp32", "no-residency"),
    Case("transformer", 4, "fp32", "no-on-chip"),
    Case("transformer", 4, "fp32", "no-multicast"),
    Case("transformer", 4, "fp32", "no-double-buffer"),
    Case("decoder", 4, "fp16", "all-on"),
    Case("decoder", 14, "fp32", "all-on"),
    Case("decoder", 4, "fp32", "no-multicast"),
    Case("light_squeezenet", 4, "fp32", "all-on"),
    Case("light_squeezenet", 4, "fp32", "no-double-buffer"),
    Case("light_shufflenet", 14, "fp16", "all-on"),
    Case("light_shufflenet", 1, "fp32", "all-on"),  # its first kernel streams a weight
    Case("light_inception_v1", 1, "fp32", "no-multicast"),
}
"""The part of the matrix every run checks: every model kind, core count, precision and
policy at least once."""


def _matrix() -> list[Any]:
    params = []
    for model in (*LIGHT_MODELS, "transformer", "decoder"):
        light = model.startswith("light_")
        precisions = ("fp32", "fp16") if not light or model in FP16_LIGHT_MODELS else ("fp32",)
        for precision in precisions:
            for cores in CORES:
                for policy in POLICIES:
                    case = Case(model, cores, precision, policy)
                    marks = [] if case in DEFAULT_CASES else [pytest.mark.slow]
                    params.append(pytest.param(case, marks=marks, id=case.id))
    return params


@dataclass(frozen=True)
class Reference:
    feeds: dict[str, np.ndarray]
    outputs: dict[str, np.ndarray]
    """ONNX Runtime's outputs for `feeds`, by name."""


@cache
def _light_reference(name: str, fp16: bool) -> Reference:
    model = probed_light_model(name, fp16=fp16)
    graph = onnx.load_from_string(model).graph
    weights = {i.name for i in graph.initializer}
    feeds = {
        i.name: light_model_input(tuple(d.dim_value for d in i.type.tensor_type.shape.dim))
        for i in graph.input
        if i.name not in weights
    }
    return Reference(feeds, _ort_run(model, feeds))


PROMPT = np.array([[3, 17, 5, 40, 22, 9, 11, 30]], np.int64)
NEW_TOKENS = 6
PREFILL_DECODE = {
    "specializations": [
        {"name": "prefill", "symbols": {"batch_size": "1", "seq_len": str(PROMPT.shape[1])}},
        {"name": "decode", "symbols": {"batch_size": "1", "seq_len": "1"}},
    ]
}


@cache
def _decoder() -> bytes:
    return kv_decoder().SerializeToString()


@cache
def _decoder_reference() -> Generation:
    model = onnx.load_from_string(_decoder())
    return greedy_decode(
        ort_runner(model), PROMPT, NEW_TOKENS, feed_back=True, cache=empty_cache(model)
    )


def _check_light(case: Case) -> None:
    fp16 = case.precision == "fp16"
    model = probed_light_model(case.model, fp16=fp16)
    result = compile_model(model, _flags(case.cores, case.precision), policy=POLICIES[case.policy])
    try:
        _assert_race_free(result)
        want = _light_reference(case.model, fp16)
        _assert_close(run_qpc(result.qpc_path, want.feeds), want.outputs, case.precision)
    finally:
        result.cleanup()


def _check_transformer(case: Case) -> None:
    model = transformer_encoder()
    feeds = _transformer_input()
    result = compile_model(model, _flags(case.cores, case.precision), policy=POLICIES[case.policy])
    try:
        _assert_race_free(result)
        want = _ort_run(model.SerializeToString(), feeds)
        _assert_close(run_qpc(result.qpc_path, feeds), want, case.precision)
    finally:
        result.cleanup()


def _check_decoder(case: Case, tmp_path: Path) -> None:
    config = tmp_path / "specializations.json"
    config.write_text(json.dumps(PREFILL_DECODE))
    flags = _flags(
        case.cores, case.precision, f"-network-specialization-config={config}", "-retained-state"
    )
    result = compile_model(_decoder(), flags, policy=POLICIES[case.policy])
    try:
        assert set(result.programs) == {"prefill", "decode"}
        _assert_race_free(result)
        with QpcSession(result.qpc_path) as session:
            got = greedy_decode(session.run, PROMPT, NEW_TOKENS, feed_back=False)
    finally:
        result.cleanup()
    want = _decoder_reference()
    assert got.tokens == want.tokens
    rtol, atol = TOLERANCE[case.precision]
    np.testing.assert_allclose(got.logits, want.logits, rtol=rtol, atol=atol)


@pytest.mark.parametrize("case", _matrix())
def test_every_schedule_is_race_free_and_computes_what_onnxruntime_computes(
    case: Case, tmp_path: Path
) -> None:
    if case.model == "transformer":
        _check_transformer(case)
    elif case.model == "decoder":
        _check_decoder(case, tmp_path)
    else:
        _check_light(case)


def _without_load_of(program: Program, tensor: int) -> Program:
    """The program without the first DMA that loads `tensor` (at activation or per inference)."""
    for core, stream in enumerate(program.setup):
        for index, instr in enumerate(stream):
            if isinstance(instr, DmaLoad) and instr.tensor == tensor:
                setup = [list(s) for s in program.setup]
                del setup[core][index]
                return dataclasses.replace(program, setup=setup)
    core, index = _positions(program, lambda i: isinstance(i, DmaLoad) and i.tensor == tensor)[0]
    return _replace(program, core, index, None)


def test_only_the_light_cnn_probes_notice_a_weight_nobody_loaded() -> None:
    """Why the light CNNs carry probes: their own outputs are constants that hide a broken
    schedule. Without the load of its first convolution's weights, the program still gives
    ONNX Runtime's outputs; the probes do not."""
    name = "light_squeezenet"
    want = _light_reference(name, False)
    final = onnx.load(light_model_path(name)).graph.output[0].name
    plain = Path(light_model_path(name)).read_bytes()
    for model, probes in ((plain, 0), (probed_light_model(name), 3)):
        result = compile_model(model, _flags(1))
        try:
            with load_qpc(result.qpc_path) as qpc:
                program = qpc.program()
                weight = program.kernels[0].inputs[1]
                assert program.tensors[weight].kind == KIND_CONSTANT
                tampered = _without_load_of(program, weight)
                got = Executor(tampered, qpc.segments["constants.bin"], VTCM).run(want.feeds)
        finally:
            result.cleanup()
        np.testing.assert_allclose(got[final], want.outputs[final], rtol=1e-4, atol=1e-5)
        assert len(got) == 1 + probes
        if probes:  # the first probe is the first convolution's activation
            first = next(name for name in got if name != final)
            assert not np.allclose(got[first], want.outputs[first], rtol=1e-4, atol=1e-5)


def test_the_first_kernels_streamed_weights_are_loaded_before_it_runs() -> None:
    """The smallest program the first known bug breaks: one MatMul whose weight streams."""
    weight = np.arange(12, dtype=np.float32).reshape(4, 3)
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        "one_matmul",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 4])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 3])],
        [onnx.numpy_helper.from_array(weight, "w")],
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    feeds = {"x": np.ones((2, 4), np.float32)}
    result = compile_model(model, _flags(1), policy=CodegenPolicy(residency=False))
    try:
        stream = result.program.streams[0]
        kinds = [type(i).__name__ for i in stream]
        loads = [i for i, instr in enumerate(stream) if isinstance(instr, DmaLoad)]
        assert kinds.index("RunKernel") > max(loads), kinds  # both loads come first
        got = run_qpc(result.qpc_path, feeds)
    finally:
        result.cleanup()
    np.testing.assert_allclose(got["y"], feeds["x"] @ weight)


def test_a_load_from_reused_ddr_waits_for_every_cores_store_into_it() -> None:
    """A small program the second known bug breaks on the runtime itself: on 3 cores, with
    activations in DDR and no multicast, cores 1 and 2 load all of `kt` (DDR that `q0` used
    before) without waiting for core 0's store of its rows, and the runtime's core order
    exposes it (on 2, 4 and 14 cores only the race check sees it)."""
    model = transformer_encoder()
    feeds = _transformer_input()
    result = compile_model(model, _flags(3), policy=CodegenPolicy(on_chip=False, multicast=False))
    try:
        assert races(result.program) == []
        got = run_qpc(result.qpc_path, feeds)
    finally:
        result.cleanup()
    _assert_close(got, _ort_run(model.SerializeToString(), feeds), "fp32")


# ------------------------------------------------------------------- 2. tampering (item 9)


def _without_waits(program: Program) -> Program:
    return dataclasses.replace(
        program, streams=[[i for i in s if not isinstance(i, SemWait)] for s in program.streams]
    )


def test_removing_a_semaphore_wait_breaks_a_program_with_on_chip_activations(
    transformer_4: Loaded,
) -> None:
    loaded = transformer_4
    program = loaded.program
    assert any(t.kind == KIND_ONCHIP for t in program.tensors)
    assert _positions(program, lambda i: isinstance(i, NocCopy))
    waits = _positions(program, lambda i: isinstance(i, SemWait))
    broken = [w for w in waits if loaded.broken(_replace(program, *w, None))]
    # The runtime runs the cores in order, so only some missing waits show in the answer...
    assert broken, f"none of the {len(waits)} waits is needed for the right answer"
    assert loaded.broken(_without_waits(program))
    # ...and the race check finds each of those (it does not depend on the order).
    for core, index in broken:
        assert races(_replace(program, core, index, None), limit=1), (core, index)
    assert races(_without_waits(program), limit=1)


def _without(program: Program, core: int, indices: list[int]) -> Program:
    streams = [list(s) for s in program.streams]
    streams[core] = [instr for i, instr in enumerate(streams[core]) if i not in indices]
    return dataclasses.replace(program, streams=streams)


@pytest.mark.parametrize(
    ("program_name", "kind"), [("transformer_4", NocCopy), ("mlp_4_streamed", DmaLoad)]
)
def test_removing_the_waits_before_a_multicast_breaks_the_answer(
    program_name: str, kind: type, request: pytest.FixtureRequest
) -> None:
    """A multicast writes into other cores' VTCM, so it waits until they are done with what
    it overwrites (and until its data is ready). Without those waits the answer goes wrong;
    without any one of them the race check finds the unordered write (the runtime's core
    order hides some)."""
    loaded: Loaded = request.getfixturevalue(program_name)
    program = loaded.program
    guarded: list[tuple[int, list[int]]] = []
    for core, stream in enumerate(program.streams):
        for index, instr in enumerate(stream):
            if isinstance(instr, kind) and _is_multicast(instr):
                waits: list[int] = []
                while index - len(waits) - 1 >= 0 and isinstance(
                    stream[index - len(waits) - 1], SemWait
                ):
                    waits.append(index - len(waits) - 1)
                if waits:
                    guarded.append((core, waits))
    assert guarded, f"no multicast {kind.__name__} waits for anything"
    assert any(loaded.broken(_without(program, core, waits)) for core, waits in guarded)
    for core, waits in guarded:
        for wait in waits:
            assert races(_without(program, core, [wait]), limit=1), (core, wait)


def _drop_one_target(instr: DmaLoad | NocCopy, issuer: int) -> DmaLoad | NocCopy:
    """The transfer without its highest target core other than the issuer."""
    dropped = max(c for c in cores_in(instr.cores) if c != issuer)
    return dataclasses.replace(instr, cores=instr.cores & ~(1 << dropped))


def test_dropping_a_core_from_a_multicast_noc_copy_breaks_the_answer(
    transformer_4: Loaded,
) -> None:
    loaded = transformer_4
    program = loaded.program
    copies = _positions(program, lambda i: isinstance(i, NocCopy) and _is_multicast(i))
    assert copies
    for core, index in copies:
        instr = program.streams[core][index]
        assert isinstance(instr, NocCopy)
        assert loaded.broken(_replace(program, core, index, _drop_one_target(instr, core)))


def test_dropping_a_core_from_a_multicast_weight_load_breaks_the_answer(
    mlp_4_streamed: Loaded,
) -> None:
    loaded = mlp_4_streamed
    program = loaded.program
    loads = _positions(program, lambda i: isinstance(i, DmaLoad) and _is_multicast(i))
    assert loads
    for core, index in loads:
        instr = program.streams[core][index]
        assert isinstance(instr, DmaLoad)
        assert program.tensors[instr.tensor].kind == KIND_CONSTANT
        assert loaded.broken(_replace(program, core, index, _drop_one_target(instr, core)))


def test_dropping_a_core_from_a_resident_weight_multicast_breaks_the_answer() -> None:
    with _loaded(mlp(), _flags(4), _mlp_input()) as loaded:
        program = loaded.program
        loads = [
            (core, index)
            for core, stream in enumerate(program.setup)
            for index, instr in enumerate(stream)
            if _is_multicast(instr)
        ]
        assert loads
        for core, index in loads:
            instr = program.setup[core][index]
            assert isinstance(instr, DmaLoad)
            setup = [list(s) for s in program.setup]
            setup[core][index] = _drop_one_target(instr, core)
            assert loaded.broken(dataclasses.replace(program, setup=setup))


# ----------------------------------------------------------------- 3. resident weights (item 2)


@cache
def _decoder_config(directory: str) -> str:
    path = Path(directory) / "specializations.json"
    path.write_text(json.dumps(PREFILL_DECODE))
    return str(path)


RESIDENT_CASES: dict[str, Callable[[str], tuple[onnx.ModelProto | bytes, list[str]]]] = {
    "transformer-14c-fp16": lambda _: (transformer_encoder(), _flags(14, "fp16")),
    "conv-net-4c": lambda _: (conv_net(), _flags(4)),
    "conv-net-depth-first-4c": lambda _: (
        conv_net(batch=4),
        _flags(4, "fp32", "-aic-enable-depth-first", "-aic-depth-first-mem=8"),
    ),
    "decoder-4c": lambda d: (
        _decoder(),
        _flags(
            4, "fp32", f"-network-specialization-config={_decoder_config(d)}", "-retained-state"
        ),
    ),
}


@pytest.mark.parametrize("name", sorted(RESIDENT_CASES))
def test_resident_weights_load_at_activation_and_no_inference_streams_them(
    name: str, tmp_path: Path
) -> None:
    model, flags = RESIDENT_CASES[name](str(tmp_path))
    result = compile_model(model, flags)
    try:
        assert result.metrics["resident_constants_bytes_per_core"] == result.program.resident
        for program in result.programs.values():
            assert program.resident > 0 and any(program.setup)
            resident: set[int] = set()
            for stream in program.setup:
                for load in stream:
                    assert isinstance(load, DmaLoad)
                    t = program.tensors[load.tensor]
                    assert t.kind == KIND_CONSTANT
                    assert load.vtcm + box_nbytes(load.buf_box, t.dtype) <= program.resident
                    resident.add(load.tensor)
            streamed = {
                i.tensor
                for s in program.streams
                for i in s
                if isinstance(i, DmaLoad) and program.tensors[i.tensor].kind == KIND_CONSTANT
            }
            assert not resident & streamed, [program.tensors[t].name for t in resident & streamed]
            for stream in program.streams:  # kernels read resident weights where they were put
                for instr in stream:
                    if not isinstance(instr, RunKernel):
                        continue
                    kernel = program.kernels[instr.kernel]
                    for tid, operand in zip(kernel.inputs, instr.inputs, strict=True):
                        if tid in resident and operand is not None:
                            assert all(p.vtcm < program.resident for p in operand.pieces)
    finally:
        result.cleanup()


def _first(program: Program, kind: type) -> tuple[int, int, Any]:
    core, index = _positions(program, lambda i: isinstance(i, kind))[0]
    return core, index, program.streams[core][index]


def test_inferences_cannot_write_the_resident_weights(transformer_4: Loaded) -> None:
    loaded = transformer_4
    program = loaded.program
    assert program.resident > 0
    core, index, load = _first(program, DmaLoad)
    into_load = _replace(program, core, index, dataclasses.replace(load, vtcm=0))
    core, index, copy = _first(program, NocCopy)
    into_copy = _replace(program, core, index, dataclasses.replace(copy, vtcm=0))
    core, index, run = _first(program, RunKernel)
    out = run.outputs[0]
    moved = Operand(out.box, (Piece(0, out.pieces[0].box),))
    into_output = _replace(program, core, index, dataclasses.replace(run, outputs=(moved,)))
    for tampered in (into_load, into_copy, into_output):
        fault = loaded.run(tampered)
        assert isinstance(fault, RuntimeFault)
        assert "inside the resident constants" in fault.message


def _rows(traffic: list[Traffic]) -> list[list[int]]:
    return [t.as_row() for t in traffic]


def test_a_session_loads_resident_weights_once_and_answers_alike_every_time(
    tmp_path: Path,
) -> None:
    model = transformer_encoder()
    feeds = _transformer_input()
    result = compile_model(model, _flags(14, "fp16", "-ddr-stats", "-stats-level=40"))
    try:
        with QpcSession(result.qpc_path) as session:
            first = session.run(feeds)["y"]
            np.testing.assert_array_equal(session.run(feeds)["y"], first)
            session.run(feeds, profiling_out_dir=tmp_path, iterations=2)
        layout, _ = load_layout(result.qpc_path)
        per_inference = [
            decode_stats(layout, path.read_bytes())["ddr"].tolist()
            for path in sorted(tmp_path.glob("stats-inf-*.bin"))
        ]
        with load_qpc(result.qpc_path) as qpc:
            program = qpc.program()
            executor = Executor(program, qpc.segments["constants.bin"], VTCM)
            executor.run(feeds)
            activation, inference = _rows(executor.activation_traffic), _rows(executor.traffic)
            executor.run(feeds)
            assert _rows(executor.activation_traffic) == activation  # loaded once
            assert _rows(executor.traffic) == inference
        metrics = result.metrics
    finally:
        result.cleanup()
    setup_bytes = sum(
        stored_bytes(program.tensors[i.tensor], i.box)
        for s in program.setup
        for i in s
        if isinstance(i, DmaLoad)
    )
    assert sum(row[0] for row in activation) == setup_bytes > 0
    assert metrics["activation_ddr_read_bytes"] == setup_bytes
    # every weight is resident: an inference reads no constant, in the runtime and the stats
    assert [row[1] for row in inference] == [0] * program.num_cores
    assert metrics["memory_traffic"]["total"]["ddr_read_constant_only_bytes"] == 0
    assert per_inference == [inference, inference]


# ------------------------------------------------------------------------- 4. traffic (item 8)


TRAFFIC_CASES: dict[
    str,
    tuple[
        Callable[[], onnx.ModelProto], list[str], Callable[[], dict[str, np.ndarray]], CodegenPolicy
    ],
] = {
    "conv-net-4c": (conv_net, _flags(4), _conv_input, CodegenPolicy()),
    "conv-net-depth-first-14c": (
        lambda: conv_net(batch=4),
        _flags(14, "fp16", "-aic-enable-depth-first", "-aic-depth-first-mem=8"),
        lambda: _conv_input(4),
        CodegenPolicy(),
    ),
    "transformer-14c": (
        transformer_encoder,
        _flags(14, "fp16"),
        _transformer_input,
        CodegenPolicy(),
    ),
    "mlp-multicast-4c": (mlp, _flags(4, "fp16"), _mlp_input, CodegenPolicy(residency=False)),
}


@pytest.mark.parametrize("name", sorted(TRAFFIC_CASES))
def test_the_bytes_the_runtime_moves_are_the_compile_time_traffic_metrics(
    name: str, tmp_path: Path
) -> None:
    build, flags, inputs, policy = TRAFFIC_CASES[name]
    feeds = inputs()
    result = compile_model(build(), [*flags, "-ddr-stats", "-stats-level=40"], policy=policy)
    try:
        metrics = result.metrics
        compiled = [
            [
                row["ddr_read_bytes"],
                row["constant_only_bytes"],
                row["ddr_write_bytes"],
                row["multicast_bytes"],
                row["noc_bytes"],
            ]
            for row in metrics["memory_traffic"]["per_core"]
        ]
        with load_qpc(result.qpc_path) as qpc:
            executor = Executor(qpc.program(), qpc.segments["constants.bin"], VTCM)
            executor.run(feeds)
        run_qpc(result.qpc_path, feeds, profiling_out_dir=tmp_path)
        layout, _ = load_layout(result.qpc_path)
        section = layout.section("ddr")
        stats = decode_stats(layout, (tmp_path / "stats-inf-00000.bin").read_bytes())["ddr"]
    finally:
        result.cleanup()
    assert _rows(executor.traffic) == compiled
    assert (
        sum(t.ddr_read for t in executor.activation_traffic) == metrics["activation_ddr_read_bytes"]
    )
    assert section is not None and section.fields == (
        "read_bytes",
        "read_constant_bytes",
        "write_bytes",
        "multicast_bytes",
        "noc_bytes",
    )
    assert stats.tolist() == compiled
    read, constant, written, multicast, noc = np.sum(compiled, axis=0).tolist()
    assert read > 0 and written > 0
    if name == "mlp-multicast-4c":
        assert constant > 0 and multicast > 0
    if name == "transformer-14c":
        assert noc > 0 and multicast > 0


# ------------------------------------------------------------------- 5. floors (item 8)

DEVICE = "aic100-standard"


@dataclass(frozen=True)
class BenchModel:
    """A small version of a model of bench/codegen.py and the flags that bind its batch."""

    kind: str
    spec: Any
    flags: tuple[str, ...]

    def path(self, work: Path) -> Path:
        models, transformer_models = bench_models()
        if self.kind == "resnet":
            return models.write_resnet(self.spec, work)
        if self.kind == "encoder":
            return transformer_models.write_encoder(self.spec, work)
        return transformer_models.write_decoder(self.spec, work)

    def batch_flag(self, batch: int) -> str:
        return (
            f"-batchsize={batch}" if self.kind == "resnet" else f"-onnx-define-symbol=batch,{batch}"
        )

    def macs(self, batch: int) -> int | None:
        """MACs of the matrix products, counted from the spec (None: not worked out here)."""
        s = self.spec
        if self.kind == "encoder":
            per_layer = (
                4 * s.seq * s.hidden**2 + 2 * s.seq * s.hidden * s.ffn + 2 * s.seq**2 * s.hidden
            )
            return batch * s.layers * per_layer
        if self.kind == "decoder":
            per_layer = (
                4 * s.seq * s.hidden**2
                + 2 * s.seq * s.hidden * s.ffn
                + 2 * s.seq * s.ctx * s.hidden
            )
            return batch * (s.layers * per_layer + s.seq * s.hidden * s.vocab)
        return None


def _bench_small() -> dict[str, BenchModel]:
    models, transformer_models = bench_models()
    encoder = transformer_models.EncoderSpec
    decoder = transformer_models.DecoderSpec
    small_decoder = {"layers": 2, "hidden": 256, "heads": 4, "ffn": 1024, "vocab": 1000, "ctx": 128}
    return {
        "resnet": BenchModel("resnet", models.RESNET_QUICK, ("-convert-to-fp16",)),
        "bert": BenchModel(
            "encoder",
            encoder(layers=2, hidden=256, heads=4, ffn=1024, seq=128),
            ("-convert-to-fp16",),
        ),
        "decoder-prefill": BenchModel(
            "decoder", decoder(**small_decoder, seq=32), ("-retained-state",)
        ),
        "decoder-decode": BenchModel(
            "decoder", decoder(**small_decoder, seq=1), ("-retained-state",)
        ),
        # smaller still: too little work per layer to share among 14 cores
        "resnet-tiny": BenchModel(
            "resnet",
            models.ResNetSpec(blocks=(1, 1, 1, 1), width=16, image=64),
            ("-convert-to-fp16",),
        ),
        "bert-tiny": BenchModel(
            "encoder",
            encoder(layers=2, hidden=128, heads=2, ffn=512, seq=32),
            ("-convert-to-fp16",),
        ),
    }


@pytest.fixture(scope="module")
def bench_work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("bench-models")


@cache
def _estimate(name: str, cores: int, batch: int, work: Path) -> dict[str, Any]:
    model = _bench_small()[name]
    flags = [
        *model.flags,
        model.batch_flag(batch),
        f"-aic-num-cores={cores}",
        f"-aic-device={DEVICE}",
    ]
    result = compile_model(str(model.path(work)), flags)
    try:
        return result.metrics
    finally:
        result.cleanup()


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("cores", CORES)
@pytest.mark.parametrize("name", ["resnet", "bert", "decoder-prefill", "decoder-decode"])
def test_no_estimate_beats_a_physical_floor(
    name: str, cores: int, batch: int, bench_work: Path
) -> None:
    metrics = _estimate(name, cores, batch, bench_work)
    latency = metrics["estimated_latency_us"]
    assert metrics["floor_compute_us"] > 0 and metrics["floor_ddr_us"] > 0
    assert latency >= metrics["floor_compute_us"]
    assert latency >= metrics["floor_ddr_us"]
    # The floors are what they claim: every HMX MAC at the fp16 peak of every core (and the
    # compiler counts at least the model's matrix-product MACs), and at least the network's
    # inputs and outputs crossing DDR at its bandwidth.
    device = get_device(DEVICE)
    peak = device.hmx_fp16_macs_per_cycle * cores * device.clock_hz
    assert metrics["floor_compute_us"] >= 0.999 * metrics["aic_hmx_mac_estimate"] / peak * 1e6
    model_macs = _bench_small()[name].macs(batch)
    if model_macs is not None:
        assert metrics["aic_hmx_mac_estimate"] >= model_macs
    io = sum(port["host_bytes"] for port in metrics["memory_traffic"]["per_port"])
    assert metrics["floor_ddr_bytes"] >= io > 0
    assert metrics["floor_ddr_us"] >= 0.999 * io / device.ddr_bandwidth_bytes_per_s * 1e6


# ------------------------------------------------------------------------- 6. more cores


@pytest.mark.parametrize(
    ("name", "batch"),
    [("resnet", 1), ("resnet", 8), ("bert", 1), ("bert", 8)],
)
def test_more_cores_are_faster(name: str, batch: int, bench_work: Path) -> None:
    latency = [_estimate(name, cores, batch, bench_work)["estimated_latency_us"] for cores in CORES]
    assert latency[0] > latency[1] > latency[2], dict(zip(CORES, latency, strict=True))


@pytest.mark.parametrize(
    ("name", "batch"), [("resnet-tiny", 1), ("resnet-tiny", 8), ("bert-tiny", 1)]
)
def test_more_cores_are_never_slower_even_for_tiny_networks(
    name: str, batch: int, bench_work: Path
) -> None:
    # spread over 14 cores these would lose to 4 in semaphores and transfers: the compile
    # then keeps the 4-core schedule and leaves the other cores idle
    latency = [_estimate(name, cores, batch, bench_work)["estimated_latency_us"] for cores in CORES]
    assert latency[0] > latency[1] >= latency[2], dict(zip(CORES, latency, strict=True))


# --------------------------------------------------------------------- 7. multicast (item 3)


def _distinct_weight_bytes(program: Program) -> int:
    """Bytes of the distinct boxes of constants that the kernels' tiles read, over all cores:
    what must cross DDR at least once."""
    boxes: set[tuple[int, Box]] = set()
    for stream in program.streams:
        for instr in stream:
            if isinstance(instr, RunKernel):
                kernel = program.kernels[instr.kernel]
                for tid, operand in zip(kernel.inputs, instr.inputs, strict=True):
                    if tid >= 0 and operand is not None:
                        if program.tensors[tid].kind == KIND_CONSTANT:
                            boxes.add((tid, operand.box))
    return sum(stored_bytes(program.tensors[t], box) for t, box in boxes)


@pytest.mark.parametrize("weights", ["streamed", "resident"])
@pytest.mark.parametrize("split", ["rows", "batch"])
def test_a_weight_that_every_core_reads_crosses_ddr_once(split: str, weights: str) -> None:
    rows, batch = (256, None) if split == "rows" else (32, 8)
    model = mlp(rows=rows, batch=batch)
    feeds = _mlp_input(rows, batch=batch)
    want = _ort_run(model.SerializeToString(), feeds)
    read: dict[bool, int] = {}
    for multicast in (True, False):
        policy = CodegenPolicy(residency=weights == "resident", multicast=multicast)
        result = compile_model(model, _flags(4, "fp16"), policy=policy)
        try:
            with load_qpc(result.qpc_path) as qpc:
                program = qpc.program()
                executor = Executor(program, qpc.segments["constants.bin"], VTCM)
                _assert_close(executor.run(feeds), want, "fp16")
            metrics = result.metrics
        finally:
            result.cleanup()
        counted = executor.traffic if weights == "streamed" else executor.activation_traffic
        constant = sum(t.ddr_read_constant for t in counted)
        multicast_bytes = sum(t.multicast for t in counted)
        distinct = _distinct_weight_bytes(program)
        users = {
            c for c, s in enumerate(program.streams) if any(isinstance(i, RunKernel) for i in s)
        }
        assert len(users) > 1  # the cut gives several cores the same weights
        if multicast:
            assert constant == distinct > 0
            assert multicast_bytes >= distinct
            if weights == "streamed":
                assert metrics["memory_traffic"]["total"]["multicast_bytes"] >= distinct
        else:
            assert multicast_bytes == 0
            assert constant == len(users) * distinct
        read[multicast] = constant
    assert read[True] < read[False]
