"""Perf metrics (`-aic-perf-metrics`) and perf warnings (`-aic-perf-warnings`) of a program.

Field names follow what the vendor compiler prints; every figure comes from the program and
the cost model's timeline, and the whole report is marked estimated. Warnings are specific:
each has a stable code, the ONNX nodes concerned and the flag or change that would help.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from compiler_core.cost_rates import THREADS
from compiler_core.cost_timeline import Timeline, build_timeline
from compiler_core.devices import DeviceProfile
from compiler_core.lowering.lowered import LoweredGraph
from compiler_core.lowering.memory import ALIGN, MemoryPlan
from compiler_core.lowering.program import (
    KIND_ACTIVATION,
    KIND_CONSTANT,
    DmaGather,
    DmaLoad,
    DmaScatter,
    DmaStore,
    KernelDesc,
    NocCopy,
    Program,
    SemWait,
    box_nbytes,
    gathered_bytes,
    scattered_bytes,
    stored_bytes,
)
from compiler_core.ops.registry import Box
from compiler_core.options import CompileOptions

IDLE_SHARE = 0.5
"""A core busy less than this share of the busiest core's time is reported idle."""
IMBALANCE = 1.5
"""A kernel whose busiest core works this many times the mean is reported unbalanced."""
HEAVY_SHARE = 0.02
"""Kernels below this share of the estimated inference time are not worth a warning."""
MAX_NODES = 8
"""Nodes named per warning (the heaviest first)."""


def _histogram(program: Program) -> list[dict[str, Any]]:
    """Kernels by output size in buckets of powers of four (1, 4, 16, ...). Each size finds
    its bucket on its own, in Python integers: any size (even a negative or absurd one that
    slipped past the importer) ends in one bucket, so this always terminates."""
    sizes = [
        math.prod(int(d) for d in k.info.out_shapes[0]) if k.info.out_shapes else 0
        for k in program.kernels
    ]
    buckets: dict[int, int] = {}
    for size in sizes:
        bound = 1
        while bound < size:
            bound *= 4
        buckets[bound] = buckets.get(bound, 0) + 1
    rows: list[dict[str, Any]] = []
    done = 0
    for bound in sorted(buckets):
        done += buckets[bound]
        rows.append(
            {
                "output_elements_up_to": bound,
                "ops": buckets[bound],
                "cumulative_percent": round(100.0 * done / len(sizes), 1),
            }
        )
    return rows


def _core_key(core: int) -> str:
    return f"c{core:02d}"


def _base_macs(kernel: KernelDesc) -> int:
    """MACs of the base op: `macs` also counts one operation per element per epilogue step."""
    out = int(np.prod(kernel.info.out_shapes[0], dtype=np.int64)) if kernel.info.out_shapes else 0
    return max(0, kernel.macs - out * len(kernel.epilogue))


def _batch(program: Program) -> int:
    if program.inputs:
        shape = program.tensors[program.inputs[0]].shape
        return int(shape[0]) if shape else 1
    return 1


def _percent(part: float, whole: float) -> float:
    return round(100.0 * part / whole, 1) if whole else 0.0


def _raw_constants_size(lowered: LoweredGraph, plan: MemoryPlan) -> int:
    """The constants region as it would be with every constant stored raw, in its graph dtype:
    what encodings (`-mxfp6-matmul`) shrink to `final_constants_size`."""
    size = 0
    for tid in plan.constant_order:
        t = lowered.tensors[tid]
        n = int(np.prod(t.shape, dtype=np.int64)) * np.dtype(t.dtype).itemsize
        size = (size + n + ALIGN - 1) // ALIGN * ALIGN
    return size


def _image_groups(lowered: LoweredGraph) -> int:
    """How many image groups the depth-first schedule runs the network in (1: batch-major)."""
    clones = sum(1 for k in lowered.kernels if k.layer >= 0)
    layers = len({k.layer for k in lowered.kernels if k.layer >= 0})
    return clones // layers if layers else 1


