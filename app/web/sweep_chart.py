"""The throughput-vs-latency scatter of a sweep, laid out for an inline SVG (no script):
every scored combination a point linking to its job, the Pareto front as a line, the best
ringed. Coordinates are computed here; the template only draws them."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

WIDTH, HEIGHT = 640, 340
LEFT, RIGHT, TOP, BOTTOM = 72, 16, 14, 42
TICKS = 5


@dataclass(frozen=True)
class ChartPoint:
    x: float
    y: float
    index: int
    job_id: str | None
    label: str
    front: bool
    best: bool


@dataclass
class Chart:
    width: int = WIDTH
    height: int = HEIGHT
    left: int = LEFT
    top: int = TOP
    plot_w: int = WIDTH - LEFT - RIGHT
    plot_h: int = HEIGHT - TOP - BOTTOM
    points: list[ChartPoint] = field(default_factory=list)
    front_path: str = ""
    x_ticks: list[tuple[float, str]] = field(default_factory=list)
    y_ticks: list[tuple[float, str]] = field(default_factory=list)


def _nice_ticks(low: float, high: float) -> list[float]:
    if high <= low:
        high = low + 1.0
    raw = (high - low) / TICKS
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    ticks = [round(math.floor(low / step) * step, 10)]
    while ticks[-1] < high:  # the last tick is at or above the highest value: all plot inside
        ticks.append(round(ticks[-1] + step, 10))
    return ticks


def _label(value: float) -> str:
    if value >= 1e6:
        return f"{value / 1e6:g}M"
    if value >= 1e3:
        return f"{value / 1e3:g}k"
    return f"{value:g}"


def build_chart(
    results: Sequence[Mapping[str, Any]], front: Sequence[int], best: Mapping[str, Any] | None
) -> Chart:
    """The chart of the scored results (latency on x, inferences/s on y, both from 0)."""
    chart = Chart()
    scored = [r for r in results if r.get("throughput") is not None]
    if not scored:
        return chart
    xs = _nice_ticks(0.0, max(float(r["latency_us"]) for r in scored))
    ys = _nice_ticks(0.0, max(float(r["throughput"]) for r in scored))
    x_max, y_max = xs[-1] or 1.0, ys[-1] or 1.0

    def px(x: float) -> float:
        return round(chart.left + x / x_max * chart.plot_w, 1)

    def py(y: float) -> float:
        return round(chart.top + chart.plot_h - y / y_max * chart.plot_h, 1)

    chart.x_ticks = [(px(t), _label(t)) for t in xs]
    chart.y_ticks = [(py(t), _label(t)) for t in ys]
    on_front = set(front)
    best_index = best["index"] if best else None
    for r in scored:
        label = (
            f"#{r['rank']}: {' '.join(r['flags'])} | latency {r['latency_us']:.3f} us, "
            f"{r['throughput']:,.1f} inf/s (estimated)"
        )
        chart.points.append(
            ChartPoint(
                px(r["latency_us"]),
                py(r["throughput"]),
                r["index"],
                r.get("job_id"),
                label,
                r["index"] in on_front,
                r["index"] == best_index,
            )  # fmt: skip
        )
    line = sorted((p for p in chart.points if p.front), key=lambda p: p.x)
    chart.front_path = " ".join(f"{p.x},{p.y}" for p in line)
    chart.points.sort(key=lambda p: (p.best, p.front))  # the best is drawn last, on top
    return chart
