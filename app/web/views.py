"""Turning rows and reports into what the templates show (plain data, no HTML)."""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass, field
from typing import Any

from qpcfarm.app.db.models import CompileJob


@dataclass(frozen=True)
class MetricRow:
    name: str
    value: str


@dataclass(frozen=True)
class MetricTable:
    """A list of records in the metrics (per-core figures, the size histogram)."""

    name: str
    columns: list[str]
    rows: list[list[str]]


@dataclass(frozen=True)
class Metrics:
    rows: list[MetricRow] = field(default_factory=list)
    tables: list[MetricTable] = field(default_factory=list)


def split_metrics(metrics: dict[str, Any]) -> Metrics:
    """One row per figure, nested objects flattened to dotted names (`memory_traffic.total.
    ddr_read_bytes`); lists of records become tables of their own."""
    out = Metrics()

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for key, inner in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), inner)
        elif _is_records(value):
            columns = list(dict.fromkeys(k for record in value for k in record))
            rows = [[format_value(r.get(c, "")) for c in columns] for r in value]
            out.tables.append(MetricTable(prefix, columns, rows))
        else:
            out.rows.append(MetricRow(prefix, format_value(value)))

    walk("", metrics)
    return out


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


FILTERS = {
    "when": format_time,
    "ms": format_ms,
    "num": format_value,
}
