"""The compile's steps for one network (or each of its specializations): import, graph
passes, lower, plan memory, emit, write the QPC; then its warnings and metrics.

`compile.py` runs them in order for one device, `mdp/build.py` once per device of a
partition. Every stage is timed (`-time-passes`) and reports progress through one callback,
which the farm's worker forwards to the job row.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import tempfile
import time
from collections.abc import Callable, Hashable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import onnx_ir as ir

from compiler_core.cost_timeline import Timeline, build_timeline
from compiler_core.devices import DeviceProfile
from compiler_core.errors import CompileError
from compiler_core.importer import (
    ImportedModel,
    ModelSource,
    import_model,
    require_static_shapes,
)
from compiler_core.llm_report import llm_report
from compiler_core.lowering.depth_first import plan_depth_first
from compiler_core.lowering.emit import emit_program
from compiler_core.lowering.lower import choose_splits, config_from, lower_graph
from compiler_core.lowering.lowered import LoweredGraph, LTensor
from compiler_core.lowering.memory import (
    MemoryPlan,
    SharedConstants,
    plan_memory,
    shared_constant_offsets,
    used_constants,
)
from compiler_core.lowering.placement import CodegenPolicy, Planned, plan_schedule
from compiler_core.lowering.program import Program, encode_program
from compiler_core.metrics import perf_metrics, perf_warnings, pmu_warnings
from compiler_core.model_folder import ModelFolder
from compiler_core.mxfp import MXFP6, Mxfp6Tensor, encode_matmul_weights, iter_encode_mxfp6
from compiler_core.options import CompileOptions
from compiler_core.passes.fold_batchnorm import ScaledWeight
from compiler_core.passes.manager import PassTiming, ProgressReporter, run_passes
from compiler_core.passes.pipeline import graph_pipeline
from compiler_core.profiling.stats_layout import StatsLayout, build_layout
from compiler_core.qpc.container import ConstantEntry, Segment, encode_constantsdesc, write_qpc
from compiler_core.qpc.networkdesc import (
    RETAINED_SUFFIX,
    IODesc,
    NetworkDesc,
    Requirements,
    SpecializationDesc,
    program_segment,
    statsdesc_segment,
)
from compiler_core.report import (
    KIND_IMPORT,
    KIND_OPTION,
    KIND_PERF,
    KIND_PRECISION,
    PASS_SEPARATOR,
)
from compiler_core.specializations import FLAG as SPEC_FLAG
from compiler_core.specializations import (
    VENDOR_KEYS,
    Specialization,
    load_specializations,
    with_full_batch_size,
)
from compiler_core.tensors import read_into, release_mapping
from compiler_core.version import COMPILER_VERSION

Progress = Callable[[str, float], None]

# Share of the whole compile that each stage reports progress over.
_STAGES = {
    "import": (0.0, 0.15),
    "graph-passes": (0.15, 0.55),
    "lower": (0.55, 0.7),
    "schedule": (0.7, 0.78),
    "plan-memory": (0.78, 0.8),
    "emit-program": (0.8, 0.9),
    "write-qpc": (0.9, 1.0),
}


@dataclass
class CompileResult:
    qpc_path: Path
    warnings: list[dict[str, Any]]
    pass_times: dict[str, float]
    """Seconds per stage in run order, and per graph pass as `graph-passes/<pass>`: the
    stages (names without `/`) add up to the compile (`compiler_core.report.pass_time_rows`)."""
    options: CompileOptions
    program: Program = field(repr=False)
    """The program (of the first specialization, when there are several)."""
    programs: dict[str, Program] = field(default_factory=dict, repr=False)
    """Every specialization's program by name ("default" without specializations)."""
    accuracy: dict[str, Any] | None = None
    """A quantized compile with calibration inputs: its outputs against the float model's
    (compiler_core/quant/accuracy.py), also in `metrics` as `quantization_accuracy`."""
    conversion: dict[str, str] | None = None
    """A TensorFlow or PyTorch model converted to ONNX first: its format, the converter and
    its version (compiler_core/convert), also in `metrics` as `conversion`."""
    _report: Callable[[], dict[str, Any]] = field(repr=False, default=dict)
    _tmpdir: tempfile.TemporaryDirectory[str] | None = field(default=None, repr=False)
    _metrics: dict[str, Any] | None = field(default=None, repr=False)

    @property
    def metrics(self) -> dict[str, Any]:
        """The perf metrics, computed from the cost model's timeline on first use: a caller
        that never looks (most scripted compiles) does not pay for the schedule."""
        if self._metrics is None:
            self._metrics = self._report()
            if self.accuracy is not None:
                self._metrics["quantization_accuracy"] = self.accuracy
            if self.conversion is not None:
                self._metrics["conversion"] = self.conversion
        return self._metrics

    @property
    def qpc(self) -> bytes:
        return self.qpc_path.read_bytes()

    def cleanup(self) -> None:
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None