def perf_metrics(
    program: Program,
    lowered: LoweredGraph,
    plan: MemoryPlan,
    options: CompileOptions,
    device: DeviceProfile,
    timeline: Timeline | None = None,
) -> dict[str, Any]:
    """The vendor's perf-metrics figures plus latency and throughput, all estimated."""
    timeline = timeline or build_timeline(program, device)
    hmx = sum(_base_macs(k) for k in program.kernels if k.unit == "hmx")
    total_macs = sum(k.macs for k in program.kernels)
    cores = program.num_cores
    barriers = [sum(isinstance(i, SemWait) for i in s) for s in program.streams]
    latency = timeline.latency_seconds
    total = max(1, timeline.total_cycles)
    busy, waited = timeline.core_busy, timeline.core_wait
    per_core: list[dict[str, Any]] = []
    unit_busy: dict[str, int] = dict.fromkeys(("hmx", "hvx", "dma"), 0)
    for c in range(cores):
        threads = timeline.thread_busy(c)
        hvx = max(threads[t] for t in THREADS[:4])
        unit_busy["hmx"] += threads["hmx"]
        unit_busy["hvx"] += hvx
        unit_busy["dma"] += threads["dma"]
        per_core.append(
            {
                "core": _core_key(c),
                "vtcm_bytes": program.vtcm_used[c],
                "barriers": barriers[c],
                "instructions": len(program.streams[c]),
                "busy_cycles": busy[c],
                "wait_cycles": waited[c],
                "hmx_busy_%": _percent(threads["hmx"], total),
                "hvx_busy_%": _percent(hvx, total),
                "dma_busy_%": _percent(threads["dma"], total),
            }
        )
    traffic_rows = [
        {
            "core": _core_key(c),
            "ddr_read_bytes": timeline.ddr_read[c],
            "constant_only_bytes": timeline.ddr_read_constant[c],
            "activation_read_bytes": timeline.ddr_read[c] - timeline.ddr_read_constant[c],
            "ddr_write_bytes": timeline.ddr_write[c],
            "multicast_bytes": timeline.multicast[c],
            "noc_bytes": timeline.noc[c],
        }
        for c in range(cores)
    ]
    floors = physical_floors(program, device)
    # Throughput with the host queueing inferences (the vendor's set size): the next input
    # crosses PCIe while this inference runs, so the device's own time or the transfers bound it.
    device_latency = build_timeline(program, device, inputs_ready=True).latency_seconds
    host_in, host_out = program.host_ports()  # retained state stays on the device
    host = (
        sum(program.tensors[t].nbytes for t in (*host_in, *host_out)) / device.soc_link_bytes_per_s
    )
    useful = sum(r.hmx_macs for r in timeline.runs)
    padded = sum(r.hmx_padded_macs for r in timeline.runs)
    peak_cycles = device.hmx_fp16_macs_per_cycle * cores * total
    ports = _port_traffic(program)
    stats_size = plan.ddr_size - plan.constants_size - plan.io_size - plan.activations_size
    by_unit = Counter(k.unit for k in program.kernels)
    return {
        "estimated": True,
        "device": device.name,
        "num_cores": cores,
        "clock_mhz": round(device.clock_hz / 1e6, 1),
        "original_mac_estimate": total_macs,
        "aic_hmx_mac_estimate": hmx,
        "aic_non_hmx_mac_estimate": total_macs - hmx,
        "operation_size_histogram": _histogram(program),
        "constants_size_before_layout_conversion": _raw_constants_size(lowered, plan),
        "constants_size_after_layout_conversion": plan.constants_size,
        "final_constants_size": plan.constants_size,
        "vtcm_max_size": device.vtcm_bytes_per_core,
        "vtcm_max_used": max(program.vtcm_used, default=0),
        "static_shared_ddr_size": plan.io_size + plan.activations_size,
        "dynamic_shared_ddr_size": 0,
        "static_constants_size": plan.constants_size,
        "dynamic_constants_size": 0,
        "multicast_static_va_size_max": _largest_multicast(program),
        "resident_constants_bytes_per_core": program.resident,
        "resident_constants_bytes": _resident_total(program),
        "depth_first_groups": _image_groups(lowered),
        "activation_ddr_read_bytes": sum(timeline.activation_ddr_read),
        "activation_cycles": max(timeline.activation_cycles, default=0),
        "stats_buffer_size": stats_size,
        "ddr_size": program.ddr_size,
        "memory_traffic": {
            "per_port": ports,
            "per_core": traffic_rows,
            "total": {
                "ddr_read_bytes": sum(timeline.ddr_read),
                "ddr_read_constant_only_bytes": sum(timeline.ddr_read_constant),
                "activation_spill_read_bytes": sum(timeline.ddr_read)
                - sum(timeline.ddr_read_constant),
                "ddr_write_bytes": sum(timeline.ddr_write),
                "multicast_bytes": sum(timeline.multicast),
                "noc_bytes": sum(timeline.noc),
            },
        },
        "hmx_useful_macs": useful,
        "hmx_padded_macs": padded,
        "hmx_utilization_percent": _percent(useful, peak_cycles),
        "floor_compute_us": round(floors.compute_cycles / device.clock_hz * 1e6, 3),
        "floor_ddr_us": round(floors.ddr_cycles / device.clock_hz * 1e6, 3),
        "floor_ddr_bytes": floors.ddr_bytes,
        "latency_over_floor": round(total / max(1, floors.cycles), 2),
        "per_core": per_core,
        "kernels": len(program.kernels),
        "kernels_hmx": by_unit.get("hmx", 0),
        "kernels_hvx": by_unit.get("hvx", 0),
        "kernels_fused_nodes": sum(len(k.nodes) for k in program.kernels),
        "precision": kernel_precisions(program),
        "specialized_kernels": len({k.kernel for k in program.kernels}),
        "unit_busy_percent": {u: _percent(b, total * cores) for u, b in unit_busy.items()},
        "estimated_cycles": timeline.total_cycles,
        "estimated_latency_us": round(latency * 1e6, 3),
        "estimated_device_latency_us": round(device_latency * 1e6, 3),
        "host_transfer_us": round(host * 1e6, 3),
        "host_bytes": sum(program.tensors[t].nbytes for t in (*host_in, *host_out)),
        "host_buffers": len(host_in) + len(host_out),
        "estimated_inferences_per_second": (
            round(_batch(program) / max(device_latency, host), 2) if latency else None
        ),
    }


