"""`qpcfarm opstats`: raw stats buffers of a QPC -> per-operator summary and a Chrome trace.

Like the vendor's `qaic-opstats --qpc --input-dir --output-dir --summary --trace`, it needs a
QPC compiled with `-stats-level=70` or more (per-operator cycles). Every row and span names the
ONNX nodes and op types of its kernel, so a fused kernel (Conv+Relu...) traces back to its
nodes. Summary figures are per inference: cycles and bytes divided by the stats batch size
(`-stats-batchsize`, default the batch size). The trace shows the raw device timeline. All of it
is estimated: the runtime fills the buffers from the cost model of a modelled device.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from compiler_core.errors import CompileError
from compiler_core.profiling.pmu import event_name
from compiler_core.profiling.stats_layout import (
    CORE_THREAD_FIELDS,
    OP_FIELDS,
    StatsLayout,
    decode_stats,
)

OPSTATS_LEVEL = 70
_STATS_FILE = re.compile(r"stats-inf-(\d+)\.bin$")


@dataclass(frozen=True)
class OpRecord:
    """One operator (kernel) on one core; figures per inference, mean over inferences."""

    core: int
    kernel: int
    name: str
    nodes: tuple[str, ...]
    op_types: tuple[str, ...]
    unit: str
    library_kernel: str
    start: float
    cycles: float
    wait_before: float
    share_percent: float
    """Of this core's inference duration."""
    output_bytes: int
    tiles: int
    compute_cycles: float
    dma_cycles: float
    read_bytes: float
    write_bytes: float
    pmu: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class CoreRecord:
    core: int
    inference_pcycles: float
    activation_pcycles: float
    thread_ucycles: dict[str, float]
    pmu: dict[str, dict[str, float]] = field(default_factory=dict)
    """thread -> event name -> count (level >= 40 with a recipe or events)."""
    ddr: dict[str, float] = field(default_factory=dict)


@dataclass
class OpStats:
    network: str
    level: int
    batchsize: int
    clock_hz: int
    inferences: int
    layout: StatsLayout
    cores: list[CoreRecord]
    ops: list[OpRecord]
    ports: list[dict[str, Any]]
    raw: list[dict[str, np.ndarray]] = field(repr=False)

    @property
    def inference_pcycles(self) -> float:
        return max((c.inference_pcycles for c in self.cores), default=0.0)

    def us(self, cycles: float) -> float:
        return cycles / self.clock_hz * 1e6 if self.clock_hz else 0.0


def read_stats_dir(input_dir: str | os.PathLike[str]) -> list[bytes]:
    """The raw buffers `qpcfarm run --profiling-out-dir` wrote, in inference order."""
    path = Path(input_dir)
    if not path.is_dir():
        raise CompileError("file_not_found", f"stats directory not found: {path}")
    found = sorted(
        (int(m.group(1)), p) for p in path.iterdir() if (m := _STATS_FILE.search(p.name))
    )
    if not found:
        raise CompileError(
            "no_stats",
            f"no raw stats (stats-inf-<n>.bin) in {path}: run the QPC with "
            "`qpcfarm run QPC --inputs IN.npz --profiling-out-dir DIR` first",
        )
    return [p.read_bytes() for _, p in found]


def _too_low(layout: StatsLayout) -> CompileError:
    have = ["per-core and per-thread inference and activation cycles"]
    if layout.pmu_events:
        have.append("PMU counters")
    if layout.ddr_stats:
        have.append("per-core DDR traffic")
    if layout.level >= 50:
        have.append("I/O doorbell waits and semaphore increments")
    return CompileError(
        "stats_level_too_low",
        f"this QPC was compiled with -stats-level={layout.level}: its stats hold "
        f"{', '.join(have)}, but no per-operator cycles. opstats needs -stats-level="
        f"{OPSTATS_LEVEL} or more: recompile with -stats-level={OPSTATS_LEVEL} and run again.",
        flag="-stats-level",
    )


def load_layout(qpc: Any) -> tuple[StatsLayout, str]:
    """The stats layout and network name of a QPC (path, bytes or an open Qpc)."""
    from compiler_core.qpc.container import Qpc, load_qpc

    def read(container: Qpc) -> tuple[StatsLayout, str]:
        desc = container.segments.get("statsdesc.bin")
        network = container.network
        if desc is None or network is None:
            raise CompileError(
                "no_stats", "this QPC has no statsdesc.bin: it was not compiled by this qpcfarm"
            )
        return StatsLayout.from_bytes(desc), network.network_name

    if isinstance(qpc, Qpc):
        return read(qpc)
    with load_qpc(qpc) as container:
        return read(container)


