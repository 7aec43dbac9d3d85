"""Plain-text rendering of compile reports: perf metrics, pass times, warnings.

Generic over the shapes the compiler produces (nested dicts and lists of numbers and strings),
so a new metric shows up without touching this file.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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


def render_pass_times(pass_times: Mapping[str, float]) -> str:
    """`-time-passes`: one row per stage with milliseconds and share of the total."""
    total = sum(pass_times.values())
    name_width = max([len("pass"), len("total"), *(len(n) for n in pass_times)])
    lines = [f"{'pass'.ljust(name_width)}  {'time (ms)':>11}  {'%':>6}"]
    for name, seconds in pass_times.items():
        share = 100.0 * seconds / total if total > 0 else 0.0
        lines.append(f"{name.ljust(name_width)}  {seconds * 1e3:>11,.3f}  {share:>6.1f}")
    lines.append(f"{'total'.ljust(name_width)}  {total * 1e3:>11,.3f}  {100.0:>6.1f}")
    return "\n".join(lines) + "\n"


def render_warning(warning: Mapping[str, Any]) -> str:
    """`warning: [code] message (nodes) suggestion` on one line."""
    parts = [f"warning: [{warning.get('code', 'warning')}] {warning.get('message', '')}".rstrip()]
    nodes = [str(n) for n in warning.get("nodes") or []]
    if nodes:
        shown = ", ".join(nodes[:5]) + (f", ... ({len(nodes)} in all)" if len(nodes) > 5 else "")
        parts.append(f"({shown})")
    if warning.get("suggestion"):
        parts.append(str(warning["suggestion"]))
    return " ".join(parts).replace("\n", " ")
