"""Two compiles side by side: what a compiler version (or a flag) changed for a model.

A side is a QPC in the team's records, or one of the team's compile jobs (a succeeded job
stands for its QPC; a failed one is a side with no report, so "failed -> passed" shows what
a new compiler fixed). The comparison holds:

- `metrics`: every numeric figure of the two reports (nested objects flattened to dotted
  names, lists such as `per_core` left out), with `ratio` = b / a and a change `bucket`:
  the largest of 1.1x, 1.2x, 1.5x, 2x, 5x, 10x that max(b/a, a/b) reaches, `same` below 1.1x;
  `direction` up or down. A figure on one side only has no ratio (bucket `added`/`removed`).
- `warnings_added` / `warnings_removed`: warnings told apart by code and the nodes they name
  (the message's figures may move without the warning being new); counted as a multiset.
- `pass_times`: each pass's seconds on both sides with the ratio and bucket.
- `status`: `passed -> passed`, `failed -> passed`, ...
"""

from __future__ import annotations

import math
import uuid
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.orm import Session

from app.domain.db.models import CompileJob, CompileReport, JobStatus, Qpc, Team
from app.domain.services.errors import ServiceError, not_found
from app.domain.services.qpcs import get_report

BUCKETS: tuple[float, ...] = (1.1, 1.2, 1.5, 2.0, 5.0, 10.0)
"""Change thresholds (factor either way); below the first a figure is `same`."""
SAME = "same"
PASSED, FAILED = "passed", "failed"


@dataclass(frozen=True)
class Side:
    """One side of a comparison: what was compiled and how it came out."""

    ref: uuid.UUID
    kind: str  # "qpc" | "job"
    status: str  # PASSED | FAILED
    qpc_id: uuid.UUID | None = None
    job_id: uuid.UUID | None = None
    compiler_version: str | None = None
    device: str | None = None
    metrics: Mapping[str, Any] = field(default_factory=dict)
    warnings: list[Any] = field(default_factory=list)
    pass_times: Mapping[str, float] = field(default_factory=dict)
    error: dict[str, Any] | None = None


def bucket_of(a: float, b: float) -> tuple[float | None, str, str]:
    """(ratio b/a, bucket, direction) of a figure that went from a to b."""
    if a == b:
        return 1.0, SAME, SAME
    direction = "up" if b > a else "down"
    if a == 0 or b == 0 or (a < 0) != (b < 0):
        return (None if a == 0 else b / a), f"{BUCKETS[-1]:g}x", direction
    ratio = b / a
    factor = max(ratio, 1 / ratio)
    reached = [t for t in BUCKETS if factor >= t - 1e-12]
    return ratio, (f"{reached[-1]:g}x" if reached else SAME), direction


def numeric_leaves(metrics: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, float]]:
    """Every numeric figure of a report's metrics, nested objects as dotted names."""
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, bool):
            continue
        if isinstance(value, int | float) and math.isfinite(value):
            yield name, float(value)
        elif isinstance(value, Mapping):
            yield from numeric_leaves(value, f"{name}.")


def _row(name: str, a: float | None, b: float | None) -> dict[str, Any]:
    if a is None or b is None:
        bucket = "added" if a is None else "removed"
        return {"name": name, "a": a, "b": b, "ratio": None, "bucket": bucket, "direction": None}
    ratio, bucket, direction = bucket_of(a, b)
    return {
        "name": name,
        "a": a,
        "b": b,
        "ratio": ratio,
        "bucket": bucket,
        "direction": direction,
    }


def _rows(a: Mapping[str, float], b: Mapping[str, float]) -> list[dict[str, Any]]:
    names = list(a) + [n for n in b if n not in a]
    return [_row(n, a.get(n), b.get(n)) for n in names]


def warning_key(warning: Any) -> str:
    """What tells warnings apart across compiles: the code and the nodes named."""
    if not isinstance(warning, Mapping):
        return str(warning)
    nodes = warning.get("nodes") or []
    named = ",".join(str(n) for n in nodes) if isinstance(nodes, list) else str(nodes)
    return f"{warning.get('code') or warning.get('message')}@{named}"


