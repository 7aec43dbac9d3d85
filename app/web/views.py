"""Turning rows and reports into what the templates show (plain data, no HTML).

Metrics are grouped (latency, compute, memory, DDR traffic) and shown with units: bytes in
KiB/MiB, times in µs, shares in %, under names a person reads (`estimated_latency_us` is
"Estimated latency"); the raw key stays on the row (`data-metric`, and its tooltip). A metric
no rule knows still shows up, under "Other".
"""

from __future__ import annotations

import datetime as dt
import json
import re
from dataclasses import dataclass, field
from typing import Any

from app.domain.db.models import CompileJob
from app.domain.settings import Settings
from app.domain.stages import describe_stage
from compiler_core import CompileError, CompileOptions
from compiler_core.devices import get_device
from compiler_core.report import (
    KIND_IMPORT,
    KIND_OPTION,
    KIND_PERF,
    KIND_PRECISION,
    pass_time_rows,
    warning_kind,
)


@dataclass(frozen=True)
class MetricRow:
    name: str
    """The metric's key, dotted for nested ones (`memory_traffic.total.ddr_read_bytes`)."""
    value: str
    label: str = ""
    exact: str = ""
    """The unrounded value (a tooltip), when `value` is rounded into a unit."""
    items: tuple[str, ...] = ()
    """A list's entries (node names...), shown as a wrapped list under `value` (their
    count): one JSON string of them would be one unbreakable line as wide as all of them."""


@dataclass(frozen=True)
class MetricTable:
    """A list of records in the metrics (per-core figures, the size histogram)."""

    name: str
    columns: list[str]
    rows: list[list[str]]
    title: str = ""


@dataclass(frozen=True)
class MetricGroup:
    title: str
    rows: list[MetricRow]


@dataclass(frozen=True)
class Metrics:
    rows: list[MetricRow] = field(default_factory=list)
    tables: list[MetricTable] = field(default_factory=list)

    @property
    def groups(self) -> list[MetricGroup]:
        """The rows by group, in `GROUPS` order; empty groups left out."""
        found: dict[str, list[MetricRow]] = {title: [] for title, _ in GROUPS}
        found[OTHER] = []
        for row in self.rows:
            found[group_of(row.name)].append(row)
        return [MetricGroup(title, rows) for title, rows in found.items() if rows]


OTHER = "Other"
GROUPS: list[tuple[str, re.Pattern[str]]] = [
    ("Device", re.compile(r"^(estimated|device|num_cores|clock_mhz)$")),
    (
        "Latency and throughput",
        re.compile(
            r"^(estimated_(cycles|latency_us|device_latency_us|inferences_per_second)"
            r"|host_transfer_us|floor_.*|latency_over_floor|activation_cycles)$"
        ),
    ),
    ("Quantization accuracy", re.compile(r"^quantization_(accuracy|profile)\.")),
    ("Precision", re.compile(r"^precision\.")),
    (
        "Compute",
        re.compile(r"^(.*mac.*|hmx_.*|unit_busy_percent\..*|kernels.*|specialized_kernels)$"),
    ),
    ("DDR traffic", re.compile(r"^memory_traffic\.")),
    (
        "Memory",
        re.compile(r"^(.*size.*|vtcm_.*|.*constants.*|.*_bytes(_per_core)?)$"),
    ),
]


def group_of(name: str) -> str:
    for title, pattern in GROUPS:
        if pattern.match(name):
            return title
    return OTHER


WORDS = {
    "hmx": "HMX",
    "hvx": "HVX",
    "dma": "DMA",
    "ddr": "DDR",
    "vtcm": "VTCM",
    "mac": "MAC",
    "macs": "MACs",
    "aic": "AIC",
    "noc": "NoC",
    "va": "VA",
    "num": "number of",
}
UNIT_SUFFIXES = ("_us", "_percent", "_mhz", "_bytes", "_%")
"""Dropped from a label: the value shows the unit (`cycles` stays: `Estimated cycles`)."""
TABLE_TITLES = {
    "memory_traffic.per_core": "DDR traffic per core",
    "memory_traffic.per_port": "Traffic per I/O port",
    "per_core": "Per core",
    "operation_size_histogram": "Operation sizes",
}


LABELS = {
    "estimated": "Estimated (modelled device)",
    "floor_compute_us": "Floor: compute time",
    "floor_ddr_us": "Floor: DDR time",
    "floor_ddr_bytes": "Floor: DDR traffic",
    "resident_constants_bytes_per_core": "Resident constants per core",
}


