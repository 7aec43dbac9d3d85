"""LLM benchmark: GPT-J-6B's shape compiled as users compile LLMs for the card (prefill and
decode specializations in one QPC, the KV cache as retained state), in fp16 and with MXFP6
weights, on the modelled AIC100 Standard; the fit check of OPT-13B's shape; and a 7 B decoder's
decode on 1, 2 and 4 SoCs of an Ultra card (multi-device partitioning, `mdp-7b`); and what
compiling that 7 B decoder with prefill and decode specializations takes (`7b-compile`: wall
time, CPU time, peak RSS, optionally beside another checkout of the compiler).

    python bench/llm.py [--work DIR]
        [--cases gptj-fp16,gptj-mxfp6,opt13b-fit,cb-fp16,cb-mxint8,mdp-7b,7b-compile]
        [--cores 14] [--keep] [--json OUT] [--mdp-layers 32] [--compile-socs 1,4]
        [--before DIR]

Every figure is the compiler's own estimate (`-aic-perf-metrics`, its `llm` section) of the
program it emitted: decode tokens/s (batch 1, a context of 2048, so attention reads every
cache row), time to first token of a 1024-token prompt, beside the published figures
(Qualcomm's microscaling article: GPT-J-6B on a Standard card 8.08 tokens/s in fp16, 13.9
with MXFP6, 1.72x). Published figures are checks, never inputs. Each compile runs in a child
process: its wall time and peak RSS (ru_maxrss of the child) are reported.

The models are random-weight decoders of the published shapes written by
`transformer_models.write_decoder` (fp16, weights as external data; GPT-J-6B is about 12 GB
on disk, its fp16 QPC as much again). They are deleted after the run unless `--keep`.
The fit check (`compiler_core.fit`) reads only the model's header: OPT-13B is written without
its weights' bytes (a sparse file), since the check never reads them.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

DEVICE = "aic100-standard"
PROMPT = 1024
CONTEXT = 2048
PUBLISHED = {"gptj-fp16": 8.08, "gptj-mxfp6": 13.9}
"""Decode tokens/s, GPT-J-6B, Standard card, batch 1, prompt 1024, generation 1024."""


@dataclass
class Row:
    case: str
    decode_tokens_per_s: float | None = None
    ttft_ms: float | None = None
    published: float | None = None
    ratio: float | None = None
    compile_s: float = 0.0
    peak_rss_mib: float = 0.0
    floor_ddr_ms: float | None = None
    decode_ms: float | None = None
    weights_gb: float | None = None
    fit: dict[str, Any] = field(default_factory=dict)
    error: str = ""


def gptj(seq: int | str) -> Any:
    from transformer_models import DecoderSpec

    return DecoderSpec(
        layers=28, hidden=4096, heads=16, ffn=16384, vocab=50400, ctx=CONTEXT, seq=seq
    )


def opt13b(seq: int | str) -> Any:
    from transformer_models import DecoderSpec

    return DecoderSpec(
        layers=40, hidden=5120, heads=40, ffn=20480, vocab=50272, ctx=CONTEXT, seq=seq
    )


def _flags(work: Path, cores: int, mxfp6: bool, out: Path) -> list[str]:
    spec = work / "specializations.json"
    spec.write_text(
        json.dumps(
            {
                "specializations": [
                    {"batch": "1", "seq_len": str(PROMPT)},
                    {"batch": "1", "seq_len": "1"},
                ]
            }
        )
    )
    flags = [
        f"-aic-device={DEVICE}",
        f"-aic-num-cores={cores}",
        f"-network-specialization-config={spec}",
        "-retained-state",  # the model is fp16 already: no -convert-to-fp16
        "-aic-perf-metrics",
        f"-aic-binary-dir={out}",
    ]
    return flags + (["-mxfp6-matmul"] if mxfp6 else [])


CHILD = """
import json, resource, sys
from compiler_core.compile import compile_model
model, out, flags = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
result = compile_model(model, flags)
json.dump(result.metrics, open(out, "w"))
usage = resource.getrusage(resource.RUSAGE_SELF)
open(out + ".rss", "w").write(str(usage.ru_maxrss))
open(out + ".cpu", "w").write(str(usage.ru_utime + usage.ru_stime))
"""


def _compile_in_child(model: Path, flags: list[str], metrics_out: Path) -> tuple[float, float]:
    """Compile in a child process: (wall seconds, peak RSS MiB of that child, as it reports
    its own ru_maxrss: the children's figure is the largest of all children so far)."""
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", CHILD, str(model), str(metrics_out), json.dumps(flags)],
        cwd=ROOT,
        check=True,
    )
    seconds = time.perf_counter() - start
    rss = Path(str(metrics_out) + ".rss")
    return seconds, int(rss.read_text()) / 1024


