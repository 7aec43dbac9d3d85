"""The op registry and the op modules that fill it.

Importing this package imports no op module: `REGISTRY` imports the module of an op the first
time the op is looked up (see `registry`), so a compile pays only for the kernels it uses.
"""

from compiler_core.ops.registry import REGISTRY, Box, NodeInfo, OpDef, TileCtx

__all__ = ["REGISTRY", "Box", "NodeInfo", "OpDef", "TileCtx"]