def label_of(name: str) -> str:
    """`memory_traffic.total.ddr_read_bytes` -> `DDR read`; the group says the rest
    (`precision.fp16.nodes` -> `fp16 nodes`: the precision is not the group)."""
    if name in LABELS:
        return LABELS[name]
    parts = name.split(".")
    if len(parts) == 3 and parts[0] == "precision":
        return f"{parts[1]} {label_of(parts[2]).lower()}"
    last = parts[-1]
    if name.startswith("unit_busy_percent."):
        return f"{WORDS.get(last, last)} busy"
    for suffix in UNIT_SUFFIXES:
        if last.endswith(suffix) and last != suffix.lstrip("_"):
            last = last[: -len(suffix)]
            break
    words = [WORDS.get(word, word) for word in last.split("_") if word]
    text = " ".join(words) or name
    return text[0].upper() + text[1:]


def unit_of(name: str) -> str:
    last = name.split(".")[-1]
    if last.endswith("_us"):
        return "us"
    if last.endswith(("_percent", "_%")) or name.startswith("unit_busy_percent."):
        return "%"
    if last.endswith("_mhz"):
        return "MHz"
    if last.endswith("_cycles") or last == "cycles":
        return "cycles"
    if last == "latency_over_floor":
        return "x"
    if last.endswith("inferences_per_second"):
        return "/s"
    if "bytes" in last or "size" in last or last.endswith("_used"):
        return "bytes"
    return ""


def format_us(value: float) -> str:
    """Microseconds to 3 decimals, or 3 significant digits below 0.1 (0.0881)."""
    return f"{value:,.3g}" if 0 < abs(value) < 0.1 else f"{value:,.3f}"


def format_bytes(value: float) -> str:
    """1,234,567 -> `1.18 MiB` (binary units; exact bytes below 1 KiB)."""
    size = float(value)
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(size) >= scale:
            return f"{size / scale:,.2f} {unit}"
    return f"{int(size):,} B"


def with_unit(name: str, value: Any) -> tuple[str, str]:
    """(shown, exact): the value in its unit, and the raw value when they differ."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return format_value(value), ""
    unit = unit_of(name)
    raw = format_value(value)
    if unit == "bytes":
        shown = format_bytes(value)
        return shown, (f"{value:,} bytes" if shown != f"{int(value):,} B" else "")
    if unit == "us":
        return f"{format_us(value)} µs", ""
    if unit == "%":
        return f"{value:,.1f} %", ""
    if unit == "x":
        return f"{value:,.2f}x", ""
    if unit == "/s":
        return f"{value:,.0f} /s", ""
    if unit == "MHz":
        return f"{raw} MHz", ""
    return raw, ""


def split_metrics(metrics: dict[str, Any]) -> Metrics:
    """One row per figure, nested objects flattened to dotted names (`memory_traffic.total.
    ddr_read_bytes`); lists of records become tables of their own. Per-specialization
    metrics (`specializations`) are left to `specializations`."""
    out = Metrics()

    def walk(prefix: str, value: Any) -> None:
        if prefix == "specializations":
            return
        if isinstance(value, dict) and value:
            for key, inner in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), inner)
        elif _is_scalars(value):
            items = tuple(format_value(v) for v in value)
            noun = "nodes" if prefix.endswith("nodes") else "items"
            shown = f"{len(items):,} {noun}" if items else "none"
            out.rows.append(MetricRow(prefix, shown, label_of(prefix), "", items))
        elif _is_records(value):
            columns = list(dict.fromkeys(k for record in value for k in record))
            rows = [[_cell(c, r.get(c, "")) for c in columns] for r in value]
            headers = [_column(c) for c in columns]
            title = TABLE_TITLES.get(prefix) or label_of(prefix)
            out.tables.append(MetricTable(prefix, headers, rows, title))
        else:
            shown, exact = with_unit(prefix, value)
            out.rows.append(MetricRow(prefix, shown, label_of(prefix), exact))

    walk("", metrics)
    return out


def _column(name: str) -> str:
    """A table's header: the label, and the unit when the cells leave it out."""
    unit = unit_of(name)
    label = label_of(name)
    return f"{label} ({'µs' if unit == 'us' else unit})" if unit in ("%", "us") else label


def _cell(name: str, value: Any) -> str:
    """Bytes carry their unit (KiB, MiB); other cells are numbers under their header."""
    if unit_of(name) == "bytes" and isinstance(value, (int, float)) and not isinstance(value, bool):
        return format_bytes(value)
    if isinstance(value, float) and unit_of(name) in ("%", "us"):
        return f"{value:,.1f}" if unit_of(name) == "%" else format_us(value)
    return format_value(value)