def analyse(qpc: Any, buffers: list[bytes]) -> OpStats:
    """Decode raw buffers against the QPC's statsdesc.bin; needs stats level >= 70."""
    layout, network = load_layout(qpc)
    if layout.level < OPSTATS_LEVEL:
        raise _too_low(layout)
    if not buffers:
        raise CompileError("no_stats", "no raw stats buffers given")
    raw = [decode_stats(layout, b) for b in buffers]
    scale = 1.0 / max(1, layout.batchsize)
    clock = int(raw[0]["header"][0][7])

    def mean(section: str) -> np.ndarray:
        return np.mean([r[section].astype(np.float64) for r in raw], axis=0)

    threads = layout.threads
    core_thread = mean("core_thread")
    ct = {name: CORE_THREAD_FIELDS.index(name) for name in CORE_THREAD_FIELDS}
    pmu = mean("pmu") if "pmu" in raw[0] else None
    ddr = mean("ddr") if "ddr" in raw[0] else None
    cores = []
    for c in range(layout.num_cores):
        rows = core_thread[c * len(threads) : (c + 1) * len(threads)]
        pmu_rows = {}
        if pmu is not None:
            block = pmu[c * len(threads) : (c + 1) * len(threads)]
            pmu_rows = {
                t: {
                    event_name(e): float(block[i][j]) * scale
                    for j, e in enumerate(layout.pmu_events)
                }
                for i, t in enumerate(threads)
            }
        cores.append(
            CoreRecord(
                core=c,
                inference_pcycles=float(rows[0][ct["inference_pcycles"]]) * scale,
                activation_pcycles=float(rows[0][ct["activation_pcycles"]]) * scale,
                thread_ucycles={
                    t: float(rows[i][ct["inference_ucycles"]]) * scale
                    for i, t in enumerate(threads)
                },
                pmu=pmu_rows,
                ddr={
                    "read_bytes": float(ddr[c][0]) * scale,
                    "read_constant_bytes": float(ddr[c][1]) * scale,
                    "write_bytes": float(ddr[c][2]) * scale,
                }
                if ddr is not None
                else {},
            )
        )
    ops_table = mean("ops")
    ops_pmu = mean("ops_pmu") if "ops_pmu" in raw[0] else None
    f = {name: OP_FIELDS.index(name) for name in OP_FIELDS}
    ops = []
    for i, (kernel, core) in enumerate(layout.op_rows):
        row = ops_table[i]
        entry = layout.kernels[kernel]
        duration = cores[core].inference_pcycles
        cycles = float(row[f["cycles"]]) * scale
        ops.append(
            OpRecord(
                core=core,
                kernel=kernel,
                name=entry.name,
                nodes=entry.nodes,
                op_types=entry.op_types,
                unit=entry.unit,
                library_kernel=entry.kernel,
                start=float(row[f["start"]]) * scale,
                cycles=cycles,
                wait_before=float(row[f["wait_before"]]) * scale,
                share_percent=100.0 * cycles / duration if duration else 0.0,
                output_bytes=entry.output_bytes,
                tiles=int(round(float(row[f["tiles"]]))),
                compute_cycles=float(row[f["compute_cycles"]]) * scale,
                dma_cycles=float(row[f["dma_cycles"]]) * scale,
                read_bytes=float(row[f["read_bytes"]]) * scale,
                write_bytes=float(row[f["write_bytes"]]) * scale,
                pmu={
                    event_name(e): float(ops_pmu[i][j]) * scale
                    for j, e in enumerate(layout.extended_events)
                }
                if ops_pmu is not None
                else {},
            )
        )
    ports = []
    if "ports" in raw[0]:
        table = mean("ports")
        for p, name in enumerate(layout.ports):
            ports.append(
                {
                    "port": name,
                    "direction": "in" if layout.port_is_input[p] else "out",
                    "doorbell_wait_cycles": float(table[p][0]) * scale,
                    "doorbell_timestamp": float(table[p][1]) * scale,
                    "bytes": int(table[p][2]),
                }
            )
    return OpStats(
        network=network,
        level=layout.level,
        batchsize=layout.batchsize,
        clock_hz=clock,
        inferences=len(raw),
        layout=layout,
        cores=cores,
        ops=ops,
        ports=ports,
        raw=raw,
    )


# ------------------------------------------------------------------------------------ summary


def _types(op: OpRecord) -> str:
    return "+".join(op.op_types)


