"""Perf metrics (`-aic-perf-metrics`) and perf warnings (`-aic-perf-warnings`) of a program.

Field names follow what the vendor compiler prints; every figure comes from the program and
the cost model's timeline, and the whole report is marked estimated.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from compiler_core.costmodel import Timeline, build_timeline
from compiler_core.devices import DeviceProfile
from compiler_core.lowering.lower import LoweredGraph
from compiler_core.lowering.memory import MemoryPlan
from compiler_core.lowering.program import Program, SemWait
from compiler_core.options import CompileOptions

IDLE_SHARE = 0.5
"""A core busy less than this share of the busiest core's time is reported idle."""
IMBALANCE = 1.5
"""A kernel whose busiest core works this many times the mean is reported unbalanced."""


def _histogram(program: Program) -> list[dict[str, Any]]:
    sizes = sorted(
        int(np.prod(k.info.out_shapes[0], dtype=np.int64)) if k.info.out_shapes else 0
        for k in program.kernels
    )
    rows: list[dict[str, Any]] = []
    bound, done = 1, 0
    while done < len(sizes):
        count = sum(1 for s in sizes if bound // 4 < s <= bound) if bound > 1 else sum(
            1 for s in sizes if s <= 1
        )
        done += count
        if count:
            rows.append(
                {
                    "output_elements_up_to": bound,
                    "ops": count,
                    "cumulative_percent": round(100.0 * done / len(sizes), 1),
                }
            )
        bound *= 4
    return rows


def _core_key(core: int) -> str:
    return f"c{core:02d}"


def perf_metrics(
    program: Program,
    lowered: LoweredGraph,
    plan: MemoryPlan,
    options: CompileOptions,
    device: DeviceProfile,
    timeline: Timeline | None = None,
) -> dict[str, Any]:
    timeline = timeline or build_timeline(program, device)
    hmx = sum(k.macs for k in program.kernels if k.unit == "hmx")
    non_hmx = sum(k.macs for k in program.kernels if k.unit != "hmx")
    traffic = {
        _core_key(c): {
            "ddr_read_bytes": timeline.ddr_read[c],
            "ddr_read_constant_only_bytes": timeline.ddr_read_constant[c],
            "ddr_write_bytes": timeline.ddr_write[c],
        }
        for c in range(program.num_cores)
    }
    barriers = [sum(isinstance(i, SemWait) for i in s) for s in program.streams]
    latency = timeline.latency_seconds
    batch = 1
    if program.inputs:
        shape = program.tensors[program.inputs[0]].shape
        batch = int(shape[0]) if shape else 1
    return {
        "estimated": True,
        "device": device.name,
        "num_cores": program.num_cores,
        "original_mac_estimate": hmx + non_hmx,
        "aic_hmx_mac_estimate": hmx,
        "aic_non_hmx_mac_estimate": non_hmx,
        "operation_size_histogram": _histogram(program),
        "constants_size_before_layout_conversion": plan.constants_size,
        "constants_size_after_layout_conversion": plan.constants_size,
        "final_constants_size": plan.constants_size,
        "vtcm_size_per_core": {_core_key(c): v for c, v in enumerate(program.vtcm_used)},
        "vtcm_max_size": device.vtcm_bytes_per_core,
        "static_shared_ddr_size": plan.io_size + plan.activations_size,
        "dynamic_shared_ddr_size": 0,
        "static_constants_size": plan.constants_size,
        "dynamic_constants_size": 0,
        "ddr_size": program.ddr_size,
        "memory_traffic": {
            "per_core": traffic,
            "total": {
                "ddr_read_bytes": sum(timeline.ddr_read),
                "ddr_read_constant_only_bytes": sum(timeline.ddr_read_constant),
                "ddr_write_bytes": sum(timeline.ddr_write),
            },
        },
        "barriers_per_core": {_core_key(c): b for c, b in enumerate(barriers)},
        "kernels": len(program.kernels),
        "specialized_kernels": len({k.kernel for k in program.kernels}),
        "instructions_per_core": {_core_key(c): len(s) for c, s in enumerate(program.streams)},
        "core_busy_cycles": {_core_key(c): b for c, b in enumerate(timeline.core_busy)},
        "estimated_cycles": timeline.total_cycles,
        "estimated_latency_us": round(latency * 1e6, 3),
        "estimated_inferences_per_second": round(batch / latency, 2) if latency else None,
    }


