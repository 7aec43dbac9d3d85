"""The graph-pass pipeline, in order: clean up, fold, fuse, then optionally lower precision."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Protocol

from compiler_core.custom_io import load_custom_io
from compiler_core.model_folder import LOCAL, ModelFolder
from compiler_core.node_precision import NodePrecision, load_node_precision
from compiler_core.passes.apply_custom_io import BFLOAT16_CAST_OPSET, ApplyCustomIOPass
from compiler_core.passes.base import GraphPass
from compiler_core.passes.canonicalize import CanonicalizePass
from compiler_core.passes.check_fp16_range import CheckFp16RangePass
from compiler_core.passes.convert_precision import ConvertToFp16Pass, Fp16Scope
from compiler_core.passes.eliminate_common_subexpressions import (
    EliminateCommonSubexpressionsPass,
)
from compiler_core.passes.eliminate_dead_code import EliminateDeadCodePass
from compiler_core.passes.fold_batchnorm import FoldBatchNormIntoConvPass
from compiler_core.passes.fold_constants import FoldConstantsPass
from compiler_core.passes.fold_matmul_scale import FoldMatMulScalePass
from compiler_core.passes.fold_qdq import FoldQDQPass
from compiler_core.passes.fuse_epilogue import FuseEpiloguePass
from compiler_core.passes.gather_slots import GatherSlotsPass
from compiler_core.passes.quantize import QuantizePass, QuantSettings
from compiler_core.passes.raise_opset import RaiseOpsetPass


class PipelineOptions(Protocol):
    """What the pipeline reads from `compiler_core.options.CompileOptions`."""

    @property
    def convert_to_fp16(self) -> bool: ...

    @property
    def custom_io_list_file(self) -> str | None: ...

    @property
    def node_precision_info(self) -> str | None: ...

    # Read when present (CompileOptions has them): quantize, load_profile, dump_profile,
    # execute_nodes_in_fp16, keep_original_precision_for_nodes.


_FUSE_EPILOGUES: ContextVar[bool] = ContextVar("fuse_epilogues", default=True)


@contextmanager
def without_epilogue_fusion() -> Iterator[None]:
    """Compiles inside leave every node its own kernel, so that every node's output is a
    kernel output the runtime can observe (calibration profiles them)."""
    token = _FUSE_EPILOGUES.set(False)
    try:
        yield
    finally:
        _FUSE_EPILOGUES.reset(token)


PASS_NAMES = (
    CanonicalizePass.name,
    FoldConstantsPass.name,
    GatherSlotsPass.name,
    EliminateDeadCodePass.name,
    EliminateCommonSubexpressionsPass.name,
    FoldBatchNormIntoConvPass.name,
    QuantizePass.name,
    FoldQDQPass.name,
    RaiseOpsetPass.name,
    FoldMatMulScalePass.name,
    CheckFp16RangePass.name,
    FuseEpiloguePass.name,
    ConvertToFp16Pass.name,
    ApplyCustomIOPass.name,
)
"""Every pass name the pipeline can contain (what may be disabled)."""


def graph_pipeline(options: PipelineOptions, folder: ModelFolder = LOCAL) -> list[GraphPass]:
    """Fresh pass instances for one compile (passes hold per-run results such as warnings).

    A GatherND of whole cache slots becomes a Gather once folding has made its indices' constant
    parts constants. Folding runs again after BatchNorm folding because folding creates new
    constants; epilogue fusion comes after every rewrite that expects plain ONNX and after
    raising an old model's opset for a bfloat16 boundary Cast (fusion records each step at the
    model's opset); float16's range is looked after before it (a scale folds out of a MatMul
    before fusion makes it the MatMul's epilogue); precision conversion last, so that it sees
    the final constants (folded weights are clipped once, after folding); the boundary
    precisions of `-custom-IO-list-file` after that, so they replace its boundary Casts rather
    than add to them. Files the options name are read through `folder`; a profile this compile
    has just written (`-dump-profile`) is its own output and is read where it was written.
    """
    passes: list[GraphPass] = [
        CanonicalizePass(),
        FoldConstantsPass(),
        GatherSlotsPass(),
        EliminateDeadCodePass(),
        EliminateCommonSubexpressionsPass(),
        FoldBatchNormIntoConvPass(),
        FoldConstantsPass(),
    ]
    fp16_types = frozenset(getattr(options, "execute_nodes_in_fp16", ()))
    keep = fp16_types | frozenset(getattr(options, "keep_original_precision_for_nodes", ()))
    if getattr(options, "quantize", False):
        from compiler_core.quant.profile import read_profile

        load = getattr(options, "load_profile", None)
        dumped = getattr(options, "dump_profile", None)
        flag = "-load-profile" if load else "-dump-profile"
        path = load or dumped
        assert path is not None
        source = LOCAL if path == dumped else folder
        profile = read_profile(path, flag, source)
        passes.append(QuantizePass(profile, QuantSettings.from_options(options)))
    passes.append(FoldQDQPass(keep_float=keep))
    custom_io = (
        load_custom_io(options.custom_io_list_file, folder) if options.custom_io_list_file else []
    )
    if any(entry.precision == "bfloat16" for entry in custom_io):
        passes.append(RaiseOpsetPass(BFLOAT16_CAST_OPSET, "a bfloat16 boundary Cast"))
    precision = (
        load_node_precision(options.node_precision_info, folder)
        if options.node_precision_info
        else None
    )
    scope = _fp16_scope(options.convert_to_fp16, precision, fp16_types)
    if scope is not None:
        passes += [FoldMatMulScalePass(scope), CheckFp16RangePass(scope)]
    if _FUSE_EPILOGUES.get():
        passes.append(FuseEpiloguePass())
    if options.convert_to_fp16:
        passes.append(ConvertToFp16Pass(keep_fp32=precision.fp32 if precision else frozenset()))
    elif fp16_types:
        only = precision.fp16 if precision is not None else frozenset()
        passes.append(ConvertToFp16Pass(only=only, only_types=fp16_types))
    elif precision is not None and precision.fp16:
        passes.append(ConvertToFp16Pass(only=precision.fp16))
    mxint8_kv_cache = bool(getattr(options, "mxint8_kv_cache", False))
    if options.custom_io_list_file or mxint8_kv_cache:
        passes.append(ApplyCustomIOPass(custom_io, mxint8_kv_cache=mxint8_kv_cache))
    passes.append(EliminateDeadCodePass())
    return passes


def _fp16_scope(
    convert_to_fp16: bool, precision: NodePrecision | None, fp16_types: frozenset[str]
) -> Fp16Scope | None:
    """The nodes the conversion will compute in float16 (as ConvertToFp16Pass picks them),
    or None when nothing is."""
    if convert_to_fp16:
        return Fp16Scope(everything=True, fp32=precision.fp32 if precision else frozenset())
    if fp16_types or (precision is not None and precision.fp16):
        fp16 = precision.fp16 if precision is not None else frozenset()
        return Fp16Scope(everything=False, fp16=fp16, types=fp16_types)
    return None