def operator_totals(stats: OpStats) -> list[dict[str, Any]]:
    """One row per operator over all cores: its wall cycles are its slowest core's."""
    by_kernel: dict[int, list[OpRecord]] = {}
    for op in stats.ops:
        by_kernel.setdefault(op.kernel, []).append(op)
    total = stats.inference_pcycles
    rows: list[dict[str, Any]] = []
    for kernel, ops in by_kernel.items():
        first = ops[0]
        wall = max(o.cycles for o in ops)
        rows.append(
            {
                "op": first.name,
                "type": _types(first),
                "unit": first.unit,
                "cores": len(ops),
                "cycles": wall,
                "core_cycles": sum(o.cycles for o in ops),
                "share_percent": 100.0 * wall / total if total else 0.0,
                "output_bytes": first.output_bytes,
                "nodes": list(first.nodes),
                "kernel": kernel,
            }
        )
    rows.sort(key=lambda r: (-float(r["cycles"]), int(r["kernel"])))
    return rows


def render_summary(stats: OpStats) -> str:
    total = stats.inference_pcycles
    slowest = max(stats.cores, key=lambda c: c.inference_pcycles).core if stats.cores else 0
    lines = [
        f"opstats summary: {stats.network}, {stats.inferences} inference(s), stats level "
        f"{stats.level}, {len(stats.cores)} core(s)",
        f"estimated (modelled device); figures per inference (raw / stats batch size "
        f"{stats.batchsize}); clock {stats.clock_hz / 1e6:,.1f} MHz",
        f"inference: {total:,.0f} pcycles = {stats.us(total):,.1f} us (slowest core "
        f"c{slowest:02d})",
        "",
        "operators, all cores (cycles: slowest core; share: of the inference)",
    ]
    header = ["op", "type", "unit", "cores", "cycles", "share%", "out KB", "nodes"]
    body = [
        [
            r["op"],
            r["type"],
            r["unit"],
            str(r["cores"]),
            f"{r['cycles']:,.0f}",
            f"{r['share_percent']:.1f}",
            f"{r['output_bytes'] / 1024:,.1f}",
            ",".join(r["nodes"]),
        ]
        for r in operator_totals(stats)
    ]
    lines += _columns(header, body, right={3, 4, 5, 6})
    by_type: dict[str, float] = {}
    for r in operator_totals(stats):
        by_type[r["type"]] = by_type.get(r["type"], 0.0) + r["cycles"]
    lines += ["", "by op type (cycles: sum of slowest-core cycles)"]
    lines += _columns(
        ["type", "cycles", "share%"],
        [
            [t, f"{c:,.0f}", f"{100.0 * c / total if total else 0:.1f}"]
            for t, c in sorted(by_type.items(), key=lambda kv: -kv[1])
        ],
        right={1, 2},
    )
    if stats.ports:
        lines += [
            "",
            "I/O ports (doorbell wait: input = core cycles stalled for it; output = "
            "cycles it waited for the end)",
        ]
        lines += _columns(
            ["port", "dir", "bytes", "doorbell wait", "timestamp"],
            [
                [
                    p["port"],
                    p["direction"],
                    f"{p['bytes']:,}",
                    f"{p['doorbell_wait_cycles']:,.0f}",
                    f"{p['doorbell_timestamp']:,.0f}",
                ]
                for p in stats.ports
            ],
            right={2, 3, 4},
        )
    for core in stats.cores:
        ops = sorted((o for o in stats.ops if o.core == core.core), key=lambda o: o.start)
        busy = sum(o.cycles for o in ops)
        waited = sum(o.wait_before for o in ops)
        duration = core.inference_pcycles
        threads = ", ".join(
            f"{t} {u:,.0f} ({100.0 * u / duration if duration else 0:.1f}%)"
            for t, u in core.thread_ucycles.items()
        )
        lines += [
            "",
            f"core c{core.core:02d}: {duration:,.0f} pcycles = {busy:,.0f} in {len(ops)} ops + "
            f"{waited:,.0f} waiting; activation {core.activation_pcycles:,.0f} pcycles",
            f"  thread ucycles: {threads}",
        ]
        if core.ddr:
            lines.append(
                f"  DDR: read {core.ddr['read_bytes']:,.0f} B (constants "
                f"{core.ddr['read_constant_bytes']:,.0f}), written {core.ddr['write_bytes']:,.0f} B"
            )
        for thread, counts in core.pmu.items():
            shown = ", ".join(f"{k} {v:,.0f}" for k, v in counts.items())
            lines.append(f"  PMU {thread}: {shown}")
        lines += [
            "  " + line
            for line in _columns(
                [
                    "start",
                    "wait",
                    "cycles",
                    "share%",
                    "unit",
                    "op",
                    "type",
                    "tiles",
                    "out KB",
                    "nodes",
                ],
                [
                    [
                        f"{o.start:,.0f}",
                        f"{o.wait_before:,.0f}",
                        f"{o.cycles:,.0f}",
                        f"{o.share_percent:.1f}",
                        o.unit,
                        o.name,
                        _types(o),
                        str(o.tiles),
                        f"{o.output_bytes / 1024:,.1f}",
                        ",".join(o.nodes),
                    ]
                    for o in ops
                ],
                right={0, 1, 2, 3, 7, 8},
            )
        ]
    return "\n".join(lines) + "\n"


