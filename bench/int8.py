"""int8 accuracy and estimated throughput, beside fp16 and MXFP6, with ONNX Runtime's static
quantization of the same models as the accuracy peer.

    python bench/int8.py                  # ResNet-50, a MobileNet-style CNN, a BERT-style encoder
    python bench/int8.py --quick          # small versions of the three (smoke test)
    python bench/int8.py --json bench/out/int8.json
    python bench/int8.py --deployed --cores 16   # ORT's QDQ ResNet-50 as deployed

Per model: a synthetic calibration set (seeded normal inputs; the last quarter held back) and,
against ONNX Runtime's fp32 outputs on the held-back samples, the error of
- qpcfarm fp16 (`-convert-to-fp16`) and MXFP6 (`-mxfp6-matmul -convert-to-fp16`),
- qpcfarm int8 from a profile of the calibration samples (`-dump-profile`), in the default
  schema (symmetric_with_uint8) and in `symmetric` (ONNX Runtime's schema below),
- ONNX Runtime int8: `quantize_static` (QDQ, per-channel weights, symmetric int8 activations
  and weights: the schema both offer) on the same calibration samples, run by ONNX Runtime's
  own int8 kernels;
and the estimated inferences per second of the int8 and fp16 programs on the same cores
(the cost model: `estimated_inferences_per_second`).

Figures: `rel` = max |error| / max |fp32 output|; `cos` = cosine similarity of all held-back
outputs; `top1` = share of samples whose arg-max agrees with fp32 (classifiers). Accuracy
target: qpcfarm int8 within 2x of ONNX Runtime int8's relative error (the weights are random,
so the figures compare quantizers, not task accuracy). Throughput: int8 / fp16 ratio, >= 1.5x
expected where the HMX dominates.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.models import RESNET50, RESNET_QUICK, ResNetSpec, resnet  # noqa: E402
from bench.report import emit, progress  # noqa: E402
from bench.transformer_models import EncoderSpec, write_encoder  # noqa: E402

Feeds = dict[str, np.ndarray]


# --- models ----------------------------------------------------------------------------------


def mobilenet(
    width: int = 32, blocks: int = 6, image: int = 112, classes: int = 100
) -> onnx.ModelProto:
    """MobileNet-style: a strided stem, depthwise-separable blocks (DW 3x3 + BN + Relu6,
    PW 1x1 + BN + Relu6), every other block strided, GAP and a classifier."""
    rng = np.random.default_rng(7)
    nodes: list[onnx.NodeProto] = []
    inits: list[TensorProto] = []
    count = [0]

    def fresh(stem: str) -> str:
        count[0] += 1
        return f"{stem}{count[0]}"

    def const(name: str, value: np.ndarray) -> str:
        inits.append(onnx.numpy_helper.from_array(value.astype(np.float32), name))
        return name

    def conv_bn(x: str, cin: int, cout: int, k: int, stride: int, group: int) -> str:
        name = fresh("conv")
        fan_in = cin // group * k * k
        w = rng.standard_normal((cout, cin // group, k, k)) * math.sqrt(2.0 / fan_in)
        y = fresh("c")
        nodes.append(
            helper.make_node(
                "Conv",
                [x, const(f"{name}.w", w)],
                [y],
                name=name,
                kernel_shape=[k, k],
                strides=[stride, stride],
                pads=[k // 2] * 4,
                group=group,
            )
        )
        bn = fresh("bn")
        params = [
            const(f"{bn}.s", rng.uniform(0.5, 1.0, cout)),
            const(f"{bn}.b", rng.uniform(-0.1, 0.1, cout)),
            const(f"{bn}.m", rng.uniform(-0.1, 0.1, cout)),
            const(f"{bn}.v", rng.uniform(0.5, 1.5, cout)),
        ]
        z = fresh("b")
        nodes.append(helper.make_node("BatchNormalization", [y, *params], [z], name=bn))
        out = fresh("r")
        lo, hi = const(fresh("lo"), np.array(0.0)), const(fresh("hi"), np.array(6.0))
        nodes.append(helper.make_node("Clip", [z, lo, hi], [out], name=fresh("relu6")))
        return out

    x = conv_bn("input", 3, width, 3, 2, 1)
    c = width
    for i in range(blocks):
        stride = 2 if i % 2 == 1 else 1
        cout = c * 2 if stride == 2 else c
        x = conv_bn(x, c, c, 3, stride, c)
        x = conv_bn(x, c, cout, 1, 1, 1)
        c = cout
    gap = fresh("gap")
    nodes.append(helper.make_node("GlobalAveragePool", [x], [gap], name=gap))
    flat = fresh("flat")
    nodes.append(helper.make_node("Flatten", [gap], [flat], name=flat))
    fc_w = const("fc.w", rng.standard_normal((classes, c)) / math.sqrt(c))
    fc_b = const("fc.b", np.zeros(classes))
    nodes.append(helper.make_node("Gemm", [flat, fc_w, fc_b], ["logits"], name="fc", transB=1))
    graph = helper.make_graph(
        nodes,
        "mobilenet",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 3, image, image])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, classes])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def models(quick: bool, work: Path) -> Iterator[tuple[str, Path, list[str]]]:
    """(name, model path, extra compile flags) for each benchmark model."""
    spec: ResNetSpec = RESNET_QUICK if quick else RESNET50
    path = work / f"{spec.name}.onnx"
    if not path.exists():
        onnx.save(resnet(spec), path)
    yield ("ResNet-50" if not quick else "ResNet (quick)"), path, []
    mobile = work / ("mobilenet-quick.onnx" if quick else "mobilenet.onnx")
    if not mobile.exists():
        onnx.save(mobilenet(16, 4, 64) if quick else mobilenet(), mobile)
    yield "MobileNet-style", mobile, []
    enc = (
        EncoderSpec(layers=1, hidden=128, heads=2, ffn=256, seq=32)
        if quick
        else EncoderSpec(layers=2, hidden=256, heads=4, ffn=1024, seq=64)
    )
    yield "BERT-style encoder", write_encoder(enc, work), ["-onnx-define-symbol=batch,1"]


# --- measuring -------------------------------------------------------------------------------


def inputs_of(path: Path) -> dict[str, list[int]]:
    model = onnx.load(path, load_external_data=False)
    return {
        i.name: [d.dim_value or 1 for d in i.type.tensor_type.shape.dim] for i in model.graph.input
    }


def samples_for(path: Path, count: int, seed: int = 1) -> list[Feeds]:
    rng = np.random.default_rng(seed)
    shapes = inputs_of(path)
    return [
        {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
        for _ in range(count)
    ]


def ort_run(model: str | Path, samples: list[Feeds]) -> list[np.ndarray]:
    import onnxruntime as ort

    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    return [np.asarray(session.run(None, feeds)[0], dtype=np.float64) for feeds in samples]


def our_run(qpc: Path, samples: list[Feeds]) -> list[np.ndarray]:
    from compiler_core import QpcSession

    with QpcSession(qpc) as session:
        return [
            np.asarray(next(iter(session.run(feeds).values())), dtype=np.float64)
            for feeds in samples
        ]


def errors(ref: list[np.ndarray], got: list[np.ndarray]) -> dict[str, float]:
    from compiler_core.quant.accuracy import compare

    figures = compare(ref, got)
    return {
        "rel": figures["relative_error"],
        "cos": figures["cosine_similarity"],
        **({"top1": figures["top1_agreement"]} if "top1_agreement" in figures else {}),
    }


def ort_int8(path: Path, calibration: list[Feeds], work: Path) -> Path:
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.it = iter(calibration)

        def get_next(self) -> Feeds | None:
            return next(self.it, None)

    out = work / f"{path.stem}.ort-int8.onnx"
    quantize_static(
        str(path),
        str(out),
        Reader(),
        quant_format=QuantFormat.QDQ,
        per_channel=True,
        activation_type=QuantType.QInt8,
        weight_type=QuantType.QInt8,
        extra_options={"ActivationSymmetric": True, "WeightSymmetric": True},
    )
    return out


def ort_int8_cached(path: Path, work: Path) -> Path:
    """`ort_int8` of the model calibrated on 4 samples, made once per `work` folder."""
    qdq = work / f"{path.stem}.ort-int8.onnx"
    if not qdq.exists():
        ort_int8(path, samples_for(path, 4), work)
    return qdq


def int8_io_listing(path: Path, names: list[str], work: Path) -> Path:
    """A custom-IO list (`-custom-IO-list-file`) that makes `names` int8 codes on the host."""
    listing = work / f"{path.stem}.int8-io.yaml"
    listing.write_text("".join(f"- IOName: {n}\n  Precision: int8\n" for n in names))
    return listing


def bench_model(
    name: str, path: Path, flags: list[str], cores: int, count: int, work: Path
) -> dict[str, Any]:
    from compiler_core import compile_model
    from compiler_core.quant.accuracy import split

    samples = samples_for(path, count)
    calibration, held = split(samples)
    npz = work / f"{path.stem}.calib.npz"
    np.savez(npz, allow_pickle=False, **{n: np.stack([s[n] for s in samples]) for n in samples[0]})
    reference = ort_run(path, held)
    base = [f"-aic-num-cores={cores}", *flags]
    rows: dict[str, Any] = {}
    ips: dict[str, float] = {}
    device_us: dict[str, float] = {}

    def ours(label: str, extra: list[str]) -> None:
        start = time.perf_counter()
        result = compile_model(path, [*base, *extra])
        seconds = time.perf_counter() - start
        rows[label] = errors(reference, our_run(result.qpc_path, held))
        rows[label]["compile_s"] = round(seconds, 1)
        ips[label] = result.metrics["estimated_inferences_per_second"]
        device_us[label] = result.metrics["estimated_device_latency_us"]
        if result.accuracy is not None:
            rows[label]["report_held_back_cos"] = min(
                o["cosine_similarity"] for o in result.accuracy["held_back"]["outputs"].values()
            )
        result.cleanup()
        progress(f"  {name}: {label}: {rows[label]}")

    ours("qpcfarm fp16", ["-convert-to-fp16"])
    ours("qpcfarm MXFP6", ["-convert-to-fp16", "-mxfp6-matmul"])
    calib = [f"-input-list-file={npz}", "-enable-channelwise", "-enable-rowwise"]
    ours("qpcfarm int8", [f"-dump-profile={work / f'{path.stem}.profile.json'}", *calib])
    ours(
        "qpcfarm int8 symmetric",
        [
            f"-load-profile={work / f'{path.stem}.profile.json'}",
            "-quantization-schema-activations=symmetric",
            "-enable-channelwise",
            "-enable-rowwise",
        ],
    )
    try:
        peer = ort_int8(path, calibration, work)
        rows["ONNX Runtime int8"] = errors(reference, ort_run(peer, held))
    except Exception as exc:  # the peer failing is reported, not fatal
        rows["ONNX Runtime int8"] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
    progress(f"  {name}: ONNX Runtime int8: {rows['ONNX Runtime int8']}")
    ratio = ips["qpcfarm int8"] / ips["qpcfarm fp16"] if ips.get("qpcfarm fp16") else None
    speedup = device_us["qpcfarm fp16"] / device_us["qpcfarm int8"] if device_us else None
    return {
        "model": name,
        "samples": {"calibration": len(calibration), "held_back": len(held)},
        "accuracy": rows,
        "inferences_per_second": ips,
        "device_latency_us": device_us,
        "int8_over_fp16": round(ratio, 2) if ratio else None,
        "device_speedup_int8_over_fp16": round(speedup, 2) if speedup else None,
    }


# --- the deployed QDQ program -----------------------------------------------------------------


def deployed(path: Path, cores: int, work: Path) -> list[dict[str, Any]]:
    """ONNX Runtime's quantize_static QDQ form of the model (symmetric int8, per-channel, no
    pre-processing: BatchNormalization stays between its pairs) compiled as a user would, then
    with its input and output as int8 codes (-custom-IO-list-file): device time, its ratio to
    the compute floor, HMX busy, kernels and float kernels, host transfer."""
    from compiler_core import compile_model

    qdq = ort_int8_cached(path, work)
    model = onnx.load(qdq, load_external_data=False)
    listing = int8_io_listing(path, [model.graph.input[0].name, model.graph.output[0].name], work)
    rows = []
    for label, extra in (("float I/O", []), ("int8 I/O", [f"-custom-IO-list-file={listing}"])):
        result = compile_model(qdq, [f"-aic-num-cores={cores}", *extra])
        m = result.metrics
        rows.append(
            {
                "io": label,
                "device_us": m["estimated_device_latency_us"],
                "floor_compute_us": m["floor_compute_us"],
                "over_floor": round(m["estimated_device_latency_us"] / m["floor_compute_us"], 2),
                "hmx_busy_%": m["unit_busy_percent"]["hmx"],
                "kernels": m["kernels"],
                "fp32_kernels": m["precision"].get("fp32", {}).get("kernels", 0),
                "host_transfer_us": m["host_transfer_us"],
                "inferences_per_second": m["estimated_inferences_per_second"],
            }
        )
        result.cleanup()
        progress(f"  deployed {label}: {rows[-1]}")
    return rows


# --- report ----------------------------------------------------------------------------------


def table(results: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| model | mode | rel | cos | top1 | est. inf/s | est. device latency (us) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for mode, figures in r["accuracy"].items():
            if "error" in figures:
                lines.append(f"| {r['model']} | {mode} | {figures['error']} | | | | |")
                continue
            ips = r["inferences_per_second"].get(mode)
            dev = r["device_latency_us"].get(mode)
            lines.append(
                f"| {r['model']} | {mode} | {figures['rel']:.4f} | {figures['cos']:.5f} | "
                f"{figures.get('top1', '')} | {'' if ips is None else f'{ips:,.0f}'} | "
                f"{'' if dev is None else f'{dev:,.1f}'} |"
            )
    lines += [
        "",
        "| model | int8 / fp16 est. throughput | fp16 / int8 device latency | "
        "int8 rel / ORT int8 rel |",
        "|---|---|---|---|",
    ]
    for r in results:
        ours, peer = (
            r["accuracy"].get("qpcfarm int8 symmetric", {}),
            r["accuracy"].get("ONNX Runtime int8", {}),
        )
        vs = (
            f"{ours['rel'] / peer['rel']:.2f}"
            if "rel" in ours and "rel" in peer and peer["rel"]
            else "n/a"
        )
        lines.append(
            f"| {r['model']} | {r['int8_over_fp16']}x | "
            f"{r['device_speedup_int8_over_fp16']}x | {vs} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small models (smoke test)")
    parser.add_argument("--cores", type=int, default=14, help="NSP cores to compile for")
    parser.add_argument("--samples", type=int, default=8, help="calibration + held-back inputs")
    parser.add_argument("--work", type=Path, default=ROOT / "bench" / "out", help="model folder")
    parser.add_argument("--only", help="run only the models whose name contains this")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--deployed",
        action="store_true",
        help="only ResNet-50's quantize_static QDQ program as deployed (float and int8 I/O)",
    )
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    if args.deployed:
        spec: ResNetSpec = RESNET_QUICK if args.quick else RESNET50
        path = args.work / f"{spec.name}.onnx"
        if not path.exists():
            onnx.save(resnet(spec), path)
        rows = deployed(path, args.cores, args.work)
        keys = list(rows[0])
        lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        lines += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows]
        emit(lines, rows, args.json)
        return 0
    results = []
    with tempfile.TemporaryDirectory(prefix="qpcfarm-int8-") as tmp:
        for name, path, flags in models(args.quick, args.work):
            if args.only and args.only.lower() not in name.lower():
                continue
            progress(f"{name}: {path.name}")
            results.append(bench_model(name, path, flags, args.cores, args.samples, Path(tmp)))
    emit(table(results), results, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
