"""The sweep page's scatter: every point inside the plot, whatever the figures' magnitudes."""

from __future__ import annotations

import pytest

from app.web.sweep_chart import build_chart


@pytest.mark.parametrize(
    "top_latency, top_throughput",
    [(2441.3, 6553.9), (19.316, 103_541.1), (1.07, 1.07e6), (77.264, 1_000_000.0), (0.5, 3.0)],
)
def test_every_point_of_the_scatter_lies_inside_the_plot(
    top_latency: float, top_throughput: float
) -> None:
    results = [
        {"index": i, "rank": i + 1, "flags": [f"-x={i}"], "job_id": None,
         "latency_us": top_latency * f, "throughput": top_throughput * f}
        for i, f in enumerate((1.0, 0.8, 0.31, 0.05))
    ]  # fmt: skip
    chart = build_chart(results, front=[0], best=results[0])
    assert len(chart.points) == 4
    for point in chart.points:
        assert chart.left <= point.x <= chart.left + chart.plot_w, point
        assert chart.top <= point.y <= chart.top + chart.plot_h, point
    assert chart.y_ticks[-1][0] <= min(p.y for p in chart.points)  # the top tick covers them