class Stages:
    """The compile's stages in run order, each with the passes it ran (`graph-passes`)."""

    def __init__(self, progress: Progress | None) -> None:
        self.records: list[tuple[str, float, list[tuple[str, float]]]] = []
        self.progress = progress

    @contextmanager
    def stage(self, name: str, timing: PassTiming | None = None) -> Iterator[None]:
        """Time the stage; `timing`'s records (the passes run inside it) become its parts.
        Progress is reported as the stage starts (so a job row names the stage it is in, and
        a failure the stage it failed in) and as it ends."""
        self.report(name, 0.0)
        start = time.perf_counter()
        yield
        parts = list(timing.records) if timing is not None else []
        self.records.append((name, time.perf_counter() - start, parts))
        self.report(name, 1.0)

    def report(self, name: str, fraction: float) -> None:
        if self.progress is not None:
            lo, hi = _STAGES[name]
            self.progress(name, lo + (hi - lo) * fraction)

    def pass_times(self) -> dict[str, float]:
        """Stage -> seconds, and `<stage>/<pass>` -> seconds for the passes inside a stage
        (a tree: the stages add up to the compile, a stage's passes to most of the stage).
        A name met again (a pass run twice, a stage per specialization) gets `#2`, `#3`."""
        out: dict[str, float] = {}
        for name, seconds, parts in self.records:
            key = _unique(out, name)
            out[key] = seconds
            for part, part_seconds in parts:
                out[_unique(out, f"{key}{PASS_SEPARATOR}{part}")] = part_seconds
        return out


def _unique(taken: Mapping[str, float], name: str) -> str:
    key, n = name, 2
    while key in taken:
        key, n = f"{name}#{n}", n + 1
    return key


@dataclass
class Build:
    """One specialization of the network (or the network itself) on its way to a program."""

    spec: Specialization | None
    imported: ImportedModel
    lowered: LoweredGraph
    mxfp6: list[str]
    pass_warnings: list[Any]
    stats_layout: StatsLayout
    planned: Planned | None
    """The schedule and its VTCM allocation; released once the program is emitted (nothing
    after reads it, and its ~19,000 objects would be left for the cyclic collector to scan
    when a compile's collection pause ends)."""
    plan: MemoryPlan | None = None
    program: Program | None = None
    program_bytes: bytes = b""
    notes: list[dict[str, Any]] = field(default_factory=list)
    """Warnings about how the options were applied to this build (depth-first)."""

    def done(self) -> tuple[MemoryPlan, Program]:
        assert self.plan is not None and self.program is not None
        return self.plan, self.program


def specializations(opts: CompileOptions, folder: ModelFolder) -> list[Specialization | None]:
    """The specializations to build, or [None]: the network as it is."""
    if not opts.network_specialization_config:
        return [None]
    loaded = load_specializations(opts.network_specialization_config, folder)
    if opts.full_batch_size is not None:
        loaded = with_full_batch_size(loaded, opts.full_batch_size)
    return list(loaded)