PRECISIONS = {
    "int8": "int8",
    "uint8": "int8",
    "int16": "int16",
    "uint16": "int16",
    "float16": "fp16",
    "bfloat16": "bf16",
    "float32": "fp32",
    "float64": "fp64",
}


def kernel_precision(kernel: KernelDesc) -> str:
    """What a kernel computes in: its first input's number type (an int8 kernel reads int8
    and may write int32 or float), else its output's; `other` for bool/index work."""
    info = kernel.info
    for dtype in (*info.in_dtypes[:1], *info.out_dtypes[:1]):
        if dtype in PRECISIONS:
            return PRECISIONS[dtype]
    return "other"


def kernel_precisions(program: Program) -> dict[str, Any]:
    """Kernels, MACs and ONNX node names by the precision they run in (a quantized compile
    says here which nodes run int8, fp16 or fp32)."""
    out: dict[str, Any] = {}
    for k in program.kernels:
        entry = out.setdefault(
            kernel_precision(k), {"kernels": 0, "macs": 0, "hmx_macs": 0, "nodes": []}
        )
        entry["kernels"] += 1
        entry["macs"] += k.macs
        entry["hmx_macs"] += _base_macs(k) if k.unit == "hmx" else 0
        entry["nodes"].extend(k.nodes)
    return dict(sorted(out.items()))


@dataclass(frozen=True)
class Floors:
    """What no schedule of this program on this device can beat (cycles)."""

    compute_cycles: int
    """Every MAC at the peak rate of its precision on every core, every HVX element at the
    HVX peak."""
    ddr_bytes: int
    """Bytes that must cross DDR each inference: inputs, outputs and every constant byte
    that is not resident on chip; of retained state (a KV cache), the bytes the program reads
    of it (each once) and the rows it writes."""
    ddr_cycles: int

    @property
    def cycles(self) -> int:
        return max(self.compute_cycles, self.ddr_cycles)


