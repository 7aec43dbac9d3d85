"""Code generation benchmark: estimated latency and throughput of real networks on the modelled
AIC100 Standard (fp16), against the physical floors of each program and the published per-card
figures, for 1, 4 and 14 cores and batch 1, 8 and 16.

    python bench/codegen.py [--models resnet50,resnet50-df,bert-base,bert-large,
        decoder-prefill,decoder-decode] [--cores 1,4,14] [--batches 1,8,16] [--before DIR]
        [--json OUT]

`resnet50-df` is ResNet-50 compiled with `-aic-enable-depth-first` (image groups chosen by the
cost model; batch > 1 only): the rows beside `resnet50`'s show what depth-first changes.

Every figure is the compiler's own estimate (`-aic-perf-metrics`) of the program it emitted:
latency (the input crossing PCIe included), device latency (inputs already in DDR), throughput
(batch / the larger of the device latency and the PCIe transfers: queued inferences overlap
them), HMX utilisation (useful MACs over the peak of every core
for the whole latency), and the two floors no schedule can beat: every MAC at the peak rate,
and every byte that must cross DDR (inputs, outputs, weights not resident on chip) at the DDR
bandwidth. `--before DIR` compiles the same configurations with another checkout of the
compiler (e.g. a `git worktree` of an older commit) in a subprocess, for a before/after table.

The published figures are per card, int8, MLPerf Inference v1.0: ResNet-50 19,379 images/s and
BERT 671 sequences/s. They are printed for scale only: these runs are fp16.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

PUBLISHED = {
    "resnet50": "19,379 img/s",
    "resnet50-df": "19,379 img/s",
    "bert-base": "671 seq/s",
    "bert-large": "671 seq/s",
}
"""Per card, int8, MLPerf Inference v1.0 (BERT: the Large model at seq 384)."""

DEVICE = "aic100-standard"


@dataclass
class Row:
    model: str
    cores: int
    batch: int
    latency_us: float
    device_us: float
    per_second: float
    hmx_percent: float
    floor_compute_us: float
    floor_ddr_us: float
    over_floor: float
    resident_mib_per_core: float
    ddr_mib: float
    compile_s: float
    error: str = ""
    groups: int = 1
    """Image groups of the depth-first schedule (1: batch-major)."""


def model_path(name: str, work: Path, batch: int) -> tuple[Path, list[str]]:
    """The model file and the flags that bind its batch (and, for the decoder, its state)."""
    from models import RESNET50, write_resnet
    from transformer_models import (
        BERT_BASE,
        BERT_LARGE,
        DECODER_1B_DECODE,
        DECODER_1B_PREFILL,
        write_decoder,
        write_encoder,
    )

    if name in ("resnet50", "resnet50-df"):
        depth_first = ["-aic-enable-depth-first"] if name == "resnet50-df" else []
        flags = ["-convert-to-fp16", f"-batchsize={batch}", *depth_first]
        return write_resnet(RESNET50, work), flags
    if name in ("bert-base", "bert-large"):
        spec = BERT_BASE if name == "bert-base" else BERT_LARGE
        return write_encoder(spec, work), ["-convert-to-fp16", f"-onnx-define-symbol=batch,{batch}"]
    spec = DECODER_1B_PREFILL if name == "decoder-prefill" else DECODER_1B_DECODE
    return write_decoder(spec, work), ["-retained-state", f"-onnx-define-symbol=batch,{batch}"]


def measure(name: str, cores: int, batch: int, work: Path) -> Row:
    from compiler_core import compile_model

    path, flags = model_path(name, work, batch)
    start = time.perf_counter()
    try:
        result = compile_model(
            str(path), [*flags, f"-aic-num-cores={cores}", f"-aic-device={DEVICE}"]
        )
        seconds = time.perf_counter() - start
        m = result.metrics
    except Exception as exc:  # noqa: BLE001 - a failed configuration is a row, not a crash
        return Row(name, cores, batch, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, f"{type(exc).__name__}: {exc}")
    latency = float(m["estimated_latency_us"])
    floor_c = float(m.get("floor_compute_us", 0.0))
    floor_d = float(m.get("floor_ddr_us", 0.0))
    ddr = m["memory_traffic"]["total"]
    result.cleanup()
    return Row(
        model=name,
        cores=cores,
        batch=batch,
        latency_us=latency,
        device_us=float(m.get("estimated_device_latency_us", latency)),
        per_second=float(m["estimated_inferences_per_second"] or 0.0),
        hmx_percent=float(m.get("hmx_utilization_percent", m["unit_busy_percent"]["hmx"])),
        floor_compute_us=floor_c,
        floor_ddr_us=floor_d,
        over_floor=latency / max(floor_c, floor_d) if max(floor_c, floor_d) else 0.0,
        resident_mib_per_core=m.get("resident_constants_bytes_per_core", 0) / 2**20,
        ddr_mib=(ddr["ddr_read_bytes"] + ddr["ddr_write_bytes"]) / 2**20,
        compile_s=seconds,
        groups=int(m.get("depth_first_groups", 1)),
    )


def measure_elsewhere(checkout: Path, name: str, cores: int, batch: int, work: Path) -> Row:
    """The same configuration compiled by another checkout of the compiler."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    argv = [sys.executable, str(Path(__file__)), "--one", name, str(cores), str(batch)]
    argv += ["--work-dir", str(work)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        error = (done.stderr.strip().splitlines() or ["failed"])[-1]
        return Row(name, cores, batch, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, error)
    return Row(**json.loads(done.stdout.strip().splitlines()[-1]))


def configurations(models: list[str], cores: list[int], batches: list[int]) -> list[tuple]:
    out = []
    for name in models:
        model_batches = [1] if name.startswith("decoder") else batches
        if name == "resnet50-df":
            model_batches = [b for b in batches if b > 1]  # image groups need a batch
        model_cores = cores if not name.startswith("decoder") else [c for c in cores if c >= 4]
        for c in model_cores:
            for b in model_batches:
                if name == "bert-large" and b > 1 and c < 14:
                    continue  # minutes each, and not in the targets
                out.append((name, c, b))
    return out


def _fmt(row: Row | None, field: str, spec: str) -> str:
    if row is None or row.error:
        return "-"
    return format(getattr(row, field), spec)


def render(rows: list[tuple[Row, Row | None]]) -> str:
    head = (
        "| model | cores | batch | latency us (before) | device us | per s (before) | HMX % | "
        "floor us (compute / DDR) | x floor | resident MiB/core | DDR MiB/inf | published |"
    )
    lines = [head, "|" + "---|" * 12]
    for after, before in rows:
        if after.error:
            lines.append(
                f"| {after.model} | {after.cores} | {after.batch} | failed: {after.error} |"
                + " |" * 8
            )
            continue
        groups = f" ({after.groups} groups)" if after.groups > 1 else ""
        lines.append(
            f"| {after.model}{groups} | {after.cores} | {after.batch} "
            f"| {after.latency_us:,.0f} ({_fmt(before, 'latency_us', ',.0f')}) "
            f"| {after.device_us:,.0f} "
            f"| {after.per_second:,.0f} ({_fmt(before, 'per_second', ',.0f')}) "
            f"| {after.hmx_percent:.1f} "
            f"| {after.floor_compute_us:,.0f} / {after.floor_ddr_us:,.0f} "
            f"| {after.over_floor:.2f} "
            f"| {after.resident_mib_per_core:.1f} | {after.ddr_mib:,.1f} "
            f"| {PUBLISHED.get(after.model, '')} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models",
        default="resnet50,resnet50-df,bert-base,bert-large,decoder-prefill,decoder-decode",
    )
    parser.add_argument("--cores", default="1,4,14")
    parser.add_argument("--batches", default="1,8,16")
    parser.add_argument("--work-dir", default=str(HERE / ".work"))
    parser.add_argument("--before", help="another checkout of the compiler to compare with")
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--one", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    if args.one:
        name, cores, batch = args.one
        print(json.dumps(asdict(measure(name, int(cores), int(batch), work))))
        return 0
    configs = configurations(
        args.models.split(","),
        [int(c) for c in args.cores.split(",")],
        [int(b) for b in args.batches.split(",")],
    )
    rows: list[tuple[Row, Row | None]] = []
    for name, cores, batch in configs:
        after = measure(name, cores, batch, work)
        before = (
            measure_elsewhere(Path(args.before), name, cores, batch, work) if args.before else None
        )
        rows.append((after, before))
        print(
            f"{name} cores={cores} batch={batch}: {after.latency_us:,.0f} us "
            f"({after.over_floor:.2f}x floor) {after.error}",
            file=sys.stderr,
        )
    print(render(rows))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                [{"after": asdict(a), "before": asdict(b) if b else None} for a, b in rows],
                indent=2,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
