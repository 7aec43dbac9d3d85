"""Plain-text rendering of compile reports: perf metrics, pass times, warnings.

Generic over the shapes the compiler produces (nested dicts and lists of numbers and strings),
so a new metric shows up without touching this file.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

INDENT = "  "


def format_number(value: Any) -> str:
    """Integers with thousands separators; floats to a sensible precision."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            return str(value)
        if value.is_integer() and abs(value) >= 1000:
            return f"{value:,.0f}"
        if abs(value) >= 1000:
            return f"{value:,.1f}"
        return f"{value:.4g}"
    if value is None:
        return "-"
    return str(value)


def _is_scalar(value: Any) -> bool:
    return not isinstance(value, (Mapping, list, tuple))


def _table(rows: Sequence[Mapping[str, Any]], depth: int) -> list[str]:
    """A list of flat dicts (a histogram, per-core figures) as an aligned table."""
    columns: list[str] = []
    for row in rows:
        columns.extend(str(k) for k in row if str(k) not in columns)
    cells = [[format_number(row.get(c)) for c in columns] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    pad = INDENT * depth
    lines = [pad + "  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True))]
    lines += [pad + "  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    return lines


def _render(value: Any, depth: int) -> list[str]:
    pad = INDENT * depth
    if isinstance(value, Mapping):
        scalars = [str(k) for k, v in value.items() if _is_scalar(v)]
        key_width = max((len(k) for k in scalars), default=0)
        num_width = max((len(format_number(v)) for v in value.values() if _is_scalar(v)), default=0)
        lines: list[str] = []
        for key, item in value.items():
            if _is_scalar(item):
                text = format_number(item)
                shown = text.rjust(num_width) if isinstance(item, (int, float)) else text
                lines.append(f"{pad}{str(key).ljust(key_width)}  {shown}".rstrip())
            else:
                lines.append(f"{pad}{key}:")
                lines.extend(_render(item, depth + 1))
        return lines
    if isinstance(value, (list, tuple)):
        if value and all(
            isinstance(v, Mapping) and all(map(_is_scalar, v.values())) for v in value
        ):
            return _table(value, depth)
        if all(_is_scalar(v) for v in value):
            return [pad + ", ".join(format_number(v) for v in value)]
        lines = []
        for index, item in enumerate(value):
            lines.append(f"{pad}[{index}]")
            lines.extend(_render(item, depth + 1))
        return lines
    return [pad + format_number(value)]


def render_metrics(
    metrics: Mapping[str, Any], title: str = "Performance metrics (estimated)"
) -> str:
    """Nested metrics as an indented, key-aligned listing."""
    return "\n".join([title, *_render(metrics, 1)]) + "\n"


PASS_SEPARATOR = "/"
"""`graph-passes/fold-constants`: a pass run inside a stage (`CompileResult.pass_times`)."""


@dataclass(frozen=True)
class PassTimeRow:
    name: str
    seconds: float
    share: float
    """Percent of the whole compile."""
    depth: int
    """0 for a stage, 1 for a pass inside it."""


def pass_time_rows(pass_times: Mapping[str, float]) -> tuple[list[PassTimeRow], float]:
    """The stages in run order, each followed by the passes it ran, and the total: the sum
    of the stages alone (a stage's time already holds its passes')."""
    total = sum(s for name, s in pass_times.items() if PASS_SEPARATOR not in name)
    rows = []
    for name, seconds in pass_times.items():
        depth = name.count(PASS_SEPARATOR)
        shown = name.rsplit(PASS_SEPARATOR, 1)[-1]
        share = 100.0 * seconds / total if total > 0 else 0.0
        rows.append(PassTimeRow(shown, seconds, share, min(depth, 1)))
    return rows, total


def render_pass_times(pass_times: Mapping[str, float]) -> str:
    """`-time-passes`: each stage with milliseconds and share of the compile, the graph
    passes indented under their stage, and the total (of the stages: nothing counted twice)."""
    rows, total = pass_time_rows(pass_times)
    labels = [INDENT * row.depth + row.name for row in rows]
    name_width = max([len("pass"), len("total"), *(len(label) for label in labels)])
    lines = [f"{'pass'.ljust(name_width)}  {'time (ms)':>11}  {'%':>6}"]
    for label, row in zip(labels, rows, strict=True):
        lines.append(f"{label.ljust(name_width)}  {row.seconds * 1e3:>11,.3f}  {row.share:>6.1f}")
    lines.append(f"{'total'.ljust(name_width)}  {total * 1e3:>11,.3f}  {100.0:>6.1f}")
    return "\n".join(lines) + "\n"


KIND_OPTION = "option"
"""About the options themselves (deprecated, without effect, found nothing to act on)."""
KIND_IMPORT = "import"
"""What importing the model noticed (unused symbols, data-dependent shapes...)."""
KIND_PRECISION = "precision"
"""Numerics at risk (-convert-to-fp16 clipping or flushing constants)."""
KIND_PERF = "perf"
"""The `-aic-perf-warnings` analysis: printed only with that flag."""
WARNING_KINDS = (KIND_OPTION, KIND_IMPORT, KIND_PRECISION, KIND_PERF)
_KIND_BY_CODE = {"import": KIND_IMPORT, "fp16_clipped": KIND_PRECISION}
"""Reports stored before warnings carried a `kind`: what their codes meant."""
_OPTION_CODES = frozenset(
    {
        "deprecated_option",
        "option_without_effect",
        "mxfp6_no_weights",
        "retained_state_unused",
        "pmu_event_not_modelled",
    }
)
NODES_SHOWN = 8
"""Node names a warning line lists before saying how many more it names."""


def warning_kind(warning: Mapping[str, Any]) -> str:
    """The warning's `kind` (`option`, `import`, `precision`, `perf`)."""
    kind = warning.get("kind")
    if kind in WARNING_KINDS:
        return str(kind)
    code = str(warning.get("code", ""))
    if code in _OPTION_CODES:
        return KIND_OPTION
    return _KIND_BY_CODE.get(code, KIND_PERF)


def render_warning(warning: Mapping[str, Any]) -> str:
    """`warning: [code] message (nodes: ...); suggestion: ...` on one line."""
    text = f"warning: [{warning.get('code', 'warning')}] {warning.get('message', '')}".rstrip()
    nodes = [str(n) for n in warning.get("nodes") or []]
    if nodes:
        more = len(nodes) - NODES_SHOWN
        listed = ", ".join(nodes[:NODES_SHOWN]) + (f" and {more} more" if more > 0 else "")
        text += f" (nodes: {listed})"
    if warning.get("suggestion"):
        text += f"; suggestion: {warning['suggestion']}"
    return " ".join(text.split())