def _is_scalars(value: Any) -> bool:
    return isinstance(value, list) and not any(isinstance(v, (dict, list)) for v in value)


def _is_records(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def format_value(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.6g}"
    if isinstance(value, str):
        return value
    return json.dumps(value, separators=(",", ": "))


# ------------------------------------------------------------------------ the rest of a job


@dataclass(frozen=True)
class PassTime:
    name: str
    ms: str
    share: str
    depth: int


@dataclass(frozen=True)
class PassTimes:
    rows: list[PassTime]
    total_ms: str


def pass_times(times: dict[str, float]) -> PassTimes:
    """The stages, each with the passes it ran beneath it, and the total of the stages."""
    rows, total = pass_time_rows(times)
    return PassTimes(
        [PassTime(r.name, format_ms(r.seconds), f"{r.share:.1f}", r.depth) for r in rows],
        format_ms(total),
    )


WARNING_SECTIONS = (
    (KIND_OPTION, "Option notes"),
    (KIND_IMPORT, "Import warnings"),
    (KIND_PRECISION, "Precision warnings"),
    (KIND_PERF, "Perf warnings"),
)


def warning_sections(warnings: list[dict[str, Any]]) -> list[tuple[str, str, list[Any]]]:
    """(kind, title, warnings) for each kind the report holds; perf always (None is news)."""
    by_kind: dict[str, list[Any]] = {kind: [] for kind, _ in WARNING_SECTIONS}
    for warning in warnings:
        by_kind[warning_kind(warning)].append(warning)
    return [
        (kind, title, by_kind[kind])
        for kind, title in WARNING_SECTIONS
        if by_kind[kind] or kind == KIND_PERF
    ]


def flags_of(options: dict[str, Any]) -> list[str]:
    """A job's canonical options as the flags that set them (defaults left out)."""
    try:
        return CompileOptions.from_json(options).to_flags()
    except CompileError:
        return [f"-{k}={v}" for k, v in sorted(options.items())]


def format_time(moment: dt.datetime | None) -> str:
    if moment is None:
        return ""
    return moment.strftime("%Y-%m-%d %H:%M:%S") + " UTC"


def format_ms(seconds: float) -> str:
    return f"{seconds * 1000:,.3f}"


def percent(job: CompileJob) -> int:
    return max(0, min(100, round((job.progress or 0.0) * 100)))


def cores(job: CompileJob) -> Any:
    return (job.options or {}).get("aic-num-cores", "")


def is_active(job: CompileJob) -> bool:
    return job.status.is_active


def job_stage(job: CompileJob) -> str:
    return describe_stage(job.status.value, job.stage, cache_hit=job.cache_hit)


def device_label(name: str | None) -> str:
    """`aic100-pro` -> `AIC100 Pro (aic100-pro)`; an unknown name as it is."""
    if not name:
        return ""
    try:
        return f"{get_device(name).display_name} ({name})"
    except CompileError:
        return name


def default_device() -> str:
    """The device a compile targets when no -aic-device is given (the hardware version's
    full SoC): the device its estimates are for."""
    return CompileOptions().device.name


def device_is_default(job: CompileJob) -> bool:
    """Whether the job's device came from no -aic-device (the hardware version's default)."""
    return not (job.options or {}).get("aic-device")


def input_shapes_of(job: CompileJob) -> tuple[str, str] | None:
    """(the input shapes a job's model is converted with, where they come from): the
    compile's own -input-shapes, or the ones its model was uploaded with (the default).
    None when it uses the model's own."""
    used = (job.options or {}).get("input-shapes")
    if not used:
        return None
    recorded = job.model.input_shapes
    if used == recorded:
        return used, "recorded with the upload: the default of this model's compiles"
    if recorded:
        return used, f"this compile's -input-shapes (the upload recorded {recorded})"
    return used, "this compile's -input-shapes"


def key_hint(settings: Settings) -> str:
    """Where the sign-in page tells a person to find a key: in the embedded mode the key
    `qpcfarm serve` saved on its first start; on a farm, the admin's command."""
    if not (settings.is_sqlite and settings.embedded_worker):
        return ""
    path = settings.local_key_file
    return str(path) if path.is_absolute() else f"./{path}"


FILTERS = {
    "when": format_time,
    "ms": format_ms,
    "num": format_value,
    "bytes": format_bytes,
    "stage": job_stage,
    "flags": flags_of,
    "device": device_label,
}
GLOBALS = {
    "default_device": default_device,
    "device_is_default": device_is_default,
    "input_shapes_of": input_shapes_of,
}
"""Functions the templates call (`templates.env.globals`)."""
