"""A profile's summary and trace as the profile page draws them (plain data, no HTML).

The per-operator chart is the summary's `operators` (slowest-core cycles, share of the
inference); the timeline is the Chrome trace's spans of the first inference, one lane per
core and thread, scaled into an SVG of fixed width.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

CHART_ROWS = 40
"""Operators shown as bars; the rest are counted, not drawn (they are in the downloads)."""
MAX_SPANS = 5000
"""Spans drawn at most; a huge network's trace is for Perfetto, the page shows its start."""
LABEL_W = 96
PLOT_W = 900
LANE_H = 16
LANE_GAP = 3
AXIS_H = 18


@dataclass(frozen=True)
class Bar:
    op: str
    type: str
    unit: str
    cores: int
    cycles: float
    share_percent: float
    width_percent: float
    """Of the chart's widest bar, so the top operator spans the column."""
    nodes: list[str]


@dataclass(frozen=True)
class Chart:
    bars: list[Bar] = field(default_factory=list)
    hidden: int = 0


def operator_chart(summary: dict[str, Any] | None, rows: int = CHART_ROWS) -> Chart:
    if not summary:
        return Chart()
    operators = list(summary.get("operators", []))
    shown = operators[:rows]
    widest = max((float(r["cycles"]) for r in shown), default=0.0)
    bars = [
        Bar(
            op=str(r["op"]),
            type=str(r["type"]),
            unit=str(r["unit"]),
            cores=int(r["cores"]),
            cycles=float(r["cycles"]),
            share_percent=float(r["share_percent"]),
            width_percent=100.0 * float(r["cycles"]) / widest if widest else 0.0,
            nodes=[str(n) for n in r.get("nodes", [])],
        )
        for r in shown
    ]
    return Chart(bars, len(operators) - len(shown))


@dataclass(frozen=True)
class Span:
    x: float
    y: float
    width: float
    kind: str
    """`op`, `wait` or the thread kind (`hvx`, `hmx`, `dma`): the colour."""
    title: str


@dataclass(frozen=True)
class Lane:
    label: str
    y: float


LEGEND = {
    "op": "kernel (the core's op lane)",
    "wait": "waiting on a semaphore",
    "hmx": "HMX thread (matrix unit)",
    "hvx": "HVX thread (vector unit)",
    "dma": "DMA thread (transfers)",
}
"""What each span colour means, in the legend's order; a kind not listed shows by its name."""


@dataclass(frozen=True)
class Timeline:
    lanes: list[Lane] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    width: int = LABEL_W + PLOT_W
    height: int = 0
    duration_us: float = 0.0
    truncated: bool = False
    ticks: list[tuple[float, str]] = field(default_factory=list)

    @property
    def legend(self) -> list[tuple[str, str]]:
        """(kind, meaning) of every kind of span drawn, in `LEGEND` order."""
        kinds = {span.kind for span in self.spans}
        known = [(kind, text) for kind, text in LEGEND.items() if kind in kinds]
        return known + [(kind, kind) for kind in sorted(kinds - set(LEGEND))]


def timeline(trace: dict[str, Any] | None, max_spans: int = MAX_SPANS) -> Timeline:
    """Lanes (core x lane name, in the trace's order) and the first inference's spans."""
    if not trace:
        return Timeline()
    events = trace.get("traceEvents", [])
    process: dict[int, str] = {}
    lane_names: dict[tuple[int, int], str] = {}
    for e in events:
        if e.get("ph") != "M":
            continue
        if e.get("name") == "process_name":
            process[int(e["pid"])] = str(e["args"]["name"])
        elif e.get("name") == "thread_name":
            lane_names[(int(e["pid"]), int(e["tid"]))] = str(e["args"]["name"])
    spans = [
        e
        for e in events
        if e.get("ph") == "X"
        and e.get("cat") != "setup"
        and e.get("args", {}).get("inference", 0) == 0
    ]
    truncated = len(spans) > max_spans
    spans = sorted(spans, key=lambda e: float(e["ts"]))[:max_spans]
    if not spans:
        return Timeline()
    start = min(float(e["ts"]) for e in spans)
    end = max(float(e["ts"]) + float(e.get("dur", 0.0)) for e in spans)
    length = max(end - start, 1e-9)
    used = sorted({(int(e["pid"]), int(e["tid"])) for e in spans})
    rows = {key: AXIS_H + i * (LANE_H + LANE_GAP) for i, key in enumerate(used)}
    lanes = [
        Lane(f"{_core(process.get(pid, str(pid)))} {lane_names.get((pid, tid), str(tid))}", y)
        for (pid, tid), y in rows.items()
    ]
    drawn = []
    for e in spans:
        x = LABEL_W + PLOT_W * (float(e["ts"]) - start) / length
        width = max(PLOT_W * float(e.get("dur", 0.0)) / length, 0.5)
        cat = str(e.get("cat", "op"))
        kind = "hvx" if cat.startswith("hvx") else cat
        title = f"{e['name']}: {float(e.get('dur', 0.0)):,.3f} us"
        nodes = e.get("args", {}).get("onnx_nodes")
        if nodes:
            title += f" · nodes {', '.join(nodes)}"
        drawn.append(
            Span(round(x, 2), rows[(int(e["pid"]), int(e["tid"]))], round(width, 2), kind, title)
        )
    ticks = [(LABEL_W + PLOT_W * i / 4, f"{length * i / 4:,.2f} us") for i in range(5)]
    height = AXIS_H + len(used) * (LANE_H + LANE_GAP)
    return Timeline(lanes, drawn, LABEL_W + PLOT_W, height, length, truncated, ticks)


def _core(process_name: str) -> str:
    """`NSP core c00` -> `c00` (lane labels must fit the label column)."""
    return process_name.rsplit(" ", 1)[-1]