def physical_floors(program: Program, device: DeviceProfile) -> Floors:
    from compiler_core.cost_rates import compute_dtype, hmx_rate

    cores = program.num_cores
    compute = 0.0
    for k in program.kernels:
        base = _base_macs(k)
        out = int(np.prod(k.info.out_shapes[0], dtype=np.int64)) if k.info.out_shapes else 0
        epilogue = out * len(k.epilogue)
        dtype = k.info.out_dtypes[0] if k.info.out_dtypes else "float32"
        hvx = device.hvx_threads * 128 / max(1, np.dtype(dtype).itemsize)
        if k.unit == "hmx":
            rate = hmx_rate(device, compute_dtype(k.info.in_dtypes, k.info.out_dtypes))
            compute += max(base / rate, epilogue / hvx)
        else:
            compute += (base + epilogue) / hvx
    host_in, host_out = program.host_ports()
    io = sum(program.tensors[t].nbytes for t in (*host_in, *host_out))
    resident = {i.tensor for s in program.setup for i in s if isinstance(i, DmaLoad)}
    state = _retained_offsets(program)
    streamed: dict[int, set[Box]] = {}
    state_read: dict[int, set[Box]] = {}
    state_gathered: dict[int, int] = {}
    written = 0
    for stream in program.streams:
        for instr in stream:
            if isinstance(instr, DmaLoad):
                t = program.tensors[instr.tensor]
                if t.kind == KIND_CONSTANT and instr.tensor not in resident:
                    streamed.setdefault(instr.tensor, set()).add(instr.box)
                elif t.ddr_offset in state and t.nbytes == state[t.ddr_offset]:
                    state_read.setdefault(instr.tensor, set()).add(instr.box)
            elif isinstance(instr, DmaGather) and program.tensors[instr.tensor].ddr_offset in state:
                t = program.tensors[instr.tensor]  # a cache's slots gathered (by batch_index)
                state_gathered[instr.tensor] = state_gathered.get(instr.tensor, 0) + (
                    gathered_bytes(t, instr)
                )
            elif isinstance(instr, DmaScatter | DmaStore):
                t = program.tensors[instr.tensor]
                if t.ddr_offset in state:
                    written += (
                        scattered_bytes(program, instr)
                        if isinstance(instr, DmaScatter)
                        else box_nbytes(instr.box, t.dtype)
                    )
    constant = 0
    for tid, boxes in streamed.items():
        t = program.tensors[tid]
        constant += min(t.nbytes, sum(stored_bytes(t, b) for b in boxes))
    for tid, boxes in state_read.items():
        t = program.tensors[tid]
        constant += min(t.nbytes, sum(stored_bytes(t, b) for b in boxes))
    for tid, nbytes in state_gathered.items():
        constant += min(program.tensors[tid].nbytes, nbytes)
    ddr_bytes = io + constant + written
    ddr_cycles = int(ddr_bytes / device.ddr_bandwidth_bytes_per_s * device.clock_hz)
    return Floors(int(compute / max(1, cores)), ddr_bytes, ddr_cycles)


def _retained_offsets(program: Program) -> dict[int, int]:
    """DDR offset -> bytes of every retained-state buffer (input and output share it, or the
    output is copied into the input on the device)."""
    out: dict[int, int] = {}
    for i, o in program.retained.items():
        for tid in (i, o):
            t = program.tensors[tid]
            out[t.ddr_offset] = t.nbytes
    return out


def _largest_multicast(program: Program) -> int:
    """The largest buffer a multicast fills (the vendor's MulticastStaticVASizeMax)."""
    sizes = [
        box_nbytes(i.buf_box, program.tensors[i.tensor].dtype)
        for s in (*program.streams, *program.setup)
        for i in s
        if isinstance(i, DmaLoad | NocCopy) and i.cores & (i.cores - 1)
    ]
    return max(sizes, default=0)


def _resident_total(program: Program) -> int:
    """Bytes of constants resident over all cores (each core's copy counted)."""
    total = 0
    for stream in program.setup:
        for instr in stream:
            if isinstance(instr, DmaLoad):
                nbytes = box_nbytes(instr.box, program.tensors[instr.tensor].dtype)
                total += nbytes * bin(instr.cores).count("1")
    return total


