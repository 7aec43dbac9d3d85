"""The stats buffer a QPC carries in DDR, laid out by `-stats-level`, and `statsdesc.bin`.

The buffer is a run of sections, each a table of little-endian u64 cells (rows x fields), at
fixed byte offsets. Which sections exist follows the vendor's additive levels:

- always: `header`;
- >= 40: `core_thread` (per core and thread: inference and activation ucycles/pcycles), `pmu`
  (per core and thread, a field per event) with a recipe or events, `ddr` (per core) with
  `-ddr-stats`;
- >= 50: `ports` (per I/O port: doorbell wait, doorbell timestamp, bytes) and `sem_increments`
  (per operator and core: when its last instruction completed, and its cycles);
- >= 70: `ops` (per operator and core: cycles, waits before it, per-thread use, traffic);
- >= 100: `ops_pmu` (per operator and core: extended PMU events).

`statsdesc.bin` (canonical JSON) records the layout, the PMU configuration, the batch size
figures are normalised by, and the operator table opstats needs to name ONNX nodes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from compiler_core.cost_rates import THREADS
from compiler_core.errors import CompileError
from compiler_core.profiling.pmu import EXTENDED_DEFAULT, configured_events, event_name

if TYPE_CHECKING:
    from compiler_core.lowering.lowered import LoweredGraph
    from compiler_core.options import CompileOptions

STATSDESC_FORMAT = "qpcfarm-statsdesc"
STATSDESC_VERSION = 2
STATS_MAGIC = 0x41545351
"""First u64 of every raw stats buffer: "QSTA" little-endian."""
STATS_ALIGN = 64

HEADER_FIELDS = (
    "magic",
    "version",
    "level",
    "num_cores",
    "threads",
    "inference",
    "batchsize",
    "clock_hz",
)
CORE_THREAD_FIELDS = (
    "inference_ucycles",
    "inference_pcycles",
    "activation_ucycles",
    "activation_pcycles",
)
DDR_FIELDS = ("read_bytes", "read_constant_bytes", "write_bytes", "multicast_bytes", "noc_bytes")
"""Counted by the runtime from the DMA instructions each core executed in the inference."""
PORT_FIELDS = ("doorbell_wait_cycles", "doorbell_timestamp", "bytes")
SEM_FIELDS = ("timestamp", "op_cycles")
OP_FIELDS = (
    "start",
    "end",
    "cycles",
    "wait_before",
    "compute_cycles",
    "dma_cycles",
    "tiles",
    "read_bytes",
    "read_constant_bytes",
    "write_bytes",
    "vtcm_bytes",
    *(f"{t}_{part}" for t in THREADS for part in ("start", "end", "busy")),
)


@dataclass(frozen=True)
class Section:
    name: str
    offset: int
    rows: int
    fields: tuple[str, ...]

    @property
    def nbytes(self) -> int:
        return self.rows * len(self.fields) * 8

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "offset": self.offset,
            "rows": self.rows,
            "fields": list(self.fields),
        }


@dataclass(frozen=True)
class KernelEntry:
    """One kernel of the operator table: what opstats prints for it."""

    id: int
    name: str
    nodes: tuple[str, ...]
    op_types: tuple[str, ...]
    unit: str
    kernel: str
    output_bytes: int
    output_shape: tuple[int, ...]
    output_dtype: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "nodes": list(self.nodes),
            "op_types": list(self.op_types),
            "unit": self.unit,
            "kernel": self.kernel,
            "output_bytes": self.output_bytes,
            "output_shape": list(self.output_shape),
            "output_dtype": self.output_dtype,
        }


@dataclass(frozen=True)
class StatsLayout:
    level: int
    batchsize: int
    ddr_stats: bool
    pmu_recipe: str | None
    pmu_events: tuple[int, ...]
    extended_events: tuple[int, ...]
    num_cores: int
    threads: tuple[str, ...]
    ports: tuple[str, ...]
    port_is_input: tuple[bool, ...]
    kernels: tuple[KernelEntry, ...]
    op_rows: tuple[tuple[int, int], ...]
    """(kernel, core) of every row of `ops`, `ops_pmu` and `sem_increments`, in kernel order."""
    sections: tuple[Section, ...]
    size: int
    ddr_offset: int = 0
    """Where the buffer lies in the program's DDR (set once memory is planned)."""

    def section(self, name: str) -> Section | None:
        for s in self.sections:
            if s.name == name:
                return s
        return None

    def at(self, ddr_offset: int) -> StatsLayout:
        return replace(self, ddr_offset=ddr_offset)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": STATSDESC_FORMAT,
            "version": STATSDESC_VERSION,
            "level": self.level,
            "batchsize": self.batchsize,
            "ddr_stats": self.ddr_stats,
            "pmu": {
                "recipe": self.pmu_recipe,
                "events": [{"id": f"0x{e:X}", "name": event_name(e)} for e in self.pmu_events],
                "extended_events": [
                    {"id": f"0x{e:X}", "name": event_name(e)} for e in self.extended_events
                ],
            },
            "num_cores": self.num_cores,
            "threads": list(self.threads),
            "ports": [
                {"name": n, "direction": "in" if i else "out"}
                for n, i in zip(self.ports, self.port_is_input, strict=True)
            ],
            "kernels": [k.to_dict() for k in self.kernels],
            "op_rows": [list(r) for r in self.op_rows],
            "sections": [s.to_dict() for s in self.sections],
            "size": self.size,
            "ddr_offset": self.ddr_offset,
        }

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode("utf-8")

    @classmethod
    def from_bytes(cls, data: bytes | memoryview) -> StatsLayout:
        try:
            doc = json.loads(bytes(data))
            if doc.get("format") != STATSDESC_FORMAT or doc.get("version") != STATSDESC_VERSION:
                raise ValueError(f"format {doc.get('format')!r} version {doc.get('version')!r}")
            pmu = doc["pmu"]
            return cls(
                level=int(doc["level"]),
                batchsize=int(doc["batchsize"]),
                ddr_stats=bool(doc["ddr_stats"]),
                pmu_recipe=pmu["recipe"],
                pmu_events=tuple(int(e["id"], 16) for e in pmu["events"]),
                extended_events=tuple(int(e["id"], 16) for e in pmu["extended_events"]),
                num_cores=int(doc["num_cores"]),
                threads=tuple(doc["threads"]),
                ports=tuple(p["name"] for p in doc["ports"]),
                port_is_input=tuple(p["direction"] == "in" for p in doc["ports"]),
                kernels=tuple(
                    KernelEntry(
                        id=int(k["id"]),
                        name=k["name"],
                        nodes=tuple(k["nodes"]),
                        op_types=tuple(k["op_types"]),
                        unit=k["unit"],
                        kernel=k["kernel"],
                        output_bytes=int(k["output_bytes"]),
                        output_shape=tuple(int(d) for d in k["output_shape"]),
                        output_dtype=k["output_dtype"],
                    )
                    for k in doc["kernels"]
                ),
                op_rows=tuple((int(a), int(b)) for a, b in doc["op_rows"]),
                sections=tuple(
                    Section(s["name"], int(s["offset"]), int(s["rows"]), tuple(s["fields"]))
                    for s in doc["sections"]
                ),
                size=int(doc["size"]),
                ddr_offset=int(doc["ddr_offset"]),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CompileError("invalid_qpc", f"statsdesc.bin is malformed: {exc}") from exc


def _align(n: int) -> int:
    return (n + STATS_ALIGN - 1) // STATS_ALIGN * STATS_ALIGN


def build_layout(options: CompileOptions, lowered: LoweredGraph) -> StatsLayout:
    """The stats buffer for `options`' stats flags over a lowered graph (before memory)."""
    level = options.stats_level
    cores = lowered.num_cores
    events = configured_events(options.aic_pmu_recipe, options.aic_pmu_events)
    extended = (events or EXTENDED_DEFAULT) if level >= 100 else ()
    ports = [*lowered.inputs, *lowered.outputs]
    kernels = []
    op_rows: list[tuple[int, int]] = []
    for index, lk in enumerate(lowered.kernels):
        d = lk.desc
        stored = [t for t in d.outputs if t >= 0]
        out = lowered.tensors[stored[0]] if stored else None
        kernels.append(
            KernelEntry(
                id=index,
                name=d.name,
                nodes=tuple(d.nodes),
                op_types=tuple(d.op_types),
                unit=d.unit,
                kernel=d.kernel,
                output_bytes=sum(lowered.tensors[t].nbytes for t in d.outputs if t >= 0),
                output_shape=tuple(out.shape) if out is not None else (),
                output_dtype=out.dtype if out is not None else "",
            )
        )
        op_rows += [(index, core) for core in sorted({t.core for t in lk.tiles})]

    plan: list[tuple[str, int, tuple[str, ...]]] = [("header", 1, HEADER_FIELDS)]
    threads = cores * len(THREADS)
    if level >= 40:
        plan.append(("core_thread", threads, CORE_THREAD_FIELDS))
        if events:
            plan.append(("pmu", threads, tuple(f"0x{e:X}" for e in events)))
        if options.ddr_stats:
            plan.append(("ddr", cores, DDR_FIELDS))
    if level >= 50:
        plan.append(("ports", len(ports), PORT_FIELDS))
        plan.append(("sem_increments", len(op_rows), SEM_FIELDS))
    if level >= 70:
        plan.append(("ops", len(op_rows), OP_FIELDS))
    if level >= 100:
        plan.append(("ops_pmu", len(op_rows), tuple(f"0x{e:X}" for e in extended)))
    sections = []
    cursor = 0
    for name, rows, fields in plan:
        section = Section(name, cursor, rows, fields)
        sections.append(section)
        cursor = _align(cursor + section.nbytes)
    return StatsLayout(
        level=level,
        batchsize=options.effective_stats_batchsize,
        ddr_stats=options.ddr_stats,
        pmu_recipe=options.aic_pmu_recipe,
        pmu_events=events,
        extended_events=tuple(extended),
        num_cores=cores,
        threads=THREADS,
        ports=tuple(lowered.tensors[t].name for t in ports),
        port_is_input=tuple(i < len(lowered.inputs) for i in range(len(ports))),
        kernels=tuple(kernels),
        op_rows=tuple(op_rows),
        sections=tuple(sections),
        size=cursor,
    )


def decode_stats(layout: StatsLayout, raw: bytes | memoryview) -> dict[str, np.ndarray]:
    """Every section of one raw buffer as a (rows, fields) uint64 array; checks the header."""
    if len(raw) != layout.size:
        raise CompileError(
            "invalid_stats",
            f"raw stats buffer has {len(raw):,} bytes, the QPC's layout has {layout.size:,}",
        )
    out: dict[str, np.ndarray] = {}
    for s in layout.sections:
        out[s.name] = np.frombuffer(
            raw, dtype="<u8", count=s.rows * len(s.fields), offset=s.offset
        ).reshape(s.rows, len(s.fields))
    header = dict(zip(HEADER_FIELDS, out["header"][0].tolist(), strict=True))
    if header["magic"] != STATS_MAGIC or header["version"] != STATSDESC_VERSION:
        raise CompileError("invalid_stats", "raw stats buffer does not start with the QSTA header")
    if header["level"] != layout.level or header["num_cores"] != layout.num_cores:
        raise CompileError("invalid_stats", "raw stats buffer belongs to a different QPC")
    return out


def field_index(layout: StatsLayout, section: str, name: str) -> int:
    s = layout.section(section)
    assert s is not None
    return s.fields.index(name)
