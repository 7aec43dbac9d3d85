"""Graph passes on onnx_ir models, and the manager that runs them with timing and progress."""

from compiler_core.passes.base import GraphPass
from compiler_core.passes.canonicalize import CanonicalizePass
from compiler_core.passes.check_fp16_range import CheckFp16RangePass
from compiler_core.passes.convert_precision import ConvertToFp16Pass
from compiler_core.passes.eliminate_common_subexpressions import (
    EliminateCommonSubexpressionsPass,
)
from compiler_core.passes.eliminate_dead_code import EliminateDeadCodePass
from compiler_core.passes.fold_batchnorm import FoldBatchNormIntoConvPass
from compiler_core.passes.fold_constants import FoldConstantsPass
from compiler_core.passes.fold_matmul_scale import FoldMatMulScalePass
from compiler_core.passes.fuse_epilogue import FuseEpiloguePass, FusionRefusal
from compiler_core.passes.manager import PassContext, PassTiming, ProgressReporter, run_passes
from compiler_core.passes.pipeline import PASS_NAMES, graph_pipeline

__all__ = [
    "PASS_NAMES",
    "CanonicalizePass",
    "CheckFp16RangePass",
    "ConvertToFp16Pass",
    "EliminateCommonSubexpressionsPass",
    "EliminateDeadCodePass",
    "FoldBatchNormIntoConvPass",
    "FoldConstantsPass",
    "FoldMatMulScalePass",
    "FuseEpiloguePass",
    "FusionRefusal",
    "GraphPass",
    "PassContext",
    "PassTiming",
    "ProgressReporter",
    "graph_pipeline",
    "run_passes",
]