def run_gptj(work: Path, cores: int, mxfp6: bool, keep: bool) -> Row:
    from transformer_models import write_decoder

    case = "gptj-mxfp6" if mxfp6 else "gptj-fp16"
    row = Row(case=case, published=PUBLISHED[case])
    spec = gptj("seq_len")
    model = write_decoder(spec, work / "models", "float16")
    row.weights_gb = round(spec.parameters * 2 / 1e9, 2)
    out = work / f"qpc-{case}"
    metrics_path = work / f"{case}.json"
    try:
        row.compile_s, row.peak_rss_mib = _compile_in_child(
            model, _flags(work, cores, mxfp6, out), metrics_path
        )
        metrics = json.loads(metrics_path.read_text())
        llm = metrics.get("llm") or {}
        decode = (llm.get("decode") or [{}])[0]
        row.decode_tokens_per_s = decode.get("tokens_per_s")
        row.ttft_ms = llm.get("time_to_first_token_ms")
        decode_metrics = metrics["specializations"]["batch=1,seq_len=1"]
        row.decode_ms = round(decode_metrics["estimated_latency_us"] / 1e3, 2)
        row.floor_ddr_ms = round(decode_metrics["floor_ddr_us"] / 1e3, 2)
        if row.decode_tokens_per_s and row.published:
            row.ratio = round(row.decode_tokens_per_s / row.published, 3)
    except subprocess.CalledProcessError as exc:
        row.error = f"compile failed ({exc.returncode})"
    finally:
        if not keep:
            shutil.rmtree(out, ignore_errors=True)
    return row


def _sparse_model(spec: Any, path: Path) -> Path:
    """The model's header with its external data file as a sparse file of the right length:
    the fit check reads shapes and types only."""
    import numpy as np
    import onnx
    from transformer_models import _Builder, write_decoder

    class _Header(_Builder):
        def weight(self, name: str, shape: tuple[int, ...], scale: float) -> str:
            self.data.seek(-self.data.tell() % 4096, os.SEEK_CUR)
            offset = self.data.tell()
            length = int(np.prod(shape, dtype=np.int64)) * self.dtype.itemsize
            self.data.truncate(offset + length)  # sparse: no bytes written
            self.data.seek(offset + length)
            tensor = onnx.TensorProto(name=name, data_type=self.onnx_type, dims=list(shape))
            tensor.data_location = onnx.TensorProto.EXTERNAL
            for key, value in (
                ("location", self.data_name),
                ("offset", offset),
                ("length", length),
            ):
                entry = tensor.external_data.add()
                entry.key, entry.value = key, str(value)
            self.inits.append(tensor)
            return name

    import transformer_models

    saved = transformer_models._Builder
    transformer_models._Builder = _Header  # type: ignore[misc]
    try:
        written = write_decoder(spec, path, "float16")
    finally:
        transformer_models._Builder = saved  # type: ignore[misc]
    return written


