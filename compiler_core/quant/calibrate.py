"""`-dump-profile`: compile the float model, run it on the calibration inputs, write the
profile (compiler_core/quant/profile.py).

The compile driver passes its own `compile_model` in (`Compile`): calibration compiles the
float model with it, and this module stays below the driver that calls it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from compiler_core.model_folder import LOCAL, ModelFolder
from compiler_core.options import QUANT_TUNING, CompileOptions
from compiler_core.passes.pipeline import without_epilogue_fusion
from compiler_core.quant.accuracy import poor, report, split
from compiler_core.quant.collect import collect
from compiler_core.quant.inputs import Feeds, InputSpec, load_inputs
from compiler_core.quant.profile import write_profile

Compile = Callable[..., Any]
"""`compiler_core.compile.compile_model`: (source, options, *, model_folder) -> CompileResult."""

FLOAT_ONLY = (
    *QUANT_TUNING,
    "dump_profile",
    "load_profile",
    "input_list_file",
    "no_quant",
    "num_histogram_bins",
    "execute_nodes_in_fp16",
    "convert_to_fp16",
    "mxfp6_matmul",
    "custom_io_list_file",
    "node_precision_info",
    "network_specialization_config",
    "mdp_load_partition_config",
    "mdp_dump_partition_config",
    "aic_binary_dir",
    "aic_perf_metrics",
    "aic_perf_warnings",
    "time_passes",
)
"""What the float reference compile leaves out: quantization itself, lower float precision,
and boundary changes (its inputs are the model's own)."""


def float_options(opts: CompileOptions) -> CompileOptions:
    """The options of the float model that calibration and the accuracy report run."""
    return opts.with_(**dict.fromkeys(FLOAT_ONLY))


def compile_float(
    compile_model: Compile,
    source: Any,
    opts: CompileOptions,
    folder: ModelFolder,
    *,
    observable: bool,
) -> Any:
    """The float model compiled with our kernels (`observable`: every node its own kernel)."""
    if observable:
        with without_epilogue_fusion():
            return compile_model(source, float_options(opts), model_folder=folder)
    return compile_model(source, float_options(opts), model_folder=folder)


def input_specs(program: Any) -> list[InputSpec]:
    return [
        InputSpec(
            program.tensors[t].name, program.tensors[t].dtype, tuple(program.tensors[t].shape)
        )
        for t in program.inputs
    ]


def calibration_samples(
    opts: CompileOptions, program: Any, folder: ModelFolder = LOCAL
) -> list[Feeds]:
    assert opts.input_list_file is not None
    return load_inputs(opts.input_list_file, input_specs(program), folder)


@dataclass
class Reference:
    """The float model compiled with our kernels, and the samples to compare on."""

    result: Any
    calibration: list[Feeds]
    held_back: list[Feeds]


def dump_profile(
    compile_model: Compile, source: Any, opts: CompileOptions, folder: ModelFolder = LOCAL
) -> Reference:
    """Profile the float model on the calibration part of `-input-list-file` (the last
    quarter is held back for the accuracy report) and write `-dump-profile`."""
    assert opts.dump_profile is not None
    result = compile_float(compile_model, source, opts, folder, observable=True)
    try:
        samples = calibration_samples(opts, result.program, folder)
        calibration, held_back = split(samples)
        profile = collect(result.qpc_path, calibration, opts.num_histogram_bins)
        write_profile(profile, opts.dump_profile)
    except BaseException:
        result.cleanup()
        raise
    return Reference(result, calibration, held_back)


def add_accuracy(
    compile_model: Compile,
    source: Any,
    opts: CompileOptions,
    result: Any,
    ref: Reference | None,
    folder: ModelFolder = LOCAL,
) -> None:
    """The accuracy report of a quantized compile (`result.accuracy`), and a warning when
    an output falls short, naming the nodes that lose most."""
    if ref is None:
        floats = compile_float(compile_model, source, opts, folder, observable=False)
        ref = Reference(floats, [], calibration_samples(opts, floats.program, folder))
    try:
        accuracy = report(
            ref.result.qpc_path,
            result.qpc_path,
            {"calibration": ref.calibration, "held_back": ref.held_back},
        )
    finally:
        ref.result.cleanup()
    result.accuracy = accuracy
    short = poor(accuracy)
    if short:
        lossy = next((w for w in result.warnings if w.get("code") == "quantization_loss"), None)
        nodes = list(lossy["nodes"]) if lossy else []
        result.warnings.append(
            {
                "code": "quantization_accuracy",
                "kind": "precision",
                "message": "int8 accuracy against the float model is low at "
                + "; ".join(short)
                + (f"; the nodes losing most: {', '.join(nodes)}" if nodes else ""),
                "nodes": nodes,
                "suggestion": "keep those nodes in fp16 (-node-precision-info, "
                "FP16NodeInstanceNames) or their op types (-execute-nodes-in-fp16), try "
                "-quantization-calibration=Percentile or -enable-channelwise",
            }
        )
