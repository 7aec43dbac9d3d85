"""The whole compile, one line per stage: import -> passes -> lower -> plan memory -> emit.

`compile_model` checks the model fits, calibrates when asked (quant/calibrate.py), then runs
the steps of `build.py` for one device, or `mdp/build.py`'s once per device of a partition.
"""

from __future__ import annotations

import functools
import gc
import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from compiler_core.build import (
    CompileResult,
    Progress,
    Stages,
    Timelines,
    build_metrics,
    build_warnings,
    lower_spec,
    output_dir,
    plan_and_emit,
    retained_state,
    shared_constants,
    spec_name,
    specializations,
    write_network_qpc,
)
from compiler_core.errors import CompileError
from compiler_core.fit import check_fit, require_fit, worth_checking
from compiler_core.importer import ModelSource
from compiler_core.lowering.placement import CodegenPolicy
from compiler_core.model_folder import LOCAL, ModelFolder
from compiler_core.options import CompileOptions

__all__ = ["CompileResult", "compile_model"]


def _as_options(
    options: CompileOptions | Mapping[str, Any] | Sequence[str] | None,
) -> CompileOptions:
    if options is None:
        return CompileOptions()
    if isinstance(options, CompileOptions):
        return options
    if isinstance(options, Mapping):
        return CompileOptions.from_json(options)
    return CompileOptions.from_flags(list(options))


def compile_model(
    model: ModelSource | None = None,
    options: CompileOptions | Mapping[str, Any] | Sequence[str] | None = None,
    progress: Progress | None = None,
    *,
    policy: CodegenPolicy | None = None,
    model_folder: ModelFolder = LOCAL,
) -> CompileResult:
    """Compile an ONNX model (path, bytes or ModelProto) into a QPC; a path may also name a
    TensorFlow or PyTorch model, converted to ONNX first (compiler_core/convert).

    Writes `<-aic-binary-dir>/programqpc.bin`, or a temporary directory's when no directory is
    named (kept until `result.cleanup()` or garbage collection). `policy` switches code
    generation optimisations off (for comparisons; every one is on by default).
    `model_folder` is where the files the options name (and the model's external data) may
    be: the farm confines them to the job's model folder (compiler_core/model_folder.py).
    """
    opts = _as_options(options)
    source = model if model is not None else opts.model
    if source is None:
        raise CompileError("missing_model", "no model given (-m=<path>)", flag="-m")
    with _as_onnx(source, opts) as (onnx_source, conversion):
        result = _compile_onnx(onnx_source, opts, progress, policy, model_folder)
    result.conversion = conversion
    return result


@contextmanager
def _as_onnx(
    source: ModelSource, opts: CompileOptions
) -> Iterator[tuple[ModelSource, dict[str, str] | None]]:
    """The model as ONNX: a TensorFlow or PyTorch model file is converted first
    (compiler_core/convert), into `-aic-binary-dir` (kept beside the QPC) or a temporary
    folder (removed after the compile); with what converted it."""
    if not isinstance(source, str | os.PathLike):
        yield source, None
        return
    from compiler_core.convert import convert_if_framework

    with tempfile.TemporaryDirectory(prefix="qpcfarm-onnx-") as scratch:
        out = Path(opts.aic_binary_dir) if opts.aic_binary_dir else Path(scratch)
        converted = convert_if_framework(source, out, opts.input_shapes)
        if converted is None:
            yield source, None
        else:
            yield str(converted.onnx_path), converted.describe()


def _compile_onnx(
    source: ModelSource,
    opts: CompileOptions,
    progress: Progress | None,
    policy: CodegenPolicy | None,
    model_folder: ModelFolder,
) -> CompileResult:
    if worth_checking(source, opts):  # refused in a moment, not after minutes of compiling
        require_fit(check_fit(source, opts, model_folder))
    reference = None
    if opts.dump_profile:
        from compiler_core.quant.calibrate import dump_profile

        # the profile this compile quantizes with
        reference = dump_profile(compile_model, source, opts, model_folder)
    try:
        with _gc_paused():
            result = _compile(source, opts, progress, policy or CodegenPolicy(), model_folder)
        if opts.quantize and opts.input_list_file:
            from compiler_core.quant.calibrate import add_accuracy

            add_accuracy(compile_model, source, opts, result, reference, model_folder)
            reference = None
    finally:
        if reference is not None:
            reference.result.cleanup()
    return result


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector for the compile.

    The IR allocates hundreds of thousands of small objects that live until the compile ends;
    CPython's collector keeps rescanning them (a fifth of the compile time of a ResNet-50).
    Reference counting still frees everything acyclic at once; cycles wait for the end.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _compile(
    source: ModelSource,
    opts: CompileOptions,
    progress: Progress | None,
    policy: CodegenPolicy,
    folder: ModelFolder,
) -> CompileResult:
    """import -> graph passes -> lower (once per specialization) -> plan memory -> emit ->
    write the QPC; warnings now, the metrics when first asked for. A partition config
    compiles one program per device instead (compiler_core/mdp/build.py)."""
    if opts.mdp_load_partition_config or (opts.mdp_devices or 1) > 1:
        from compiler_core.mdp.build import compile_partitioned

        return compile_partitioned(source, opts, progress, policy, folder)
    stages = Stages(progress)
    builds = [
        lower_spec(source, opts, spec, stages, policy, folder)
        for spec in specializations(opts, folder)
    ]
    retained = retained_state(builds, opts)
    shared, constant_items = shared_constants(builds)
    for build, region in zip(builds, shared, strict=True):
        plan_and_emit(build, region, opts, stages)
    out_dir, tmpdir = output_dir(opts)
    with stages.stage("write-qpc"):
        write_network_qpc(out_dir / "programqpc.bin", builds, opts, retained, constant_items)
    if opts.mdp_dump_partition_config:  # the partition of a single-device compile: one SoC
        from compiler_core.mdp.build import dump_from_qpc

        dump_from_qpc(out_dir / "programqpc.bin", opts.mdp_dump_partition_config)
    timelines = Timelines(builds, opts.device)
    return CompileResult(
        qpc_path=out_dir / "programqpc.bin",
        _report=functools.partial(build_metrics, builds, opts, timelines),
        warnings=build_warnings(builds, opts, retained, timelines),
        pass_times=stages.pass_times(),
        options=opts,
        program=builds[0].done()[1],
        programs={spec_name(b.spec): b.done()[1] for b in builds},
        _tmpdir=tmpdir,
    )
