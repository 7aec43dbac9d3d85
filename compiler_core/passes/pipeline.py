"""The graph-pass pipeline, in order: clean up, fold, fuse, then optionally lower precision."""

from __future__ import annotations

from typing import Protocol

from compiler_core.custom_io import load_custom_io
from compiler_core.node_precision import load_node_precision
from compiler_core.passes.apply_custom_io import ApplyCustomIOPass
from compiler_core.passes.base import GraphPass
from compiler_core.passes.canonicalize import CanonicalizePass
from compiler_core.passes.convert_precision import ConvertToFp16Pass
from compiler_core.passes.eliminate_common_subexpressions import (
    EliminateCommonSubexpressionsPass,
)
from compiler_core.passes.eliminate_dead_code import EliminateDeadCodePass
from compiler_core.passes.fold_batchnorm import FoldBatchNormIntoConvPass
from compiler_core.passes.fold_constants import FoldConstantsPass
from compiler_core.passes.fold_qdq import FoldQDQPass
from compiler_core.passes.fuse_epilogue import FuseEpiloguePass


class PipelineOptions(Protocol):
    """What the pipeline reads from `compiler_core.options.CompileOptions`."""

    @property
    def convert_to_fp16(self) -> bool: ...

    @property
    def custom_io_list_file(self) -> str | None: ...

    @property
    def node_precision_info(self) -> str | None: ...


PASS_NAMES = (
    CanonicalizePass.name,
    FoldConstantsPass.name,
    EliminateDeadCodePass.name,
    EliminateCommonSubexpressionsPass.name,
    FoldBatchNormIntoConvPass.name,
    FoldQDQPass.name,
    FuseEpiloguePass.name,
    ConvertToFp16Pass.name,
    ApplyCustomIOPass.name,
)
"""Every pass name the pipeline can contain (what may be disabled)."""


def graph_pipeline(options: PipelineOptions) -> list[GraphPass]:
    """Fresh pass instances for one compile (passes hold per-run results such as warnings).

    Folding runs again after BatchNorm folding because folding creates new constants; epilogue
    fusion comes after every rewrite that expects plain ONNX; precision conversion last, so
    that it sees the final constants (folded weights are clipped once, after folding); the
    boundary precisions of `-custom-IO-list-file` after that, so they replace its boundary
    Casts rather than add to them.
    """
    passes: list[GraphPass] = [
        CanonicalizePass(),
        FoldConstantsPass(),
        EliminateDeadCodePass(),
        EliminateCommonSubexpressionsPass(),
        FoldBatchNormIntoConvPass(),
        FoldConstantsPass(),
        FoldQDQPass(),
        FuseEpiloguePass(),
    ]
    precision = (
        load_node_precision(options.node_precision_info) if options.node_precision_info else None
    )
    if options.convert_to_fp16:
        passes.append(ConvertToFp16Pass(keep_fp32=precision.fp32 if precision else frozenset()))
    elif precision is not None and precision.fp16:
        passes.append(ConvertToFp16Pass(only=precision.fp16))
    if options.custom_io_list_file:
        passes.append(ApplyCustomIOPass(load_custom_io(options.custom_io_list_file)))
    passes.append(EliminateDeadCodePass())
    return passes
