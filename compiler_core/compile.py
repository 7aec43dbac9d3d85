"""The whole compile, one line per stage: import -> passes -> lower -> plan memory -> emit.

Every stage is timed (`-time-passes`) and reports progress through one callback, which the
farm's worker forwards to the job row.
"""

from __future__ import annotations

import dataclasses
import gc
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from compiler_core.costmodel import Timeline, build_timeline
from compiler_core.errors import CompileError
from compiler_core.importer import ModelSource, import_model, require_static_shapes
from compiler_core.lowering.emit import emit_program
from compiler_core.lowering.lower import LoweredGraph, config_from, lower_graph
from compiler_core.lowering.memory import MemoryPlan, plan_memory
from compiler_core.lowering.program import Program, encode_program
from compiler_core.metrics import perf_metrics, perf_warnings
from compiler_core.mxfp import MXFP6, Mxfp6Tensor, encode_matmul_weights, iter_encode_mxfp6
from compiler_core.options import CompileOptions
from compiler_core.passes.manager import PassTiming, ProgressReporter, run_passes
from compiler_core.passes.pipeline import graph_pipeline
from compiler_core.profiling.stats_layout import build_layout
from compiler_core.qpc.container import ConstantEntry, Segment, encode_constantsdesc, write_qpc
from compiler_core.qpc.networkdesc import IODesc, NetworkDesc, Requirements
from compiler_core.tensors import release_mapping
from compiler_core.version import COMPILER_VERSION

Progress = Callable[[str, float], None]

# Share of the whole compile that each stage reports progress over.
_STAGES = {
    "import": (0.0, 0.15),
    "graph-passes": (0.15, 0.55),
    "lower": (0.55, 0.75),
    "plan-memory": (0.75, 0.8),
    "emit-program": (0.8, 0.9),
    "write-qpc": (0.9, 1.0),
}


@dataclass
class CompileResult:
    qpc_path: Path
    warnings: list[dict[str, Any]]
    pass_times: dict[str, float]
    options: CompileOptions
    program: Program = field(repr=False)
    _report: Callable[[], dict[str, Any]] = field(repr=False, default=dict)
    _tmpdir: tempfile.TemporaryDirectory[str] | None = field(default=None, repr=False)
    _metrics: dict[str, Any] | None = field(default=None, repr=False)

    @property
    def metrics(self) -> dict[str, Any]:
        """The perf metrics, computed from the cost model's timeline on first use: a caller
        that never looks (most scripted compiles) does not pay for the schedule."""
        if self._metrics is None:
            self._metrics = self._report()
        return self._metrics

    @property
    def qpc(self) -> bytes:
        return self.qpc_path.read_bytes()

    def cleanup(self) -> None:
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None