def plan_and_emit(
    build: Build,
    region: SharedConstants | None,
    opts: CompileOptions,
    stages: Stages,
    meta: Mapping[str, Any] | None = None,
) -> None:
    """Place the build's tensors in memory (the stats buffer at the end of DDR), then emit
    and encode its program (with `meta` added to the program's)."""
    planned = build.planned
    assert planned is not None, "the build's program is already emitted"
    with stages.stage("plan-memory"):
        build.plan = plan_memory(
            build.lowered,
            dealloc_delay=opts.allocator_dealloc_delay,
            ddr_capacity=opts.device.ddr_bytes_per_soc,
            extra_bytes=build.stats_layout.size,
            shared_constants=region,
            on_chip=planned.schedule.placement.chip,
        )
    build.stats_layout = build.stats_layout.at(build.plan.ddr_size - build.stats_layout.size)
    with stages.stage("emit-program"):
        build.program = emit_program(
            build.lowered, build.plan, planned.schedule, planned.allocation.resident
        )
        build.program.meta.update(meta or {})
        build.program_bytes = encode_program(build.program)
    build.planned = None


def write_network_qpc(
    path: Path,
    builds: list[Build],
    opts: CompileOptions,
    retained: list[str],
    constant_items: list[tuple[LTensor, int]] | None,
) -> None:
    write_qpc(path, qpc_segments(builds, opts, retained, constant_items))


def qpc_segments(
    builds: list[Build],
    opts: CompileOptions,
    retained: list[str],
    constant_items: list[tuple[LTensor, int]] | None,
) -> list[Segment]:
    """The network descriptor, each build's program and stats layout, and the constants
    (shared by every build when there are several; else the first build's own)."""
    first_plan = builds[0].done()[0]
    if constant_items is None:
        constant_items = [
            (builds[0].lowered.tensors[t], first_plan.offsets[t]) for t in first_plan.constant_order
        ]
    network = network_desc(builds, opts, retained)
    constants, entries = _constants(constant_items, first_plan.constants_size)
    segments = [Segment("networkdesc.bin", network.to_bytes())]
    for index, build in enumerate(builds):
        segments.append(Segment(program_segment(index), build.program_bytes))
        segments.append(Segment(statsdesc_segment(index), build.stats_layout.to_bytes()))
    segments.append(Segment("constants.bin", constants, offset_field=None))
    segments.append(Segment("constantsdesc.bin", encode_constantsdesc(entries)))
    return segments


class Timelines:
    """Each build's cost-model timeline, scheduled on first use: only -aic-perf-warnings
    and the metrics need one."""

    def __init__(self, builds: list[Build], device: DeviceProfile) -> None:
        self._builds = builds
        self._device = device
        self._done: dict[int, Timeline] = {}

    def __getitem__(self, index: int) -> Timeline:
        if index not in self._done:
            self._done[index] = build_timeline(self._builds[index].done()[1], self._device)
        return self._done[index]


def build_warnings(
    builds: list[Build], opts: CompileOptions, retained: list[str], timelines: Timelines
) -> list[dict[str, Any]]:
    """Option warnings first, then each build's import, precision and perf warnings, each
    (code, message) once."""
    warnings = [_warning("deprecated_option", w) for w in opts.warnings]
    for build in builds:
        warnings += [w for w in build.notes if w not in warnings]
    if opts.mxfp6_matmul and not any(b.mxfp6 for b in builds):
        warnings.append(
            _warning(
                "mxfp6_no_weights",
                "-mxfp6-matmul found no constant MatMul/Gemm weight to store as MXFP6",
            )
        )
    if opts.retained_state and not retained:
        warnings.append(
            _warning(
                "retained_state_unused",
                "-retained-state found no output named <input>_RetainedState to keep on device",
            )
        )
    always = {w["code"] for w in pmu_warnings(opts)}  # given with or without the flag
    seen: set[tuple[str, str]] = set()
    for index, build in enumerate(builds):
        program = build.done()[1]
        found = [_warning("import", w, KIND_IMPORT) for w in build.imported.warnings]
        found += [
            _warning("fp16_clipped", w, KIND_PRECISION)
            if isinstance(w, str)
            else {"kind": KIND_PRECISION, **w}
            for w in build.pass_warnings
            if opts.aic_perf_warnings or isinstance(w, str) or w.get("kind") != KIND_PERF
        ]
        if opts.aic_perf_warnings:
            analysis = perf_warnings(program, build.lowered, opts, opts.device, timelines[index])
        else:
            analysis = perf_warnings(program, build.lowered, opts, opts.device)
        found += [
            {**w, "kind": KIND_OPTION if w["code"] in always else KIND_PERF} for w in analysis
        ]
        for warning in found:
            key = (warning["code"], warning["message"])
            if key not in seen:
                seen.add(key)
                warnings.append(warning)
    return warnings


