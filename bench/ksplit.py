"""Reduction-axis (K) splits: the modelled gain where the chooser takes one, and where not.

    python bench/ksplit.py [--cores 4,14] [--precision fp16]

For a few matrix products built in code (AIC100 Standard; fp16 unless told), compiles each
twice in the same run, with K splits allowed (the default) and without
(`CodegenPolicy(k_splits=False)`), and prints the estimated device latency of both programs,
their ratio, and the cut the compiler chose (`K xP`: a partial product on P slices of K plus
a reduction). Figures are the compiler's estimates of the programs it emitted
(`-aic-perf-metrics`), not measurements.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DEVICE = "aic100-standard"

CASES = {
    # name: (rows, K, columns, Gemm with bias + Relu (else MatMul + bias Add))
    "classifier head 1x8192x16 (Gemm+Relu)": (1, 8192, 16, True),
    "head 1x4096x100 (Gemm+Relu)": (1, 4096, 100, True),
    "decode projection 1x8192x64": (1, 8192, 64, False),
    "tall-skinny 4x16384x32": (4, 16384, 32, False),
    "decode projection 1x2048x2048 (output cut wins)": (1, 2048, 2048, False),
    "projection 64x2048x1024 (output cut wins)": (64, 2048, 1024, False),
}


def build(rows: int, depth: int, columns: int, gemm: bool) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((depth, columns)) / np.sqrt(depth)).astype(np.float32)
    b = rng.standard_normal(columns).astype(np.float32)
    if gemm:
        nodes = [
            helper.make_node("Gemm", ["x", "w", "b"], ["g"]),
            helper.make_node("Relu", ["g"], ["y"]),
        ]
        x_shape, y_shape = [rows, depth], [rows, columns]
    else:
        nodes = [
            helper.make_node("MatMul", ["x", "w"], ["m"]),
            helper.make_node("Add", ["m", "b"], ["y"]),
        ]
        x_shape, y_shape = [1, rows, depth], [1, rows, columns]
    graph = helper.make_graph(
        nodes,
        "product",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, y_shape)],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def estimate(
    model: onnx.ModelProto, cores: int, k_splits: bool, precision: str
) -> tuple[float, str]:
    """Estimated device latency (us) and the matrix product's cut."""
    from compiler_core import compile_model, load_qpc
    from compiler_core.lowering.placement import CodegenPolicy

    flags = [f"-aic-num-cores={cores}", f"-aic-device={DEVICE}"]
    if precision == "fp16":
        flags.append("-convert-to-fp16")
    result = compile_model(model, flags, policy=CodegenPolicy(k_splits=k_splits))
    try:
        with load_qpc(result.qpc_path) as qpc:
            program = qpc.program()
        cut = "output"
        for kernel in program.kernels:
            if kernel.info.op_type == "PartialMatMul":
                cut = f"K x{kernel.info.attrs['slices']}"
        return float(result.metrics["estimated_device_latency_us"]), cut
    finally:
        result.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cores", default="4,14")
    parser.add_argument("--precision", default="fp16", choices=["fp16", "fp32"])
    args = parser.parse_args(argv)
    print("| product | cores | chosen cut | device us, K allowed | device us, no K | gain |")
    print("|---|---|---|---|---|---|")
    for name, (rows, depth, columns, gemm) in CASES.items():
        model = build(rows, depth, columns, gemm)
        for cores in (int(c) for c in args.cores.split(",")):
            with_k, cut = estimate(model, cores, True, args.precision)
            without, _ = estimate(model, cores, False, args.precision)
            print(
                f"| {name} | {cores} | {cut} | {with_k:,.2f} | {without:,.2f} "
                f"| {without / with_k:.2f}x |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