def _columns(header: list[str], rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max([len(header[i])] + [len(r[i]) for r in rows]) for i in range(len(header))]
    last = len(header) - 1

    def fmt(cells: list[str]) -> str:
        out = [
            c if i == last else (c.rjust(widths[i]) if i in right else c.ljust(widths[i]))
            for i, c in enumerate(cells)
        ]
        return "  ".join(out).rstrip()

    return [fmt(header), *(fmt(r) for r in rows)]


CSV_COLUMNS = (
    "core",
    "op",
    "op_types",
    "onnx_nodes",
    "unit",
    "kernel",
    "start_cycle",
    "wait_before_cycles",
    "cycles",
    "share_of_core_percent",
    "output_bytes",
    "tiles",
    "compute_cycles",
    "dma_cycles",
    "ddr_read_bytes",
    "ddr_write_bytes",
)


def render_csv(stats: OpStats) -> str:
    """One row per operator and core, per inference; PMU columns at level 100."""
    events = [event_name(e) for e in stats.layout.extended_events]
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow([*CSV_COLUMNS, *(f"pmu_{e}" for e in events)])
    for o in sorted(stats.ops, key=lambda o: (o.core, o.start)):
        writer.writerow(
            [
                f"c{o.core:02d}",
                o.name,
                "+".join(o.op_types),
                ";".join(o.nodes),
                o.unit,
                o.library_kernel,
                _num(o.start),
                _num(o.wait_before),
                _num(o.cycles),
                f"{o.share_percent:.3f}",
                o.output_bytes,
                o.tiles,
                _num(o.compute_cycles),
                _num(o.dma_cycles),
                _num(o.read_bytes),
                _num(o.write_bytes),
                *(_num(o.pmu.get(e, 0.0)) for e in events),
            ]
        )
    return out.getvalue()


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.3f}"


# -------------------------------------------------------------------------------------- trace