def build_metrics(
    builds: list[Build], opts: CompileOptions, timelines: Timelines
) -> dict[str, Any]:
    """The first specialization's metrics; with several, each one's under `specializations`
    (computed once each)."""
    each = {
        spec_name(b.spec): perf_metrics(
            b.done()[1], b.lowered, b.done()[0], opts, opts.device, timelines[i]
        )
        for i, b in enumerate(builds)
    }
    first = dict(next(iter(each.values())))
    if len(builds) > 1:
        first["specializations"] = each
    llm = llm_report(
        [
            (spec_name(b.spec), b.spec.symbols if b.spec else {}, b.done()[1], each[name])
            for b, name in zip(builds, each, strict=True)
        ],
        opts.device,
    )
    if llm is not None:
        first["llm"] = llm
    return first


def lower_spec(
    source: ModelSource,
    opts: CompileOptions,
    spec: Specialization | None,
    stages: Stages,
    policy: CodegenPolicy,
    folder: ModelFolder,
    imported: ImportedModel | None = None,
) -> Build:
    """Import (with the specialization's symbols bound), run the graph passes and lower.
    `imported`: the model already imported (one device's share of it, for a partition)."""
    if imported is None:
        imported = import_spec(source, opts, spec, stages, folder)
    ir_model = imported.model
    passes = graph_pipeline(opts, folder)
    timing = PassTiming()
    with stages.stage("graph-passes", timing):
        reporter = ProgressReporter(lambda _name, f: stages.report("graph-passes", f))
        run_passes(ir_model, passes, timing=timing, progress=reporter)
        require_static_shapes(ir_model)
        opsets = ir_model.opset_imports  # quantizing raises an old model's opset
        imported.opset = opsets.get("", opsets.get("ai.onnx", imported.opset))
    with stages.stage("lower"):
        config = config_from(opts, opts.device, folder)
        if not policy.k_splits:
            config = dataclasses.replace(config, k_splits=False)
        lowered = lower_graph(ir_model.graph, imported.opset, config)
        mxfp6 = encode_matmul_weights(lowered) if opts.mxfp6_matmul else []
    with stages.stage("schedule"):
        planned = plan_schedule(lowered, config.vtcm_budget, policy)
        if _worth_fewer_cores(lowered, config):
            lowered, mxfp6, planned = _fastest_of(
                ir_model.graph, imported.opset, opts, policy, config, (lowered, mxfp6, planned)
            )
        notes: list[dict[str, Any]] = []
        if opts.aic_enable_depth_first:
            lowered, planned, notes = _depth_first(lowered, planned, opts, policy, config)
    return Build(
        spec=spec,
        imported=imported,
        lowered=lowered,
        mxfp6=mxfp6,
        pass_warnings=[w for p in passes for w in getattr(p, "warnings", [])],
        stats_layout=build_layout(opts, lowered),
        planned=planned,
        notes=notes,
    )