def _warning(code: str, message: str, nodes: list[str], suggestion: str) -> dict[str, Any]:
    return {"code": code, "message": message, "nodes": nodes, "suggestion": suggestion}


def perf_warnings(
    program: Program,
    lowered: LoweredGraph,
    options: CompileOptions,
    device: DeviceProfile,
    timeline: Timeline | None = None,
) -> list[dict[str, Any]]:
    """Specific, actionable warnings; only computed when `-aic-perf-warnings` is given."""
    if not options.aic_perf_warnings:
        return []
    timeline = timeline or build_timeline(program, device)
    out: list[dict[str, Any]] = []
    fp32 = [k for k in program.kernels if k.unit == "hmx" and "float32" in k.info.out_dtypes]
    if fp32:
        out.append(
            _warning(
                "fp32_compute",
                f"{len(fp32)} HMX kernel(s) compute in fp32, which the tensor unit does not "
                "support natively (estimated 16x slower than fp16)",
                [n for k in fp32[:5] for n in k.nodes],
                "compile with -convert-to-fp16",
            )
        )
    busiest = max(timeline.core_busy, default=0)
    idle = [c for c, b in enumerate(timeline.core_busy) if busiest and b < IDLE_SHARE * busiest]
    if idle:
        out.append(
            _warning(
                "idle_cores",
                f"core(s) {', '.join(_core_key(c) for c in idle)} are busy less than "
                f"{int(IDLE_SHARE * 100)}% of the busiest core's time",
                [],
                f"compile for fewer cores (-aic-num-cores={max(1, program.num_cores - len(idle))})"
                " or split finer (-ols=2)",
            )
        )
    per_kernel: dict[int, Counter[int]] = {}
    for span in timeline.spans:
        per_kernel.setdefault(span.kernel, Counter())[span.core] += span.end - span.start
    total = max(1, timeline.total_cycles)
    for kid, by_core in sorted(per_kernel.items()):
        if program.num_cores < 2 or len(by_core) < 2:
            continue
        values = list(by_core.values())
        mean = sum(values) / program.num_cores
        heavy = max(values) > total * 0.02
        if heavy and mean and max(values) > IMBALANCE * mean:
            k = program.kernels[kid]
            out.append(
                _warning(
                    "unbalanced_split",
                    f"kernel {k.name} ({k.op_types[0]}) runs {len(by_core)} of "
                    f"{program.num_cores} cores with the busiest at "
                    f"{max(values) / mean:.1f}x the mean",
                    list(k.nodes),
                    "try -ols=2 or a different -mos",
                )
            )
    for lk in lowered.kernels:
        reread = sum(
            int(np.prod([b - a for a, b in box], dtype=np.int64))
            for tile in lk.tiles
            for tid, box in zip(lk.desc.inputs, tile.in_boxes, strict=True)
            if tid >= 0 and box is not None and lowered.tensors[tid].kind == "constant"
        )
        weights = sum(
            int(np.prod(lowered.tensors[t].shape, dtype=np.int64))
            for t in set(lk.desc.inputs)
            if t >= 0 and lowered.tensors[t].kind == "constant"
        )
        if weights and reread > 4 * weights and weights > 65536:
            out.append(
                _warning(
                    "weights_reread",
                    f"kernel {lk.desc.name} reads its constants {reread / weights:.1f} times "
                    f"from DDR because its {len(lk.tiles)} tiles each need them",
                    list(lk.desc.nodes),
                    "raise -vtcm-working-set-limit-ratio or allow an output-channel split (-mos)",
                )
            )
    return out