def _port_traffic(program: Program) -> list[dict[str, Any]]:
    """Host ports: bytes the host moves per inference and DDR bytes the cores move for them."""
    rows = []
    kept = {*program.retained, *program.retained.values()}
    for direction, ids in (("in", program.inputs), ("out", program.outputs)):
        for tid in ids:
            t = program.tensors[tid]
            host = 0 if tid in kept else t.nbytes  # retained state never leaves the device
            row: dict[str, Any] = {
                "port": t.name,
                "direction": direction,
                "host_bytes": host,
                "ddr_read_bytes": host if direction == "in" else 0,
                "ddr_write_bytes": host if direction == "out" else 0,
            }
            if tid in kept:
                row["retained"] = True
            rows.append(row)
    return rows


def _warning(code: str, message: str, nodes: list[str], suggestion: str) -> dict[str, Any]:
    return {"code": code, "message": message, "nodes": nodes, "suggestion": suggestion}


def pmu_warnings(options: CompileOptions) -> list[dict[str, Any]]:
    """Events outside the modelled catalogue are accepted but count nothing: say so always."""
    from compiler_core.profiling.pmu import unknown_events

    unknown = unknown_events(options.aic_pmu_events)
    if not unknown:
        return []
    return [
        _warning(
            "pmu_event_not_modelled",
            f"PMU event(s) {', '.join('0x' + e for e in unknown)} are not in the modelled NSP's "
            "catalogue: accepted, but they count zero on this device model",
            [],
            "use ids from docs/profiling.md (PMU catalogue) or -aic-pmu-recipe=KernelUtil",
        )
    ]


@dataclass
class _Facts:
    """What the warnings look at: the program, its timeline and per-kernel totals."""

    program: Program
    lowered: LoweredGraph
    options: CompileOptions
    device: DeviceProfile
    timeline: Timeline
    per_kernel: dict[int, Counter[int]] = field(default_factory=lambda: defaultdict(Counter))
    dma: Counter[int] = field(default_factory=Counter)
    compute: Counter[int] = field(default_factory=Counter)
    act_read: Counter[int] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self.computing: dict[int, set[int]] = defaultdict(set)
        """Cores that run tiles of each kernel (others may only move its data)."""
        for run in self.timeline.runs:
            if run.tiles:
                self.computing[run.kernel].add(run.core)
            self.per_kernel[run.kernel][run.core] += run.cycles
            self.dma[run.kernel] += run.dma_cycles
            self.compute[run.kernel] += run.compute_cycles
            self.act_read[run.kernel] += run.read_spill_bytes
        self.span = {k: max(v.values()) for k, v in self.per_kernel.items()}
        self.total = max(1, self.timeline.total_cycles)

    def nodes_of(self, kernels: list[int]) -> list[str]:
        """ONNX nodes of the kernels, heaviest kernel first."""
        ordered = sorted(kernels, key=lambda k: -self.span.get(k, 0))
        return [n for k in ordered for n in self.program.kernels[k].nodes][:MAX_NODES]

    def share(self, kernels: list[int]) -> float:
        return 100.0 * sum(self.span.get(k, 0) for k in kernels) / self.total


def perf_warnings(
    program: Program,
    lowered: LoweredGraph,
    options: CompileOptions,
    device: DeviceProfile,
    timeline: Timeline | None = None,
) -> list[dict[str, Any]]:
    """Specific, actionable warnings; computed only when `-aic-perf-warnings` is given (the
    PMU note always)."""
    out = pmu_warnings(options)
    if not options.aic_perf_warnings:
        return out
    facts = _Facts(program, lowered, options, device, timeline or build_timeline(program, device))
    out += _fp32(facts)
    out += _spill(facts)
    out += _vtcm_split(facts)
    out += _idle(facts)
    out += _unbalanced(program, facts.per_kernel, facts.total)
    out += _weights_streamed(facts)
    return out