def import_spec(
    source: ModelSource,
    opts: CompileOptions,
    spec: Specialization | None,
    stages: Stages,
    folder: ModelFolder,
) -> ImportedModel:
    """The model imported with the specialization's symbols bound."""
    symbols = dict(opts.onnx_define_symbol)
    if opts.full_batch_size is not None:
        symbols.setdefault("full_batch_size", opts.full_batch_size)
    if spec is not None:
        symbols.update(spec.symbols)
    with stages.stage("import"):
        imported = _import(source, opts, symbols, folder)
    if spec is not None:
        _check_symbols_exist(imported, spec)
    return imported


def _latency(lowered: LoweredGraph, planned: Planned, opts: CompileOptions) -> float:
    """The modelled latency of a schedule's program, seconds (inputs already on device)."""
    plan = plan_memory(lowered, on_chip=planned.schedule.placement.chip)
    program = emit_program(lowered, plan, planned.schedule, planned.allocation.resident)
    return build_timeline(program, opts.device, inputs_ready=True).latency_seconds


def _depth_first(
    lowered: LoweredGraph,
    planned: Planned,
    opts: CompileOptions,
    policy: CodegenPolicy,
    config: Any,
) -> tuple[LoweredGraph, Planned, list[dict[str, Any]]]:
    """`-aic-enable-depth-first`: the network run image group by image group when it can
    and (without `-aic-depth-first-mem`) when the cost model estimates it faster."""

    def schedule(grouped: LoweredGraph) -> tuple[float, Planned]:
        choose_splits(grouped, opts.device, config.vtcm_budget)
        scheduled = plan_schedule(grouped, config.vtcm_budget, policy)
        return _latency(grouped, scheduled, opts), scheduled

    def baseline() -> float:
        return _latency(lowered, planned, opts)

    choice = plan_depth_first(lowered, opts.aic_depth_first_mem, baseline, schedule)
    notes = [_warning("depth_first_not_applied", note) for note in choice.notes]
    if choice.lowered is None or choice.planned is None:
        return lowered, planned, notes
    return choice.lowered, choice.planned, notes


def _import(
    source: ModelSource, opts: CompileOptions, symbols: dict[str, int], folder: ModelFolder
) -> ImportedModel:
    """`import_model`, with a dimension left symbolic blamed on a misspelt symbol when the
    options define one the model does not have (`-onnx-define-symbol=bacth,1`)."""
    try:
        return import_model(
            source, define_symbols=symbols, batchsize=opts.batchsize, model_folder=folder
        )
    except CompileError as exc:
        if exc.code != "dynamic_shape" or not symbols:
            raise
        declared = _declared_input_symbols(source)
        unknown = sorted(set(symbols) - declared)
        if not unknown:
            raise
        raise CompileError(
            exc.code,
            f"{exc.message}. -onnx-define-symbol names {', '.join(map(repr, unknown))}, which "
            f"no input dimension of the model uses (its symbols: "
            f"{', '.join(sorted(declared)) or 'none'}): a misspelling?",
            flag=exc.flag,
            node=exc.node,
            details={**exc.details, "unknown_symbols": unknown},
        ) from None


def _declared_input_symbols(source: ModelSource) -> frozenset[str]:
    """The symbolic dimensions the model's inputs declare (the model's bytes are read again:
    only on the way to an error)."""
    from compiler_core.importer import _read_model

    proto = _read_model(source)[0]
    return frozenset(
        dim.dim_param
        for value in proto.graph.input
        for dim in value.type.tensor_type.shape.dim
        if dim.dim_param
    )


SMALL_NETWORK_MACS = 500_000_000
"""Below this, a network's kernels are small enough that spreading them over every core can
cost more in transfers and semaphores than it saves: the compile also tries fewer cores."""
FEWER_CORES = 4


def _worth_fewer_cores(lowered: LoweredGraph, config: Any) -> bool:
    macs = sum(k.desc.macs for k in lowered.kernels)
    return config.num_cores > FEWER_CORES and macs < SMALL_NETWORK_MACS


