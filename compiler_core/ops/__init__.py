"""Importing this package fills the op registry, family by family."""

from compiler_core.ops import (  # noqa: F401  (imported for their registrations)
    activation,
    attention,
    bitcast,
    causal_conv,
    control_flow,
    conv,
    detection,
    elementwise,
    extra,
    flex_attention,
    kv_cache,
    linalg,
    linear_attention,
    loss,
    matmul,
    ml,
    norm,
    optional,
    pool,
    quant,
    quant_integer,
    recurrent,
    reduce,
    resize_pad,
    rotary,
    sampling,
    signal,
    tensor,
    text,
    training,
    unique,
    unpool,
)
from compiler_core.ops.registry import REGISTRY, Box, NodeInfo, OpDef, TileCtx

__all__ = ["REGISTRY", "Box", "NodeInfo", "OpDef", "TileCtx"]