def _warning_diff(a: list[Any], b: list[Any]) -> tuple[list[Any], list[Any]]:
    left, right = Counter(map(warning_key, a)), Counter(map(warning_key, b))
    added, removed = right - left, left - right
    return _take(b, added), _take(a, removed)


def _take(warnings: list[Any], wanted: Counter[str]) -> list[Any]:
    out, left = [], Counter(wanted)
    for w in warnings:
        key = warning_key(w)
        if left[key] > 0:
            left[key] -= 1
            out.append(w)
    return out


def compare_sides(a: Side, b: Side) -> dict[str, Any]:
    """The comparison of two sides (see the module docstring)."""
    metrics = _rows(dict(numeric_leaves(a.metrics)), dict(numeric_leaves(b.metrics)))
    pass_times = _rows(_seconds(a.pass_times), _seconds(b.pass_times))
    added, removed = _warning_diff(list(a.warnings), list(b.warnings))
    changed = Counter(r["bucket"] for r in metrics if r["bucket"] != SAME)
    return {
        "a": describe(a),
        "b": describe(b),
        "status": f"{a.status} -> {b.status}",
        "changed": {k: changed[k] for k in _bucket_order() if changed[k]},
        "metrics": metrics,
        "warnings_added": added,
        "warnings_removed": removed,
        "pass_times": pass_times,
    }


def _bucket_order() -> list[str]:
    return [f"{t:g}x" for t in reversed(BUCKETS)] + ["added", "removed"]


def _seconds(times: Mapping[str, Any]) -> dict[str, float]:
    numbers = {k: v for k, v in times.items() if not isinstance(v, bool)}
    return {k: float(v) for k, v in numbers.items() if isinstance(v, int | float)}


def describe(side: Side) -> dict[str, Any]:
    return {
        "ref": str(side.ref),
        "kind": side.kind,
        "status": side.status,
        "qpc_id": str(side.qpc_id) if side.qpc_id else None,
        "job_id": str(side.job_id) if side.job_id else None,
        "compiler_version": side.compiler_version,
        "device": side.device,
        "error": side.error,
    }


# ------------------------------------------------------------------------------ database


def side_of(session: Session, team: Team, ref: uuid.UUID) -> Side:
    """The side `ref` names: a QPC of the team, else a finished compile job of the team."""
    qpc = session.get(Qpc, ref)
    if qpc is not None and qpc.team_id == team.id:
        return _qpc_side(ref, "qpc", qpc, get_report(session, qpc), None)
    job = session.get(CompileJob, ref)
    if job is None or job.team_id != team.id:
        raise not_found("qpc or compile job", ref)
    if job.status is JobStatus.succeeded and job.qpc is not None:
        return _qpc_side(ref, "job", job.qpc, get_report(session, job.qpc), job.id)
    if job.status is JobStatus.failed:
        error = {"code": job.error_code, "message": job.error_message}
        return Side(
            ref=ref,
            kind="job",
            status=FAILED,
            job_id=job.id,
            compiler_version=job.compiler,  # what it asked for (None: the default)
            device=job.device,
            error=error,
        )
    raise ServiceError(
        "not_comparable",
        f"compile job {job.id} is {job.status.value}: only a succeeded or failed job "
        "(or a QPC) can be compared",
        status=409,
    )


def _qpc_side(
    ref: uuid.UUID, kind: str, qpc: Qpc, report: CompileReport | None, job_id: uuid.UUID | None
) -> Side:
    return Side(
        ref=ref,
        kind=kind,
        status=PASSED,
        qpc_id=qpc.id,
        job_id=job_id,
        compiler_version=qpc.compiler_version,
        device=qpc.device,
        metrics=(report.metrics if report else None) or {},
        warnings=(report.warnings if report else None) or [],
        pass_times=(report.pass_times if report else None) or {},
    )


def compare(session: Session, team: Team, a: uuid.UUID, b: uuid.UUID) -> dict[str, Any]:
    return compare_sides(side_of(session, team, a), side_of(session, team, b))