def _fastest_of(
    graph: ir.Graph,
    opset: int,
    opts: CompileOptions,
    policy: CodegenPolicy,
    config: Any,
    first: tuple[LoweredGraph, list[str], Planned],
) -> tuple[LoweredGraph, list[str], Planned]:
    """The schedule on every core or on `FEWER_CORES` of them (the others idle), whichever the
    cost model estimates faster: more cores must never make a network slower."""

    def latency(candidate: tuple[LoweredGraph, list[str], Planned]) -> float:
        return _latency(candidate[0], candidate[2], opts)

    fewer_config = dataclasses.replace(config, active_cores=FEWER_CORES)
    lowered = lower_graph(graph, opset, fewer_config)
    mxfp6 = encode_matmul_weights(lowered) if opts.mxfp6_matmul else []
    fewer = (lowered, mxfp6, plan_schedule(lowered, config.vtcm_budget, policy))
    return fewer if latency(fewer) < latency(first) else first


def _check_symbols_exist(imported: ImportedModel, spec: Specialization) -> None:
    """A specialization naming a symbol the model's inputs do not use is a typo, not a no-op
    (the vendor's LLM keys excepted: they describe the run, see `specializations`)."""
    unused = sorted(set(spec.symbols) - imported.input_symbols - VENDOR_KEYS)
    if unused:
        raise CompileError(
            "invalid_option",
            f"{SPEC_FLAG}: specialization {spec.name!r} binds {', '.join(unused)}, which no "
            f"input dimension of the model uses (symbols: "
            f"{', '.join(sorted(imported.input_symbols)) or 'none'}; LLM keys accepted as "
            f"well: {', '.join(sorted(VENDOR_KEYS))})",
            flag=SPEC_FLAG,
        )


def spec_name(spec: Specialization | None) -> str:
    return spec.name if spec is not None else "default"


def retained_state(builds: list[Build], opts: CompileOptions) -> list[str]:
    """With -retained-state, the inputs whose `<input>_RetainedState` output stays on the
    device and feeds them on the next run (a KV cache). Each pair must agree in type and
    shape, and in every specialization alike: the buffer is the same one."""
    if not opts.retained_state:
        return []
    names: list[str] | None = None
    shapes: dict[str, tuple[str, tuple[int, ...]]] = {}
    for build in builds:
        tensors = build.lowered.tensors
        inputs = {tensors[t].name: tensors[t] for t in build.lowered.inputs}
        pairs = []
        for t in build.lowered.outputs:
            out = tensors[t]
            if not out.name.endswith(RETAINED_SUFFIX):
                continue
            source = out.name[: -len(RETAINED_SUFFIX)]
            if source not in inputs:
                raise CompileError(
                    "invalid_model",
                    f"-retained-state: output {out.name!r} has no input named {source!r} to feed",
                    flag="-retained-state",
                )
            given = inputs[source]
            if (given.dtype, given.shape) != (out.dtype, out.shape):
                raise CompileError(
                    "invalid_model",
                    f"-retained-state: input {source!r} is {given.dtype}{list(given.shape)} "
                    f"but output {out.name!r} is {out.dtype}{list(out.shape)}",
                    flag="-retained-state",
                )
            previous = shapes.setdefault(source, (given.dtype, given.shape))
            if previous != (given.dtype, given.shape):
                raise CompileError(
                    "invalid_model",
                    f"-retained-state: {source!r} is {previous[0]}{list(previous[1])} in one "
                    f"specialization and {given.dtype}{list(given.shape)} in "
                    f"{spec_name(build.spec)!r}; retained buffers are shared",
                    flag="-retained-state",
                )
            pairs.append(source)
        if names is None:
            names = pairs
        elif sorted(names) != sorted(pairs):
            raise CompileError(
                "invalid_model",
                f"-retained-state: specialization {spec_name(build.spec)!r} retains "
                f"{sorted(pairs)}, the first retains {sorted(names)}",
                flag="-retained-state",
            )
    return names or []


