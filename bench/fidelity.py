"""Fidelity of the estimates: the configurator's best configuration of a model on a card,
beside the public per-card result of the same model on the same card.

    python bench/fidelity.py --quick      # cores {4,8,16} x instances x batch {1,4,8} (minutes)
    python bench/fidelity.py              # the full space (hours on 2 CPUs)
    python bench/fidelity.py --only resnet --json bench/out/fidelity.json

Each row compiles its model as the published result was produced: int8 (ONNX Runtime's
`quantize_static` QDQ form, as `bench/int8.py` makes it, the input and output as int8 codes
through the custom-IO list where a Q/DQ pair sits on them, and `-convert-to-fp16` so that the
ops with no integer kernel compute in fp16: mixed precision, as the vendor's int8 BERT runs;
in fp32 they would take half of BERT's time), for the card (`-aic-device`), and
lets the configurator (`compiler_core.configurator`, docs/configurator.md) pick the best
configuration over cores, instances, batch, set size and `-ols`/`-mos`, scored as a whole
card (instances per SoC x SoCs x cards, the host link and the per-inference host overheads).
The fp16 rows (`-convert-to-fp16` of the float model) have no published figure: they sit
beside the int8 ones to show the int8 gain.

Printed: the estimated and published inferences per second per card, their ratio, the best
configuration, the best program's device time over its compute floor, and the mean absolute
error in percent over the rows with a published figure (target: each within +-15%). The
models are random-weight builds of the real shapes (`bench/models.py`,
`bench/transformer_models.py`); nothing here is fitted to the published figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.report import emit, progress  # noqa: E402


@dataclass(frozen=True)
class Published:
    """One row: a model, its precision, the card, and the public per-card figure (None: a
    row shown beside the others, with nothing published to compare)."""

    key: str
    model: str
    precision: str
    device: str
    per_card: float | None
    source: str


MLPERF_V31 = "MLPerf Inference v3.1, datacenter, offline, per card"
ROWS: tuple[Published, ...] = (
    Published("resnet50-int8", "ResNet-50", "int8", "aic100-pro", 24_876.0, MLPERF_V31),
    Published("bert-large-int8", "BERT-Large seq 384", "int8", "aic100-pro", 784.0, MLPERF_V31),
    Published("resnet50-fp16", "ResNet-50", "fp16", "aic100-pro", None, "(int8 gain)"),
    Published("bert-large-fp16", "BERT-Large seq 384", "fp16", "aic100-pro", None, "(int8 gain)"),
)
TARGET = 0.15
"""Each published row within +-15% (issue 21)."""


def ratio(estimated: float, published: float | None) -> float | None:
    return None if published is None or published <= 0 else estimated / published


def mean_absolute_error_percent(pairs: Sequence[tuple[float, float | None]]) -> float | None:
    """Mean of |estimated / published - 1| in percent over the pairs that have a published
    figure; None when none has."""
    errors = [abs(e / p - 1.0) for e, p in pairs if p is not None and p > 0]
    return 100.0 * sum(errors) / len(errors) if errors else None


def space_rows(quick: bool, cores_per_soc: int) -> tuple[list[dict[str, Any]], list[str]]:
    """The search space (every combination) and its constraint: one SoC's cores shared by
    the instances."""
    if quick:
        axes: dict[str, list[Any]] = {
            "cores": [4, 8, 16],
            "instances": [1, 2, 4],
            "batchsize": [1, 4, 8],
            "set_size": [1, 2],
        }
    else:
        axes = {
            "cores": [1, 2, 4, 8, 16],
            "instances": [1, 2, 4, 8, 16],
            "batchsize": [1, 2, 4, 8, 16],
            "set_size": [1, 2, 4],
            "ols": [1, 2, 4],
            "mos": [1, 4],
        }
    rows: list[dict[str, Any]] = [{}]
    for name, values in axes.items():
        rows = [{**r, name: v} for r in rows for v in values]
    constraints = [f"cores * instances <= {cores_per_soc}"]
    if not quick:
        constraints += ["ols <= cores", "mos <= cores"]
    return rows, constraints


# --- models ----------------------------------------------------------------------------------


def float_model(row: Published, work: Path) -> tuple[Path, list[str]]:
    """The float model of a row (built in code, cached in `work`) and its shape flags."""
    if row.model.startswith("ResNet-50"):
        from bench.models import RESNET50, write_resnet

        return write_resnet(RESNET50, work), []
    from bench.transformer_models import BERT_LARGE, write_encoder

    return write_encoder(BERT_LARGE, work), []


def int8_model(path: Path, work: Path) -> tuple[Path, list[str]]:
    """ONNX Runtime's QDQ form of the float model (`bench/int8.py`'s `ort_int8`, cached) and
    the custom-IO flag that makes its quantized input and output int8 codes on the host."""
    import onnx

    from bench.int8 import int8_io_listing, ort_int8_cached

    qdq = ort_int8_cached(path, work)
    model = onnx.load(qdq, load_external_data=False)
    consumers: dict[str, list[str]] = {}
    producer: dict[str, str] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node.op_type)
        for name in node.output:
            producer[name] = node.op_type
    io = [
        i.name
        for i in model.graph.input
        if consumers.get(i.name) and set(consumers[i.name]) == {"QuantizeLinear"}
    ]
    io += [o.name for o in model.graph.output if producer.get(o.name) == "DequantizeLinear"]
    if not io:
        return qdq, []
    return qdq, [f"-custom-IO-list-file={int8_io_listing(path, io, work)}"]


# --- one row ---------------------------------------------------------------------------------


def run_row(row: Published, quick: bool, jobs: int, mode: str, work: Path) -> dict[str, Any]:
    from compiler_core.configurator.local import run_local
    from compiler_core.configurator.space import build_space
    from compiler_core.devices import get_device

    device = get_device(row.device)
    started = time.monotonic()
    path, flags = float_model(row, work)
    if row.precision == "int8":
        path, flags = int8_model(path, work)
    # int8 rows too: what has no integer kernel (Softmax, LayerNormalization, GELU) computes
    # in fp16, as int8 networks are deployed (mixed precision), not in fp32
    flags = [*flags, "-convert-to-fp16"]
    prepared_s = time.monotonic() - started
    rows, constraints = space_rows(quick, device.num_cores)
    space = build_space(rows, [f"-aic-device={row.device}", *flags], constraints)
    metrics: dict[int, dict[str, Any]] = {}

    def on_result(group: int, outcome: dict[str, Any]) -> None:
        if "metrics" in outcome:
            metrics[group] = outcome["metrics"]
        progress(f"  {row.key}: group {group}: {outcome.get('error', 'ok')}")

    sweep = run_local(path, space, mode=mode, jobs=jobs, on_result=on_result)
    out: dict[str, Any] = {
        "key": row.key,
        "model": row.model,
        "precision": row.precision,
        "device": row.device,
        "published": row.per_card,
        "source": row.source,
        "compiles": sweep.compiles,
        "failed": sweep.failed,
        "prepare_s": round(prepared_s, 1),
        "sweep_s": round(sweep.seconds, 1),
    }
    if sweep.best is None or sweep.best.score is None:
        out["error"] = "; ".join(sorted(set(sweep.errors.values())))[:300] or "no result"
        return out
    best, score = sweep.best.point, sweep.best.score
    m = metrics.get(best.group, {})
    floor = m.get("floor_compute_us")
    out.update(
        estimated=round(score.throughput, 1),
        ratio=ratio(score.throughput, row.per_card),
        config={
            "cores": best.cores,
            "instances_per_soc": score.instances_per_soc,
            "socs": score.socs,
            "cards": score.cards,
            "batch": best.batchsize,
            "set_size": best.set_size,
            "ols": best.params.get("ols"),
            "mos": best.params.get("mos"),
        },
        device_us=round(score.device_latency_us, 1),
        host_transfer_us=round(score.host_transfer_us, 1),
        host_overhead_us=round(score.host_overhead_us, 1),
        ddr_bound=score.ddr_bound,
        card_link_bound=score.card_link_bound,
        floor_compute_us=floor,
        over_floor=round(score.device_latency_us / floor, 2) if floor else None,
        hmx_busy_percent=(m.get("unit_busy_percent") or {}).get("hmx"),
    )
    return out


# --- report ----------------------------------------------------------------------------------


def _config_text(c: dict[str, Any]) -> str:
    text = f"{c['cores']} cores x {c['instances_per_soc']}, batch {c['batch']}, set {c['set_size']}"
    for flag in ("ols", "mos"):
        if c.get(flag) is not None:
            text += f", -{flag} {c[flag]}"
    return text


def table(results: Sequence[dict[str, Any]]) -> list[str]:
    lines = [
        "| model | precision | card | estimated /s per card | published /s per card | ratio | "
        "within +-15% | best configuration | device us (x compute floor) | HMX % |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(
                f"| {r['model']} | {r['precision']} | {r['device']} | failed: {r['error']} "
                "| | | | | | |"
            )
            continue
        pub = "-" if r["published"] is None else f"{r['published']:,.0f}"
        rat = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        within = "-" if r["ratio"] is None else ("yes" if abs(r["ratio"] - 1) <= TARGET else "no")
        floor = f" ({r['over_floor']}x)" if r.get("over_floor") else ""
        lines.append(
            f"| {r['model']} | {r['precision']} | {r['device']} | {r['estimated']:,.0f} | {pub} | "
            f"{rat} | {within} | {_config_text(r['config'])} | {r['device_us']:,.1f}{floor} | "
            f"{r.get('hmx_busy_percent', '')} |"
        )
    mae = mean_absolute_error_percent(
        [(r["estimated"], r["published"]) for r in results if "error" not in r]
    )
    lines.append("")
    lines.append(
        "mean absolute error: "
        + ("n/a" if mae is None else f"{mae:.1f}% over the rows with a published figure")
    )
    by_key = {r["key"]: r for r in results if "error" not in r}
    for model in ("resnet50", "bert-large"):
        a, b = by_key.get(f"{model}-int8"), by_key.get(f"{model}-fp16")
        if a and b and b["estimated"]:
            lines.append(f"{model}: int8 / fp16 estimated = {a['estimated'] / b['estimated']:.2f}x")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small search space (minutes)")
    parser.add_argument("--only", help="run only the rows whose key contains this")
    parser.add_argument("--jobs", type=int, default=1, help="compiles at once")
    parser.add_argument("--mode", choices=("brute", "optimize"), default="brute")
    parser.add_argument("--work", type=Path, default=ROOT / "bench" / "out", help="model folder")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    results = []
    for row in ROWS:
        if args.only and args.only.lower() not in row.key:
            continue
        progress(f"{row.key}: {row.model} {row.precision} on {row.device}")
        results.append(run_row(row, args.quick, args.jobs, args.mode, args.work))
        progress(f"  {json.dumps(results[-1])}")
    emit(table(results), results, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