def chrome_trace(stats: OpStats) -> dict[str, Any]:
    """Chrome/Perfetto trace: a process per core, a lane for its ops and one per thread.

    Every inference is laid after the previous one (activation, then the inference); times
    are the raw device cycles converted to microseconds at the modelled clock.
    """
    layout = stats.layout
    lanes = ["ops", *layout.threads]
    events: list[dict[str, Any]] = []
    for c in range(layout.num_cores):
        events.append(
            {
                "ph": "M",
                "name": "process_name",
                "pid": c,
                "tid": 0,
                "args": {"name": f"NSP core c{c:02d}"},
            }
        )
        events.append(
            {"ph": "M", "name": "process_sort_index", "pid": c, "tid": 0, "args": {"sort_index": c}}
        )
        for tid, lane in enumerate(lanes):
            events.append(
                {"ph": "M", "name": "thread_name", "pid": c, "tid": tid, "args": {"name": lane}}
            )
            events.append(
                {
                    "ph": "M",
                    "name": "thread_sort_index",
                    "pid": c,
                    "tid": tid,
                    "args": {"sort_index": tid},
                }
            )
    host = layout.num_cores
    events.append(
        {
            "ph": "M",
            "name": "process_name",
            "pid": host,
            "tid": 0,
            "args": {"name": "host I/O doorbells"},
        }
    )
    f = {name: OP_FIELDS.index(name) for name in OP_FIELDS}
    ct_pc = CORE_THREAD_FIELDS.index("inference_pcycles")
    ct_act = CORE_THREAD_FIELDS.index("activation_pcycles")
    n_threads = len(layout.threads)
    offset = 0
    clock = stats.clock_hz or 1

    def us(cycles: float) -> float:
        return round(cycles / clock * 1e6, 4)

    for index, raw in enumerate(stats.raw):
        core_thread = raw["core_thread"]
        activation = max(int(core_thread[c * n_threads][ct_act]) for c in range(layout.num_cores))
        duration = max(int(core_thread[c * n_threads][ct_pc]) for c in range(layout.num_cores))
        base = offset + activation
        for c in range(layout.num_cores):
            act = int(core_thread[c * n_threads][ct_act])
            events.append(
                {
                    "ph": "X",
                    "name": "activation",
                    "cat": "setup",
                    "pid": c,
                    "tid": 0,
                    "ts": us(offset + activation - act),
                    "dur": us(act),
                    "args": {"inference": index, "pcycles": act},
                }
            )
        ops = raw["ops"]
        lane_end: dict[tuple[int, int], int] = {}
        """Kernels overlap on a thread (the next one's loads start while this one computes):
        a lane shows each from where the previous one ended."""
        order = sorted(
            range(len(layout.op_rows)),
            key=lambda i: (layout.op_rows[i][1], int(ops[i][f["start"]]), i),
        )
        for i in order:
            kernel, core = layout.op_rows[i]
            row = [int(v) for v in ops[i]]
            entry = layout.kernels[kernel]
            label = f"{entry.name} ({'+'.join(entry.op_types)})"
            args = {
                "onnx_nodes": list(entry.nodes),
                "op_types": list(entry.op_types),
                "unit": entry.unit,
                "kernel": entry.kernel,
                "cycles": row[f["cycles"]],
                "tiles": row[f["tiles"]],
                "inference": index,
                "output_bytes": entry.output_bytes,
            }
            if row[f["wait_before"]]:
                events.append(
                    {
                        "ph": "X",
                        "name": f"wait before {entry.name}",
                        "cat": "wait",
                        "pid": core,
                        "tid": 0,
                        "ts": us(base + row[f["start"]] - row[f["wait_before"]]),
                        "dur": us(row[f["wait_before"]]),
                        "args": {**args, "cycles": row[f["wait_before"]]},
                    }
                )
            events.append(
                {
                    "ph": "X",
                    "name": label,
                    "cat": "op",
                    "pid": core,
                    "tid": 0,
                    "ts": us(base + row[f["start"]]),
                    "dur": us(row[f["cycles"]]),
                    "args": args,
                }
            )
            for tid, thread in enumerate(layout.threads, start=1):
                start, end, busy = (row[f[f"{thread}_{p}"]] for p in ("start", "end", "busy"))
                start = max(start, lane_end.get((core, tid), 0))
                if busy and end > start:
                    lane_end[(core, tid)] = end
                    events.append(
                        {
                            "ph": "X",
                            "name": label,
                            "cat": thread,
                            "pid": core,
                            "tid": tid,
                            "ts": us(base + start),
                            "dur": us(end - start),
                            "args": {
                                **args,
                                "busy_cycles": busy,
                                "utilisation_percent": round(
                                    min(100.0, 100.0 * busy / (end - start)), 1
                                ),
                            },
                        }
                    )
        if "ports" in raw:
            for p, name in enumerate(layout.ports):
                events.append(
                    {
                        "ph": "i",
                        "s": "p",
                        "name": f"doorbell {name}",
                        "cat": "doorbell",
                        "pid": host,
                        "tid": 0,
                        "ts": us(base + int(raw["ports"][p][1])),
                        "args": {
                            "direction": "in" if layout.port_is_input[p] else "out",
                            "wait_cycles": int(raw["ports"][p][0]),
                        },
                    }
                )
        offset = base + duration
    return {
        "traceEvents": events,
        "displayTimeUnit": "ns",
        "otherData": {
            "network": stats.network,
            "estimated": True,
            "clock_hz": stats.clock_hz,
            "stats_level": stats.level,
            "inferences": stats.inferences,
        },
    }


def write_opstats(
    qpc: str | os.PathLike[str],
    input_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    *,
    summary: bool = True,
    trace: bool = True,
) -> list[Path]:
    """The vendor tool's job: summary (text + CSV) and/or trace.json into `output_dir`."""
    layout, _ = load_layout(qpc)
    if layout.level < OPSTATS_LEVEL:
        raise _too_low(layout)
    stats = analyse(qpc, read_stats_dir(input_dir))
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    if summary:
        (out / "opstats-summary.txt").write_text(render_summary(stats))
        (out / "opstats-summary.csv").write_text(render_csv(stats))
        written += [out / "opstats-summary.txt", out / "opstats-summary.csv"]
    if trace:
        (out / "trace.json").write_text(json.dumps(chrome_trace(stats)))
        written.append(out / "trace.json")
    return written