def shared_constants(
    builds: list[Build],
) -> tuple[list[SharedConstants | None], list[tuple[LTensor, int]] | None]:
    """One constants region for every specialization: a weight all of them read is stored
    once. A single build lays out its own constants (None)."""
    if len(builds) == 1:
        return [None], None
    keys: list[dict[int, Hashable]] = []
    sizes: dict[Hashable, int] = {}
    first: dict[Hashable, LTensor] = {}
    for build in builds:
        graph_keys: dict[int, Hashable] = {}
        for tid in used_constants(build.lowered):
            t = build.lowered.tensors[tid]
            key = _constant_key(t)
            graph_keys[tid] = key
            sizes[key] = t.nbytes
            first.setdefault(key, t)
        keys.append(graph_keys)
    shared, placed = shared_constant_offsets(keys, sizes)
    return list(shared), [(first[key], offset) for key, offset in placed]


def _constant_key(t: LTensor) -> Hashable:
    """Equal keys mean equal bytes in the QPC: name, type, shape, encoding and contents (a
    weight still in the model file by its place there, anything else by a digest)."""
    encoding = ("mxfp6", t.block_axis) if isinstance(t, Mxfp6Tensor) else None
    data = t.data
    assert data is not None
    content: Hashable
    if isinstance(data, ir.ExternalTensor) and data.raw is None:
        content = ("file", os.path.realpath(data.path), data.offset or 0, data.length)
    else:
        array = np.ascontiguousarray(data.numpy())
        content = hashlib.blake2b(array.reshape(-1).view(np.uint8).data).hexdigest()
    return (t.name, t.dtype, t.shape, encoding, content)


def _warning(code: str, message: str, kind: str = KIND_OPTION) -> dict[str, Any]:
    return {"code": code, "message": message, "nodes": [], "suggestion": "", "kind": kind}


def output_dir(opts: CompileOptions) -> tuple[Path, tempfile.TemporaryDirectory[str] | None]:
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


def network_desc(builds: list[Build], opts: CompileOptions, retained: list[str]) -> NetworkDesc:
    """The first specialization's I/O at the top (what a single-program reader sees); every
    specialization with its own I/O and segments when there are several."""
    descs = [_program_io(b.done()[1]) for b in builds]
    inputs, outputs = descs[0]
    batch = inputs[0].dims[0] if inputs and inputs[0].dims else 1
    requirements = Requirements.merge(
        [Requirements.from_program(b.done()[1]) for b in builds], retained_state=retained
    )
    if any(isinstance(t, Mxfp6Tensor) for b in builds for t in b.lowered.tensors):
        dtypes = tuple(sorted({*requirements.dtypes, MXFP6}))  # a weight format it must read
        requirements = dataclasses.replace(requirements, dtypes=dtypes)
    specializations: tuple[SpecializationDesc, ...] = ()
    if len(builds) > 1:
        specializations = tuple(
            SpecializationDesc(
                name=spec_name(b.spec),
                symbols=dict(b.spec.symbols) if b.spec is not None else {},
                program=program_segment(index),
                statsdesc=statsdesc_segment(index),
                inputs=io[0],
                outputs=io[1],
            )
            for index, (b, io) in enumerate(zip(builds, descs, strict=True))
        )
    return NetworkDesc(
        network_name=builds[0].imported.model.graph.name or "network",
        compiler_version=COMPILER_VERSION,
        options=opts.to_json(),
        hw_version=opts.device.hw_version,
        num_cores=builds[0].done()[1].num_cores,
        batch_size=int(batch),
        inputs=inputs,
        outputs=outputs,
        requirements=requirements,
        specializations=specializations,
        stats={
            "level": opts.stats_level,
            "batchsize": opts.stats_batchsize,
            "ddr_stats": opts.ddr_stats,
            "pmu_recipe": opts.aic_pmu_recipe,
            "pmu_events": list(opts.aic_pmu_events),
        },
    )


def _program_io(program: Program) -> tuple[tuple[IODesc, ...], tuple[IODesc, ...]]:
    return (
        tuple(IODesc.from_tensor(program.tensors[t]) for t in program.inputs),
        tuple(IODesc.from_tensor(program.tensors[t]) for t in program.outputs),
    )


