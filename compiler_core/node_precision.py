"""`-node-precision-info`: nodes that keep float32 inside a float16 network, or the reverse.

The file is the vendor tool's YAML:

    FP32NodeInstanceNames:
      - /model/norm/ReduceMean      # a node's name, or the name of one of its outputs
    FP16NodeInstanceNames:
      - /model/mlp/MatMul

With `-convert-to-fp16` the FP32 nodes compute in float32 (a softmax or a norm that float16
would overflow), with Casts where they meet the float16 rest; without it, the FP16 nodes
compute in float16 inside the float32 network. The other list is then a no-op (the nodes
already have that precision). Names are checked against the model when the pass runs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from compiler_core.errors import CompileError
from compiler_core.model_folder import LOCAL, ModelFolder

FLAG = "-node-precision-info"
KEYS = ("FP32NodeInstanceNames", "FP16NodeInstanceNames")


@dataclass(frozen=True)
class NodePrecision:
    fp32: frozenset[str]
    fp16: frozenset[str]


def load_node_precision(path: str | os.PathLike[str], folder: ModelFolder = LOCAL) -> NodePrecision:
    import yaml

    text = folder.read_text(path, FLAG)
    try:
        doc = yaml.safe_load(text)
    except (yaml.YAMLError, RecursionError) as exc:
        raise _invalid(f"{path} is not valid YAML: {exc}") from None
    if not isinstance(doc, dict) or not doc or set(doc) - set(KEYS):
        raise _invalid(f"{path} must be a mapping with the keys {' and/or '.join(KEYS)}")
    lists = {}
    for key in KEYS:
        names = doc.get(key) or []
        if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
            raise _invalid(f"{key} must be a list of node names")
        lists[key] = frozenset(names)
    both = sorted(lists[KEYS[0]] & lists[KEYS[1]])
    if both:
        raise _invalid(f"{', '.join(both)} is listed as both FP32 and FP16")
    return NodePrecision(fp32=lists[KEYS[0]], fp16=lists[KEYS[1]])


def _invalid(message: str) -> CompileError:
    return CompileError("invalid_option", f"{FLAG}: {message}", flag=FLAG)