class _Stages:
    def __init__(self, progress: Progress | None) -> None:
        self.timing = PassTiming()
        self.progress = progress

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.timing.records.append((name, time.perf_counter() - start))
        self.report(name, 1.0)

    def report(self, name: str, fraction: float) -> None:
        if self.progress is not None:
            lo, hi = _STAGES[name]
            self.progress(name, lo + (hi - lo) * fraction)

    def pass_times(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, seconds in self.timing.records:
            key, n = name, 2
            while key in out:
                key, n = f"{name}#{n}", n + 1
            out[key] = seconds
        return out


def _as_options(
    options: CompileOptions | Mapping[str, Any] | Sequence[str] | None,
) -> CompileOptions:
    if options is None:
        return CompileOptions()
    if isinstance(options, CompileOptions):
        return options
    if isinstance(options, Mapping):
        return CompileOptions.from_json(options)
    return CompileOptions.from_flags(list(options))


def compile_model(
    model: ModelSource | None = None,
    options: CompileOptions | Mapping[str, Any] | Sequence[str] | None = None,
    progress: Progress | None = None,
) -> CompileResult:
    """Compile an ONNX model (path, bytes or ModelProto) into a QPC.

    Writes `<-aic-binary-dir>/programqpc.bin`, or a temporary directory's when no directory is
    named (kept until `result.cleanup()` or garbage collection).
    """
    opts = _as_options(options)
    source = model if model is not None else opts.model
    if source is None:
        raise CompileError("missing_model", "no model given (-m=<path>)", flag="-m")
    _reject_unimplemented(opts)
    with _gc_paused():
        return _compile(source, opts, progress)


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector for the compile.

    The IR allocates hundreds of thousands of small objects that live until the compile ends;
    CPython's collector keeps rescanning them (a fifth of the compile time of a ResNet-50).
    Reference counting still frees everything acyclic at once; cycles wait for the end.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _compile(source: ModelSource, opts: CompileOptions, progress: Progress | None) -> CompileResult:
    device = opts.device
    stages = _Stages(progress)

    with stages.stage("import"):
        imported = import_model(
            source, define_symbols=opts.onnx_define_symbol, batchsize=opts.batchsize
        )
    ir_model = imported.model
    passes = graph_pipeline(opts)
    with stages.stage("graph-passes"):
        reporter = ProgressReporter(lambda _name, f: stages.report("graph-passes", f))
        run_passes(ir_model, passes, timing=stages.timing, progress=reporter)
        require_static_shapes(ir_model)
    pass_warnings = [w for p in passes for w in getattr(p, "warnings", [])]

    with stages.stage("lower"):
        lowered = lower_graph(ir_model.graph, imported.opset, config_from(opts, device))
        mxfp6 = encode_matmul_weights(lowered) if opts.mxfp6_matmul else []
    stats_layout = build_layout(opts, lowered)
    with stages.stage("plan-memory"):
        plan = plan_memory(
            lowered,
            dealloc_delay=opts.allocator_dealloc_delay,
            ddr_capacity=device.ddr_bytes_per_soc,
            extra_bytes=stats_layout.size,
        )
    stats_layout = stats_layout.at(plan.ddr_size - stats_layout.size)
    with stages.stage("emit-program"):
        program = emit_program(lowered, plan)
        program_bytes = encode_program(program)

    out_dir, tmpdir = _output_dir(opts)
    with stages.stage("write-qpc"):
        network = _network_desc(lowered, program, opts, imported.model.graph.name)
        constants, entries = _constants(lowered, plan)
        write_qpc(
            out_dir / "programqpc.bin",
            [
                Segment("networkdesc.bin", network.to_bytes()),
                Segment("program.bin", program_bytes),
                Segment("constants.bin", constants, offset_field=None),
                Segment("constantsdesc.bin", encode_constantsdesc(entries)),
                Segment("statsdesc.bin", stats_layout.to_bytes()),
            ],
        )

    warnings = [_warning("deprecated_option", w) for w in opts.warnings]
    warnings += _option_notes(opts)
    if opts.mxfp6_matmul and not mxfp6:
        warnings.append(
            _warning(
                "mxfp6_no_weights",
                "-mxfp6-matmul found no constant MatMul/Gemm weight to store as MXFP6",
            )
        )
    warnings += [_warning("import", w) for w in imported.warnings]
    warnings += [_warning("fp16_clipped", w) if isinstance(w, str) else w for w in pass_warnings]
    timelines: list[Timeline] = []

    def timeline() -> Timeline:
        if not timelines:
            timelines.append(build_timeline(program, device))
        return timelines[0]

    if opts.aic_perf_warnings:
        warnings += perf_warnings(program, lowered, opts, device, timeline())
    else:
        warnings += perf_warnings(program, lowered, opts, device)
    return CompileResult(
        qpc_path=out_dir / "programqpc.bin",
        _report=lambda: perf_metrics(program, lowered, plan, opts, device, timeline()),
        warnings=warnings,
        pass_times=stages.pass_times(),
        options=opts,
        program=program,
        _tmpdir=tmpdir,
    )


_NOT_YET = {
    "retained_state": "-retained-state",
    "network_specialization_config": "-network-specialization-config",
    "node_precision_info": "-node-precision-info",
}
_NO_EFFECT = {
    "multicast_weights": "-multicast-weights",
    "aic_enable_depth_first": "-aic-enable-depth-first",
}


def _reject_unimplemented(opts: CompileOptions) -> None:
    """Options the schema knows but this compiler does not implement yet fail loudly rather
    than produce a QPC that silently ignores them."""
    for attr, flag in _NOT_YET.items():
        if getattr(opts, attr):
            raise CompileError(
                "unsupported_option", f"{flag} is not supported by this compiler yet", flag=flag
            )


def _option_notes(opts: CompileOptions) -> list[dict[str, Any]]:
    return [
        _warning(
            "option_without_effect",
            f"{flag} is accepted but changes nothing in this compiler's device model",
        )
        for attr, flag in _NO_EFFECT.items()
        if getattr(opts, attr)
    ]


def _warning(code: str, message: str) -> dict[str, Any]:
    return {"code": code, "message": message, "nodes": [], "suggestion": ""}


def _output_dir(opts: CompileOptions) -> tuple[Path, tempfile.TemporaryDirectory[str] | None]:
    if opts.aic_binary_dir:
        path = Path(opts.aic_binary_dir)
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CompileError(
                "output_dir",
                f"cannot create -aic-binary-dir {path}: {exc.strerror}",
                flag="-aic-binary-dir",
            ) from None
        return path, None
    tmp = tempfile.TemporaryDirectory(prefix="qpcfarm-")
    return Path(tmp.name), tmp


def _network_desc(
    lowered: LoweredGraph, program: Program, opts: CompileOptions, name: str | None
) -> NetworkDesc:
    inputs = tuple(IODesc.from_tensor(program.tensors[t]) for t in program.inputs)
    outputs = tuple(IODesc.from_tensor(program.tensors[t]) for t in program.outputs)
    batch = inputs[0].dims[0] if inputs and inputs[0].dims else 1
    requirements = Requirements.from_program(program)
    if any(isinstance(t, Mxfp6Tensor) for t in lowered.tensors):  # a weight format it must read
        dtypes = tuple(sorted({*requirements.dtypes, MXFP6}))
        requirements = dataclasses.replace(requirements, dtypes=dtypes)
    return NetworkDesc(
        network_name=name or "network",
        compiler_version=COMPILER_VERSION,
        options=opts.to_json(),
        hw_version=opts.device.hw_version,
        num_cores=program.num_cores,
        batch_size=int(batch),
        inputs=inputs,
        outputs=outputs,
        requirements=requirements,
        stats={
            "level": opts.stats_level,
            "batchsize": opts.stats_batchsize,
            "ddr_stats": opts.ddr_stats,
            "pmu_recipe": opts.aic_pmu_recipe,
            "pmu_events": list(opts.aic_pmu_events),
        },
    )


def _constants(
    lowered: LoweredGraph, plan: MemoryPlan
) -> tuple[Iterator[memoryview], list[ConstantEntry]]:
    entries = []
    for tid in plan.constant_order:
        t = lowered.tensors[tid]
        entry = ConstantEntry(t.name, t.dtype, t.shape, plan.offsets[tid], t.nbytes)
        if isinstance(t, Mxfp6Tensor):
            entry = dataclasses.replace(entry, encoding=MXFP6, block_axis=t.block_axis)
        entries.append(entry)

    def chunks() -> Iterator[memoryview]:
        cursor = 0
        for entry, tid in zip(entries, plan.constant_order, strict=True):
            if entry.offset > cursor:
                yield memoryview(bytes(entry.offset - cursor))
            data = lowered.tensors[tid].data
            assert data is not None
            if entry.encoding == MXFP6:
                yield from _mxfp6_bytes(data, np.dtype(entry.dtype), entry.block_axis or 0)
            else:
                yield from _tensor_bytes(data, np.dtype(entry.dtype))
            cursor = entry.offset + entry.nbytes
        if plan.constants_size > cursor:
            yield memoryview(bytes(plan.constants_size - cursor))

    return chunks(), entries


_COPY_CHUNK = 8 << 20


def _mxfp6_bytes(data: ir.TensorProtocol, dtype: np.dtype, axis: int) -> Iterator[memoryview]:
    """A weight's MXFP6 bytes, quantized from its values in the graph's dtype (fp16 ones,
    clipped to fp16's range, under -convert-to-fp16)."""
    array = np.asarray(data.numpy(), dtype=dtype)
    yield from iter_encode_mxfp6(array, axis)
    del array
    if isinstance(data, ir.ExternalTensor):
        release_mapping(data)


def _tensor_bytes(data: ir.TensorProtocol, dtype: np.dtype) -> Iterator[memoryview]:
    """A constant's little-endian bytes, holding at most one tensor (or one file chunk).

    Weights still on disk (external data, or inline data the importer left in the model
    file) are copied from the file in chunks; everything else is computed, yielded and let go,
    and memory-mapped sources are unmapped once read.
    """
    if isinstance(data, ir.ExternalTensor) and data.raw is None and data.dtype.numpy() == dtype:
        remaining = data.nbytes
        with open(data.path, "rb") as source:
            source.seek(data.offset or 0)
            while remaining > 0:
                chunk = source.read(min(_COPY_CHUNK, remaining))
                if not chunk:
                    raise CompileError(
                        "external_data_missing",
                        f"{data.path} ends before tensor {data.name!r} does",
                    )
                remaining -= len(chunk)
                yield memoryview(chunk)
        return
    mapped = isinstance(data, ir.ExternalTensor)
    array = np.array(data.numpy(), dtype=dtype, order="C", copy=mapped or None)
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    if mapped:
        release_mapping(data)
    yield memoryview(array.reshape(-1).view(np.uint8))  # type: ignore[arg-type]
