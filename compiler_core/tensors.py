"""Small helpers for the IR's tensors that several stages share."""

from __future__ import annotations

import onnx_ir as ir


def release_mapping(tensor: object) -> None:
    """Unmap a memory-mapped external tensor's pages once they have been read.

    A view still alive elsewhere keeps the mapping (Python refuses to close it); the pages
    are then freed with the last view, so this never fails.
    """
    if isinstance(tensor, ir.ExternalTensor):
        try:
            tensor.release()
        except BufferError:
            pass


SMALL_TENSOR_BYTES = 64 * 1024
"""External tensors up to this size are read into memory at import instead of mapped:
touching a mapped file can bring in a whole 2 MiB huge page for a few bytes."""


def read_external(tensor: ir.ExternalTensor) -> ir.Tensor:
    """The tensor's bytes read with a plain file read (no mapping), as an in-memory tensor."""
    import numpy as np

    with open(tensor.path, "rb") as source:
        source.seek(tensor.offset or 0)
        raw = source.read(tensor.nbytes)
    dtype = np.dtype(tensor.dtype.numpy()).newbyteorder("<")
    array = np.frombuffer(raw, dtype=dtype, count=tensor.size).reshape(tensor.shape.numpy())
    return ir.Tensor(array.astype(array.dtype.newbyteorder("=")), name=tensor.name)


def load_small_external(graph: ir.Graph, limit: int = SMALL_TENSOR_BYTES) -> int:
    """Replace external tensors by in-memory copies; returns how many were read.

    Read: every initializer of the main graph up to `limit` bytes, and every tensor attribute
    except the `value` of a main-graph Constant larger than `limit` (a weight: it stays
    mapped, like a large initializer). Subgraph tensors are read whatever their size: a body
    travels in the QPC serialized, and must not refer to a file.
    """
    count = 0
    for value in graph.initializers.values():
        tensor = value.const_value
        if isinstance(tensor, ir.ExternalTensor) and tensor.nbytes <= limit:
            value.const_value = read_external(tensor)
            count += 1
    for node in ir.traversal.RecursiveGraphIterator(graph):
        in_main = node.graph is graph
        for name, attr in list(node.attributes.items()):
            if attr.type == ir.AttributeType.GRAPH and attr.value is not None:
                count += _load_initializers(attr.as_graph())
            elif attr.type == ir.AttributeType.GRAPHS:
                count += sum(_load_initializers(body) for body in attr.as_graphs())
            if attr.type != ir.AttributeType.TENSOR:
                continue
            tensor = attr.as_tensor()
            if not isinstance(tensor, ir.ExternalTensor):
                continue
            if in_main and node.op_type == "Constant" and tensor.nbytes > limit:
                continue
            node.attributes[name] = ir.AttrTensor(name, read_external(tensor))
            count += 1
    return count


def _load_initializers(body: ir.Graph) -> int:
    count = 0
    for value in body.initializers.values():
        if isinstance(value.const_value, ir.ExternalTensor):
            value.const_value = read_external(value.const_value)
            count += 1
    return count