def run_fit(work: Path, cores: int) -> list[Row]:
    from compiler_core.fit import check_fit
    from compiler_core.options import CompileOptions

    rows = []
    model = _sparse_model(opt13b("seq_len"), work / "opt13b")
    for mxfp6 in (False, True):
        case = "opt13b-fit-mxfp6" if mxfp6 else "opt13b-fit-fp16"
        flags = _flags(work, cores, mxfp6, work / "unused")
        start = time.perf_counter()
        report = check_fit(model, CompileOptions.from_flags(flags))
        row = Row(case=case, compile_s=round(time.perf_counter() - start, 3))
        row.fit = report.as_dict()
        row.peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        rows.append(row)
    return rows


CB = {"hidden": 1024, "heads": 16, "layers": 4, "ctx": 1024, "slots": 8, "vocab": 8192}
"""The continuous-batching decoder (tests/cb_decoder_model.py, QEfficient's CtxScatterCB /
CtxGatherCB form) the `cb-fp16` and `cb-mxint8` cases compile: decode of 1, 4 and all 8 slots."""
CB_PREFILL = 128
CB_BATCHES = (1, 4, 8)


def run_cb(work: Path, cores: int, mxint8: bool) -> list[Row]:
    """One QPC: a 128-token prefill into one slot and decodes of 1, 4 and 8 of the 8 slots;
    fp16 compute and cache, or the cache in MXINT8 blocks; a row per decode batch."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import onnx

    from tests.cb_decoder_model import cb_decoder
    from tests.decoder_model import past_names, retained_name

    case = "cb-mxint8" if mxint8 else "cb-fp16"
    model = cb_decoder(
        vocab=CB["vocab"], d_model=CB["hidden"], heads=CB["heads"], layers=CB["layers"],
        ctx_len=CB["ctx"],
    )  # fmt: skip
    path = work / "cb.onnx"
    onnx.save(model, path)
    shape = {"ctx_len": CB["ctx"], "full_batch_size": CB["slots"]}
    specs = [{"batch_size": 1, "seq_len": CB_PREFILL, **shape}]
    specs += [{"batch_size": b, "seq_len": 1, **shape} for b in CB_BATCHES]
    spec_file = work / "cb-specializations.json"
    spec_file.write_text(
        json.dumps({"specializations": [{k: str(v) for k, v in s.items()} for s in specs]})
    )
    names = [n for p in past_names(CB["layers"]) for n in (p, retained_name(p))]
    custom = work / "cb-custom-io.yaml"
    custom.write_text("".join(f"- IOName: {n}\n  Precision: float16\n" for n in names))
    flags = [
        f"-aic-device={DEVICE}",
        f"-aic-num-cores={cores}",
        f"-network-specialization-config={spec_file}",
        "-retained-state",
        "-convert-to-fp16",
        f"-custom-IO-list-file={custom}",
        "-aic-perf-metrics",
        f"-aic-binary-dir={work / ('qpc-' + case)}",
    ] + (["-mxint8-kv-cache"] if mxint8 else [])
    metrics_path = work / f"{case}.json"
    rows: list[Row] = []
    try:
        seconds, rss = _compile_in_child(path, flags, metrics_path)
    except subprocess.CalledProcessError as exc:
        return [Row(case=case, error=f"compile failed ({exc.returncode})")]
    finally:
        shutil.rmtree(work / f"qpc-{case}", ignore_errors=True)
    metrics = json.loads(metrics_path.read_text())
    llm = metrics["llm"]
    for decode in llm["decode"]:
        each = metrics["specializations"][decode["specialization"]]
        rows.append(
            Row(
                case=f"{case} batch {decode['batch']}/{decode.get('slots')}",
                decode_tokens_per_s=decode["tokens_per_s"],
                ttft_ms=llm.get("time_to_first_token_ms"),
                decode_ms=decode["time_per_output_token_ms"],
                floor_ddr_ms=round(each["floor_ddr_us"] / 1e3, 3),
                compile_s=seconds,
                peak_rss_mib=rss,
            )
        )
    return rows


ULTRA = "aic100-ultra"
MDP_SOCS = (4, 2, 1)
"""Run with the partitioned compiles first (the 4-SoC one is issue 20 item 7's target)."""


def llama7b(seq: int | str, layers: int = 32) -> Any:
    """A 7 B decoder's shape (32 layers, hidden 4096, 32 heads, FFN 16384, vocabulary 32000,
    context 2048: 7.0 B parameters, 13.4 GB in fp16)."""
    from transformer_models import DecoderSpec

    return DecoderSpec(
        layers=layers, hidden=4096, heads=32, ffn=16384, vocab=32000, ctx=CONTEXT, seq=seq
    )


def run_mdp(
    work: Path,
    layers: int,
    keep: bool,
    socs_list: tuple[int, ...] = MDP_SOCS,
    stages: int = 1,
) -> list[Row]:
    """The 7 B decode step (batch 1, context 2048) on 1, 2 and 4 SoCs of an Ultra card, 16
    cores each: 1 SoC is a plain compile; 2 and 4 are one partition over SoCs 0..n-1
    connected p2p (tensor slicing); with `stages`, that many partitions of socs/stages SoCs
    each (pipeline stages, each sliced over its SoCs). Decode only (one specialization): the
    compile time and peak memory of issue 20's item 7 are of this program."""
    from transformer_models import write_decoder

    spec = llama7b("seq_len", layers)
    model = write_decoder(spec, work / "models", "float16")
    rows = []
    for socs in socs_list:
        case = f"7b-l{layers}-{socs}soc" + (f"-{stages}stages" if stages > 1 else "")
        out = work / f"qpc-{case}"
        flags = [
            f"-aic-device={ULTRA}",
            "-aic-num-cores=16",
            "-onnx-define-symbol=batch,1",
            "-onnx-define-symbol=seq_len,1",
            "-retained-state",
            "-aic-perf-metrics",
            f"-aic-binary-dir={out}",
        ]
        if socs > 1:
            partition = work / f"partition-{socs}x{stages}.json"
            per = socs // stages
            parts = [
                {
                    "name": f"Partition{s}",
                    "devices": [
                        {"deviceId": d, "numCores": 16} for d in range(s * per, (s + 1) * per)
                    ],
                }
                for s in range(stages)
            ]
            connections = [{"devices": list(range(socs)), "type": "p2p"}]
            partition.write_text(json.dumps({"connections": connections, "partitions": parts}))
            flags.append(f"-mdp-load-partition-config={partition}")
        row = Row(case=case, weights_gb=round(spec.parameters * 2 / 1e9, 2))
        metrics_path = work / f"{case}.json"
        try:
            row.compile_s, row.peak_rss_mib = _compile_in_child(model, flags, metrics_path)
            metrics = json.loads(metrics_path.read_text())
            row.decode_ms = round(metrics["estimated_latency_us"] / 1e3, 3)
            row.decode_tokens_per_s = round(1e3 / row.decode_ms, 2)
            row.floor_ddr_ms = round(metrics["floor_ddr_us"] / 1e3, 3)
            row.fit = {"mdp": metrics.get("mdp")} if metrics.get("mdp") else {}
        except subprocess.CalledProcessError as exc:
            row.error = f"compile failed ({exc.returncode})"
        finally:
            if not keep:
                shutil.rmtree(out, ignore_errors=True)
        rows.append(row)
        print(json.dumps(asdict(row)), flush=True)
    return rows


@dataclass
class CompileRow:
    """One compile of the 7 B decoder (`7b-compile`): what it took, by this tree or another."""

    case: str
    tree: str
    """"this" or the other checkout's path (`--before`)."""
    wall_s: float = 0.0
    cpu_s: float = 0.0
    peak_rss_mib: float = 0.0
    qpc_gb: float = 0.0
    error: str = ""


def run_compile_7b(
    work: Path, layers: int, keep: bool, socs: tuple[int, ...], before: Path | None
) -> list[CompileRow]:
    """Issue 20 item 7: the 7 B decoder compiled as users compile it (prefill of 1024 tokens
    and decode specializations in one QPC, `-retained-state`, perf metrics computed), on one
    SoC of an Ultra card (16 cores) and partitioned over `socs` SoCs; wall time, CPU time and
    peak RSS of the compiling process. With `--before DIR` each compile is repeated by that
    checkout of the compiler (e.g. a `git worktree` of main before a change), side by side."""
    from transformer_models import write_decoder

    spec = llama7b("seq_len", layers)
    model = write_decoder(spec, work / "models", "float16")
    specs = work / "specializations-7b.json"
    specs.write_text(
        json.dumps(
            {
                "specializations": [
                    {"batch": "1", "seq_len": str(PROMPT)},
                    {"batch": "1", "seq_len": "1"},
                ]
            }
        )
    )
    trees: list[tuple[str, Path | None]] = [("this", None)]
    if before is not None:
        trees.append((str(before), before))
    rows: list[CompileRow] = []
    for n in socs:
        case = f"7b-l{layers}-prefill+decode-{n}soc"
        flags = [
            f"-aic-device={ULTRA}",
            "-aic-num-cores=16",
            f"-network-specialization-config={specs}",
            "-retained-state",
            "-aic-perf-metrics",
        ]
        if n > 1:
            flags.append(f"-mdp-load-partition-config={_partition_file(work, n)}")
        for tree, checkout in trees:
            row = CompileRow(case=case, tree=tree)
            out = work / f"qpc-{case}-{len(rows)}"
            metrics = work / f"{case}-{len(rows)}.json"
            env = None if checkout is None else {**os.environ, "PYTHONPATH": str(checkout)}
            try:
                start = time.perf_counter()
                subprocess.run(
                    [
                        sys.executable,
                        "-c",
                        CHILD,
                        str(model),
                        str(metrics),
                        json.dumps([*flags, f"-aic-binary-dir={out}"]),
                    ],
                    cwd=ROOT if checkout is None else checkout,
                    env=env,
                    check=True,
                    capture_output=True,
                    text=True,
                )
                row.wall_s = round(time.perf_counter() - start, 1)
                row.cpu_s = round(float(Path(str(metrics) + ".cpu").read_text()), 1)
                row.peak_rss_mib = round(int(Path(str(metrics) + ".rss").read_text()) / 1024)
                row.qpc_gb = round(sum(f.stat().st_size for f in out.iterdir()) / 1e9, 2)
            except subprocess.CalledProcessError as exc:
                lines = (exc.stderr or "").strip().splitlines()
                row.error = lines[-1] if lines else f"compile failed ({exc.returncode})"
            finally:
                if not keep:
                    shutil.rmtree(out, ignore_errors=True)
            rows.append(row)
            print(json.dumps(asdict(row)), flush=True)
    return rows


def _partition_file(work: Path, socs: int) -> Path:
    """One partition over SoCs 0..socs-1 of the card, connected p2p (tensor slicing)."""
    path = work / f"partition-{socs}.json"
    path.write_text(
        json.dumps(
            {
                "connections": [{"devices": list(range(socs)), "type": "p2p"}],
                "partitions": [
                    {
                        "name": "Partition0",
                        "devices": [{"deviceId": d, "numCores": 16} for d in range(socs)],
                    }
                ],
            }
        )
    )
    return path


def _print_compiles(rows: list[CompileRow]) -> None:
    print("| case | compiled by | wall s | CPU s | peak RSS MiB | QPC GB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r.case} | {r.tree} | {r.wall_s} | {r.cpu_s} | {r.peak_rss_mib} | {r.qpc_gb} |"
            + (f" {r.error}" if r.error else "")
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--cases", default="opt13b-fit,gptj-fp16,gptj-mxfp6")
    parser.add_argument("--cores", type=int, default=14)
    parser.add_argument("--keep", action="store_true", help="keep the models and QPCs")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--mdp-socs", default=",".join(map(str, MDP_SOCS)), help="SoC counts of mdp-7b"
    )
    parser.add_argument(
        "--mdp-stages", type=int, default=1, help="pipeline stages of mdp-7b (partitions)"
    )
    parser.add_argument(
        "--mdp-layers", type=int, default=32, help="layers of the 7 B shape (fewer: a quick run)"
    )
    parser.add_argument(
        "--compile-socs", default="1,4", help="SoC counts of 7b-compile (prefill + decode)"
    )
    parser.add_argument(
        "--before", type=Path, default=None, help="7b-compile: also compile with this checkout"
    )
    args = parser.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="qpcfarm-llm-"))
    work.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    compiles: list[CompileRow] = []
    cases = args.cases.split(",")
    try:
        if "opt13b-fit" in cases:
            rows += run_fit(work, args.cores)
        for case in ("cb-fp16", "cb-mxint8"):
            if case in cases:
                rows += run_cb(work, args.cores, case.endswith("mxint8"))
                print(json.dumps([asdict(r) for r in rows[-len(CB_BATCHES) :]]), flush=True)
        if "mdp-7b" in cases:
            socs = tuple(int(n) for n in args.mdp_socs.split(","))
            rows += run_mdp(work, args.mdp_layers, args.keep, socs, args.mdp_stages)
        if "7b-compile" in cases:
            socs = tuple(int(n) for n in args.compile_socs.split(","))
            compiles = run_compile_7b(work, args.mdp_layers, args.keep, socs, args.before)
        for case in ("gptj-fp16", "gptj-mxfp6"):
            if case in cases:
                rows.append(run_gptj(work, args.cores, case.endswith("mxfp6"), args.keep))
                print(json.dumps(asdict(rows[-1])), flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(work / "models", ignore_errors=True)
            shutil.rmtree(work / "opt13b", ignore_errors=True)
    if rows:
        _print(rows)
    if compiles:
        _print_compiles(compiles)
    if args.json:
        records = [asdict(r) for r in rows] + [asdict(r) for r in compiles]
        args.json.write_text(json.dumps(records, indent=2))
    return 0


def _print(rows: list[Row]) -> None:
    print(
        "| case | decode tokens/s | published | ratio | TTFT ms | decode ms | DDR floor ms "
        "| compile s | peak RSS MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r.fit and "mdp" not in r.fit:
            verdict = "fits" if r.fit.get("fits") else "refused"
            print(
                f"| {r.case} | {verdict}: needs {r.fit.get('needed_bytes', 0) / 1e9:.2f} GB of "
                f"{r.fit.get('available_bytes', 0) / 1e9:.2f} GB | | | | | | {r.compile_s} "
                f"| {r.peak_rss_mib:.0f} |"
            )
            continue
        print(
            f"| {r.case} | {r.decode_tokens_per_s} | {r.published} | {r.ratio} | {r.ttft_ms} "
            f"| {r.decode_ms} | {r.floor_ddr_ms} | {r.compile_s:.1f} | {r.peak_rss_mib:.0f} |"
            + (f" {r.error}" if r.error else "")
        )
    by = {r.case: r for r in rows}
    fp16, mx = by.get("gptj-fp16"), by.get("gptj-mxfp6")
    if fp16 and mx and fp16.decode_tokens_per_s and mx.decode_tokens_per_s:
        print(
            f"MXFP6 speed-up: {mx.decode_tokens_per_s / fp16.decode_tokens_per_s:.2f}x "
            "(published 1.72x)"
        )


if __name__ == "__main__":
    raise SystemExit(main())