def _fp32(f: _Facts) -> list[dict[str, Any]]:
    program, options, span, nodes_of, share = f.program, f.options, f.span, f.nodes_of, f.share
    fp32 = [
        k.id
        for k in program.kernels
        if "float32" in k.info.out_dtypes and (k.unit == "hmx" or k.macs > 0)
    ]
    fp32 = [k for k in fp32 if span.get(k, 0) > 0]
    if not fp32 or options.convert_to_fp16:
        return []
    hmx = [k for k in fp32 if program.kernels[k].unit == "hmx"]
    return [
        _warning(
            "fp32_compute",
            f"{len(fp32)} kernel(s) compute in fp32 ({len(hmx)} on HMX, which has no fp32 path: "
            f"estimated 16x slower than fp16); they take an estimated {share(fp32):.0f}% of the "
            "inference",
            nodes_of(fp32),
            "compile with -convert-to-fp16 (or keep only sensitive nodes in fp32)",
        )
    ]


def _spill(f: _Facts) -> list[dict[str, Any]]:
    """Intermediate activations that did not fit on chip: written to DDR and read back."""
    program, nodes_of, share = f.program, f.nodes_of, f.share
    spilled = {t.id for t in program.tensors if t.kind == KIND_ACTIVATION and t.nbytes > 0}
    producers = [k.id for k in program.kernels if any(t in spilled for t in k.outputs)]
    readers = [k for k, n in f.act_read.items() if n > 0]
    if not producers or not readers:
        return []
    moved = sum(f.act_read.values())
    size = sum(program.tensors[t].nbytes for t in spilled)
    involved = producers + [k for k in readers if k not in producers]
    if any("float32" in program.kernels[k].info.out_dtypes for k in producers):
        hint = "-convert-to-fp16 halves these activations, so more of them stay on chip"
    elif program.num_cores < 16:
        hint = "more cores (-aic-num-cores) give the activations more VTCM to stay in"
    else:
        hint = "a smaller batch (-batchsize) keeps less on chip at once"
    batch = program.tensors[program.inputs[0]].shape[:1] if program.inputs else ()
    if batch and batch[0] > 1 and not f.options.aic_enable_depth_first:
        hint += "; -aic-enable-depth-first runs the batch in groups of images that fit"
    return [
        _warning(
            "spill_to_ddr",
            f"{len(spilled)} activation(s) ({size / 2**20:.1f} MiB) do not fit in VTCM next to "
            f"the rest and go through DDR: {moved / 2**20:.1f} MiB are read back per inference "
            f"(the kernels involved take an estimated {share(involved):.0f}% of the inference)",
            nodes_of(producers) + [n for n in nodes_of(readers) if n not in nodes_of(producers)],
            hint,
        )
    ]


def _vtcm_split(f: _Facts) -> list[dict[str, Any]]:
    lowered, options, device, nodes_of = f.lowered, f.options, f.device, f.nodes_of
    budget = int(device.vtcm_bytes_per_core * options.vtcm_working_set_limit_ratio)
    parallel = options.aic_num_cores * max(1, options.ols)
    cut = []
    worst = 0
    for index, lk in enumerate(lowered.kernels):
        whole = sum(
            lowered.tensors[t].nbytes for t in (*lk.desc.inputs, *lk.desc.outputs) if t >= 0
        )
        if whole > budget and len(lk.tiles) > parallel:
            cut.append(index)
            worst = max(worst, whole)
    if not cut:
        return []
    if options.vtcm_working_set_limit_ratio < 1.0:
        hint = (
            "raise -vtcm-working-set-limit-ratio (now "
            f"{options.vtcm_working_set_limit_ratio:g}) so fewer, larger tiles are needed"
        )
    elif not options.convert_to_fp16:
        hint = "-convert-to-fp16 halves the working set, so fewer tiles are needed"
    else:
        hint = "spread the kernel over more cores (-aic-num-cores) or reduce its tensor sizes"
    return [
        _warning(
            "vtcm_overflow_split",
            f"{len(cut)} kernel(s) do not fit VTCM ({budget / 2**20:.1f} MiB per core) whole; "
            f"the largest needs {worst / 2**20:.1f} MiB and each is cut into more tiles than "
            f"cores ({parallel}), re-loading shared operands per tile",
            nodes_of(cut),
            hint,
        )
    ]