def _constants(
    items: list[tuple[LTensor, int]], size: int
) -> tuple[Iterator[memoryview], list[ConstantEntry]]:
    """The constants segment (lazily, tensor by tensor) and its descriptor, from the
    constants and their offsets in DDR order."""
    entries = []
    for t, offset in items:
        entry = ConstantEntry(t.name, t.dtype, t.shape, offset, t.nbytes)
        if isinstance(t, Mxfp6Tensor):
            entry = dataclasses.replace(entry, encoding=MXFP6, block_axis=t.block_axis)
        entries.append(entry)

    def chunks() -> Iterator[memoryview]:
        cursor = 0
        scratch = _Scratch()
        try:
            for entry, (t, _) in zip(entries, items, strict=True):
                if entry.offset > cursor:
                    yield memoryview(bytes(entry.offset - cursor))
                data = t.data
                assert data is not None
                if entry.encoding == MXFP6:
                    yield from _mxfp6_bytes(data, np.dtype(entry.dtype), entry.block_axis or 0)
                else:
                    yield from _tensor_bytes(data, np.dtype(entry.dtype), scratch)
                cursor = entry.offset + entry.nbytes
            if size > cursor:
                yield memoryview(bytes(size - cursor))
        finally:
            scratch.close()

    return chunks(), entries


_COPY_CHUNK = 8 << 20


class _Scratch:
    """One buffer the constants are read and folded into, reused from tensor to tensor: the
    writer copies each chunk out before it asks for the next, and a reused buffer's pages
    are already mapped (fresh ones fault in page by page, ~100 MB per ResNet-50), plus the
    files they are read from, opened once."""

    def __init__(self) -> None:
        self._buffer = np.empty(0, dtype=np.uint8)
        self.files: dict[str, BinaryIO] = {}

    def take(self, nbytes: int) -> np.ndarray:
        """The first `nbytes` of the buffer (its earlier contents are overwritten)."""
        if self._buffer.nbytes < nbytes:
            self._buffer = np.empty(nbytes, dtype=np.uint8)
        return self._buffer[:nbytes]

    def close(self) -> None:
        self._buffer = np.empty(0, dtype=np.uint8)
        for source in self.files.values():
            source.close()
        self.files.clear()


def _mxfp6_bytes(data: ir.TensorProtocol, dtype: np.dtype, axis: int) -> Iterator[memoryview]:
    """A weight's MXFP6 bytes, quantized from its values in the graph's dtype (fp16 ones,
    clipped to fp16's range, under -convert-to-fp16)."""
    array = np.asarray(data.numpy(), dtype=dtype)
    yield from iter_encode_mxfp6(array, axis)
    del array
    if isinstance(data, ir.ExternalTensor):
        release_mapping(data)


def _tensor_bytes(
    data: ir.TensorProtocol, dtype: np.dtype, scratch: _Scratch
) -> Iterator[memoryview]:
    """A constant's little-endian bytes, holding at most one tensor (or one file chunk).

    Weights still on disk (external data, or inline data the importer left in the model
    file) are read from the file in chunks, and folded weights scaled, in `scratch`;
    everything else is computed, yielded and let go, and memory-mapped sources are unmapped
    once read.
    """
    if isinstance(data, ScaledWeight) and data.scales_into(dtype):
        out = scratch.take(data.nbytes)
        data.scale_into(out, scratch.files)
        yield out.data
        return
    if isinstance(data, ir.ExternalTensor) and data.raw is None and data.dtype.numpy() == dtype:
        for done in range(0, data.nbytes, _COPY_CHUNK):
            chunk = scratch.take(min(_COPY_CHUNK, data.nbytes - done))
            read_into(data, chunk, scratch.files, done)
            yield chunk.data
        return
    mapped = isinstance(data, ir.ExternalTensor)
    array = np.array(data.numpy(), dtype=dtype, order="C", copy=mapped or None)
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    if mapped:
        release_mapping(data)
    yield memoryview(array.reshape(-1).view(np.uint8))  # type: ignore[arg-type]
