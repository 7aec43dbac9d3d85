"""The ranked table of a sweep, as `qpcfarm configure` and the benchmark print it, from
result rows in the API's shape (`rows_of` makes them from local results)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from compiler_core.configurator.search import Result

COLUMNS = (
    ("rank", 4), ("cores", 5), ("inst", 4), ("batch", 5), ("mos", 3), ("ols", 3), ("set", 3),
    ("latency_us", 11), ("inf/s", 11),
)  # fmt: skip
LLM_COLUMNS = (
    ("tokens_per_s", "tok/s", 10), ("decode_tokens_per_s", "seq tok/s", 10),
    ("ttft_ms", "ttft_ms", 9), ("tpot_ms", "tpot_ms", 9),
)  # fmt: skip
"""An LLM QPC's figures (`scoring.Score`), shown when a row has them."""
CARD_COLUMNS = (("socs", "SoCs", 4), ("cards", "cards", 5))
"""Where the instances run (`inst` is per SoC), shown when a row uses more than one SoC."""


def rows_of(items: Sequence[Result]) -> list[dict[str, Any]]:
    """Local results as API-shaped rows (rank in the given order; failed ones unranked)."""
    rows = []
    rank = 0
    for r in items:
        if r.score is not None:
            rank += 1
        rows.append(
            {
                "rank": rank if r.score is not None else None,
                "index": r.point.index,
                "params": dict(r.point.params),
                "flags": r.point.flags(),
                "cores": r.point.cores,
                "instances": r.point.instances,
                "batchsize": r.point.batchsize,
                "set_size": r.point.set_size,
                "latency_us": round(r.score.latency_us, 3) if r.score else None,
                "throughput": round(r.score.throughput, 2) if r.score else None,
                "device_latency_us": round(r.score.device_latency_us, 3) if r.score else None,
                "ddr_bound": r.score.ddr_bound if r.score else None,
                "instances_per_soc": r.point.instances,
                "socs": r.score.socs if r.score else None,
                "cards": r.score.cards if r.score else None,
                **{
                    key: (round(v, 3) if (v := getattr(r.score, key)) is not None else None)
                    for key, _, _ in LLM_COLUMNS
                    if r.score is not None
                },
                "estimated": True,
                "error": r.error,
            }
        )
    return rows


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.1f}" if value >= 100 else f"{value:.3f}"
    return str(value)


def render(rows: Sequence[Mapping[str, Any]], limit: int | None = None) -> str:
    """Fixed-width text: one line per result, best first, failed ones with their error."""
    llm = [c for c in LLM_COLUMNS if any(row.get(c[0]) is not None for row in rows)]
    many = any((row.get("socs") or 1) > 1 or (row.get("cards") or 1) > 1 for row in rows)
    extra = [*(CARD_COLUMNS if many else ()), *llm]
    widths = [*COLUMNS, *((label, width) for _, label, width in extra)]
    head = "  ".join(f"{name:>{width}}" for name, width in widths) + "  other flags"
    lines = [head, "-" * len(head)]
    shown = rows if limit is None else rows[:limit]
    for row in shown:
        params = row.get("params") or {}
        values = (
            row.get("rank"), row.get("cores"), row.get("instances"), row.get("batchsize"),
            params.get("mos"), params.get("ols"), row.get("set_size"),
            row.get("latency_us"), row.get("throughput"), *(row.get(c[0]) for c in extra),
        )  # fmt: skip
        cells = "  ".join(f"{_cell(v):>{w}}" for v, (_, w) in zip(values, widths, strict=True))
        known = {"cores", "instances", "batchsize", "mos", "ols", "set_size", "cards"}
        other = " ".join(f"{k}={v}" for k, v in params.items() if k not in known)
        if row.get("error"):
            other = (other + " " if other else "") + f"error: {row['error']}"
        lines.append(f"{cells}  {other}".rstrip())
    if limit is not None and len(rows) > limit:
        lines.append(f"... {len(rows) - limit} more")
    lines.append(
        "(latency, inferences/s and tokens figures are the cost model's estimates)"
        if llm
        else "(latency and inferences/s are the cost model's estimates)"
    )
    return "\n".join(lines)