def _idle(f: _Facts) -> list[dict[str, Any]]:
    program, timeline, per_kernel = f.program, f.timeline, f.per_kernel
    span, total, nodes_of = f.span, f.total, f.nodes_of
    out = []
    busy = timeline.core_busy
    busiest = max(busy, default=0)
    idle = [c for c, b in enumerate(busy) if busiest and b < IDLE_SHARE * busiest]
    serial = [
        k
        for k in per_kernel
        if program.num_cores > 1 and len(f.computing[k]) == 1 and span[k] > HEAVY_SHARE * total
    ]
    if idle:
        out.append(
            _warning(
                "idle_cores",
                f"core(s) {', '.join(_core_key(c) for c in idle)} are busy less than "
                f"{int(IDLE_SHARE * 100)}% of the busiest core's estimated time",
                nodes_of(serial),
                f"compile for fewer cores (-aic-num-cores={max(1, program.num_cores - len(idle))})"
                " or split finer (-ols=2)",
            )
        )
    if serial:
        kinds = sorted({program.kernels[k].op_types[0] for k in serial})
        out.append(
            _warning(
                "serial_kernel",
                f"{len(serial)} kernel(s) ({', '.join(kinds)}) run on a single core while "
                f"{program.num_cores - 1} others wait; estimated "
                f"{100.0 * sum(span[k] for k in serial) / total:.0f}% of the inference",
                nodes_of(serial),
                "these ops have no split axis in this compiler; fuse or replace them, or "
                "accept the serial step",
            )
        )
    return out


def _unbalanced(
    program: Program, per_kernel: dict[int, Counter[int]], total: int
) -> list[dict[str, Any]]:
    out = []
    for kid, by_core in sorted(per_kernel.items()):
        if program.num_cores < 2 or len(by_core) < 2:
            continue
        values = list(by_core.values())
        mean = sum(values) / len(values)
        if max(values) > total * HEAVY_SHARE and mean and max(values) > IMBALANCE * mean:
            k = program.kernels[kid]
            out.append(
                _warning(
                    "unbalanced_split",
                    f"kernel {k.name} ({k.op_types[0]}) runs on {len(by_core)} of "
                    f"{program.num_cores} cores with the busiest at {max(values) / mean:.1f}x "
                    "the mean (estimated)",
                    list(k.nodes),
                    "try -ols=2 (more, smaller tiles) or a different -mos",
                )
            )
    return out


def _weights_streamed(f: _Facts) -> list[dict[str, Any]]:
    """Weights that did not fit on chip next to the rest: streamed from DDR every inference."""
    program = f.program
    per_kernel: Counter[int] = Counter()
    for run in f.timeline.runs:
        per_kernel[run.kernel] += run.read_constant_bytes
    streamed = [k for k, n in per_kernel.items() if n > 0]
    if not streamed:
        return []
    moved = sum(per_kernel.values())
    resident = _resident_total(program)
    cores = program.num_cores
    streamed.sort(key=lambda k: -per_kernel[k])
    nodes = [n for k in streamed for n in program.kernels[k].nodes][:MAX_NODES]
    if f.options.mxfp6_matmul or not any(
        t in ("MatMul", "Gemm") for k in streamed for t in program.kernels[k].op_types
    ):
        hint = "compile for more cores (-aic-num-cores) to hold more weights on chip"
    else:
        hint = "-mxfp6-matmul stores MatMul/Gemm weights in 6.25 bits, so more stay resident"
    return [
        _warning(
            "weights_streamed",
            f"{len(streamed)} kernel(s) stream {moved / 2**20:.1f} MiB of weights from DDR "
            f"every inference (estimated {f.share(streamed):.0f}% of the inference): they do "
            f"not fit in VTCM beside the {program.resident / 2**20:.1f} MiB per core already "
            f"resident ({resident / 2**20:.1f} MiB on {cores} core(s))",
            nodes,
            hint + "; a larger batch (-batchsize) streams them once for more inferences",
        )
    ]
