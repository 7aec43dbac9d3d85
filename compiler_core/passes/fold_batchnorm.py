"""Fold inference-mode BatchNormalization (and its expanded Mul/Add form) into Conv weights.

BN after Conv is a per-output-channel affine map y = x * s + t, so it folds exactly into the
Conv: W' = W * s (per output channel), B' = B * s + t. Exported models also spell BN as
Mul and Add by per-channel constants ([C,1,1] or [1,C,1,1]); those fold the same way. A BN
with nothing to fold into becomes Mul + Add, which the epilogue fusion then absorbs.
New weights are new initializers: the old ones may be shared and are left to dead-code
elimination.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import BinaryIO

import numpy as np
import onnx_ir as ir

from compiler_core.fusion import FUSED_NODES_KEY, fused_node_names
from compiler_core.passes.base import (
    GraphPass,
    NameScope,
    add_initializer,
    const_array,
    replace_value,
    static_dims,
)
from compiler_core.tensors import read_into, release_mapping

log = logging.getLogger(__name__)


class FoldBatchNormIntoConvPass(GraphPass):
    name = "fold-batchnorm"

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        names = NameScope(graph)
        counts = {"bn_into_conv": 0, "bn_to_mul_add": 0, "mul_add_into_conv": 0}
        changed = True
        while changed:
            changed = False
            for node in list(graph):
                if node.graph is None or node.domain not in ("", "ai.onnx"):
                    continue
                if node.op_type == "BatchNormalization":
                    if self._fold_bn_into_conv(graph, node, names):
                        counts["bn_into_conv"] += 1
                        changed = True
                    elif self._bn_to_mul_add(graph, node, names):
                        counts["bn_to_mul_add"] += 1
                        changed = True
                elif node.op_type in ("Mul", "Add") and self._fold_affine_into_conv(
                    graph, node, names
                ):
                    counts["mul_add_into_conv"] += 1
                    changed = True
        log.info(
            "fold-batchnorm: %d BatchNormalization into Conv, %d to Mul+Add, "
            "%d per-channel Mul/Add into Conv",
            counts["bn_into_conv"],
            counts["bn_to_mul_add"],
            counts["mul_add_into_conv"],
        )
        return ir.passes.PassResult(model, modified=any(counts.values()))

    def _fold_bn_into_conv(self, graph: ir.Graph, bn: ir.Node, names: NameScope) -> bool:
        params = _bn_params(bn)
        source = bn.inputs[0]
        if params is None or source is None:
            return False
        conv = _foldable_conv(source)
        if conv is None:
            return False
        scale, shift = params
        if not self._rescale_conv(graph, conv, scale, shift, names):
            return False
        _bypass(graph, bn, conv.outputs[0])
        return True

    def _bn_to_mul_add(self, graph: ir.Graph, bn: ir.Node, names: NameScope) -> bool:
        params = _bn_params(bn)
        source = bn.inputs[0]
        dims = static_dims(source)
        if params is None or source is None or dims is None or len(dims) < 2:
            return False
        out = bn.outputs[0]
        dtype = source.dtype.numpy() if source.dtype is not None else np.float32
        trailing = (1,) * (len(dims) - 2)
        scale, shift = params
        label = bn.name or "BatchNormalization"
        scale_value = add_initializer(
            graph, scale.astype(dtype).reshape(-1, *trailing), names.fresh(f"{label}_scale")
        )
        shift_value = add_initializer(
            graph, shift.astype(dtype).reshape(-1, *trailing), names.fresh(f"{label}_shift")
        )
        scaled = ir.Value(name=names.fresh(f"{label}/scaled"), type=source.type, shape=source.shape)
        result = ir.Value(name=names.fresh(f"{label}/out"), type=out.type, shape=out.shape)
        mul = ir.Node("", "Mul", [source, scale_value], outputs=[scaled], name=f"{label}/mul")
        add = ir.Node("", "Add", [scaled, shift_value], outputs=[result], name=f"{label}/add")
        graph.insert_before(bn, [mul, add])
        replace_value(out, result)
        graph.remove(bn, safe=True)
        return True

    def _fold_affine_into_conv(self, graph: ir.Graph, node: ir.Node, names: NameScope) -> bool:
        """Mul or Add of a Conv output by a per-output-channel constant."""
        if len(node.inputs) != 2 or node.inputs[0] is None or node.inputs[1] is None:
            return False
        for conv_side in (0, 1):
            source = node.inputs[conv_side]
            constant = const_array(node.inputs[1 - conv_side])
            assert source is not None
            conv = _foldable_conv(source)
            if conv is None or constant is None:
                continue
            channels = _per_channel(constant, static_dims(source))
            if channels is None:
                continue
            if node.op_type == "Mul":
                scale, shift = channels, np.zeros_like(channels)
            else:
                scale, shift = np.ones_like(channels), channels
            if not self._rescale_conv(graph, conv, scale, shift, names):
                return False
            _bypass(graph, node, conv.outputs[0])
            return True
        return False

    def _rescale_conv(
        self,
        graph: ir.Graph,
        conv: ir.Node,
        scale: np.ndarray,
        shift: np.ndarray,
        names: NameScope,
    ) -> bool:
        """Make `conv` compute conv(x) * scale + shift (per output channel)."""
        weight_value = conv.inputs[1]
        weight = weight_value.const_value if weight_value is not None else None
        if weight is None or weight.dtype is None:
            return False
        dims = tuple(int(d) for d in weight.shape.numpy())
        if not dims or dims[0] != scale.shape[0] and scale.shape[0] != 1:
            return False
        out_channels = dims[0]
        dtype = np.dtype(weight.dtype.numpy())
        scale = np.broadcast_to(scale.astype(np.float64), (out_channels,))
        shift = np.broadcast_to(shift.astype(np.float64), (out_channels,))
        bias = const_array(conv.inputs[2]) if len(conv.inputs) > 2 else None
        bias64 = np.zeros(out_channels) if bias is None else bias.astype(np.float64)
        new_weight = scaled_weight(weight, scale, dtype)
        new_bias = (bias64 * scale + shift).astype(dtype)
        label = conv.name or "Conv"
        _set_input(graph, conv, 1, new_weight, names.fresh(f"{label}_W_folded"))
        if len(conv.inputs) < 3:
            conv.resize_inputs(3)
        _set_input(graph, conv, 2, new_bias, names.fresh(f"{label}_B_folded"))
        return True


def scaled_weight(weight: ir.TensorProtocol, scale: np.ndarray, dtype: np.dtype) -> ScaledWeight:
    """`weight * scale` per output channel, computed only when the QPC's constants are
    written, so folding a large model never holds old and new weights side by side."""
    trailing = (1,) * (len(weight.shape) - 1)
    # Computed in the weights' own precision (fp16 via fp32): a single rounding, as other
    # compilers fold, and a fraction of the time of an fp64 round trip.
    work = np.dtype(np.float32) if dtype == np.float16 else np.dtype(dtype)
    factor = scale.reshape(-1, *trailing).astype(work)

    def compute() -> ir.TensorProtocol:
        source = np.asarray(weight.numpy())
        if source.dtype == work and source.flags.aligned:
            product = np.multiply(source, factor)
        else:
            # weights read in place from the model file are often unaligned, and numpy then
            # multiplies through small buffers (several copies per element): one aligned copy,
            # then the product in place, is the same arithmetic at half the cost
            product = np.array(source, dtype=work)
            np.multiply(product, factor, out=product)
        result = product.astype(dtype, copy=False)
        del source
        release_mapping(weight)  # unmap the source pages now that they are read
        return ir.Tensor(result)  # what ir.tensor makes of an array, without its protocol checks

    return ScaledWeight(compute, weight, factor, dtype)


class ScaledWeight(ir.LazyTensor):
    """A folded weight: `compute` gives it as a tensor; `scale_into` writes its bytes into a
    buffer the caller reuses (the QPC writer), with no array of its own and no mapping of the
    model file: the same products, without the fresh pages of a new array per weight."""

    __slots__ = ("_factor", "_source", "_target")

    def __init__(
        self,
        compute: Callable[[], ir.TensorProtocol],
        source: ir.TensorProtocol,
        factor: np.ndarray,
        dtype: np.dtype,
    ) -> None:
        super().__init__(compute, dtype=source.dtype, shape=ir.Shape(source.shape.numpy()))
        self._source = source
        self._factor = factor
        self._target = dtype

    def scales_into(self, dtype: np.dtype) -> bool:
        """Whether `scale_into` can give the weight in `dtype`: its weights are read straight
        from a file (not mapped) in that dtype, little-endian, and it has bytes."""
        source = self._source
        return (
            isinstance(source, ir.ExternalTensor)
            and source.raw is None
            and dtype == self._target == self._factor.dtype == source.dtype.numpy()
            and dtype.byteorder != ">"
            and source.nbytes > 0
        )

    def scale_into(self, out: np.ndarray, files: dict[str, BinaryIO]) -> None:
        """Write the folded weight's bytes into `out` (uint8, its size; see `scales_into`).
        `files`: open files by path, shared by the caller's reads."""
        source = self._source
        assert isinstance(source, ir.ExternalTensor) and out.nbytes == source.nbytes
        read_into(source, out, files)
        product = out.view(self._target).reshape(self._factor.shape[0], -1)
        factor = self._factor.reshape(-1, 1)
        if product.shape[1] < _LONG_ROW:
            np.multiply(product, factor, out=product)
            return
        size = np.getbufsize()  # numpy keeps it per thread and context
        np.setbufsize(_ROW_BUFFER)
        try:
            np.multiply(product, factor, out=product)
        finally:
            np.setbufsize(size)


_LONG_ROW = 512
"""Weights with rows (one output channel's weights) at least this long are scaled row by row.
With its default buffer (8192 elements) numpy joins short rows into one buffered loop and
copies the row's factor into the buffer for every element, which costs more than the
products; a buffer shorter than a row leaves each row one in-place loop over its contiguous
weights and one factor (the same products: ResNet-50's 3x3 weights, 1.2 instead of 2.4
instructions a weight). Shorter rows are cheaper joined."""

_ROW_BUFFER = 16


def _set_input(
    graph: ir.Graph,
    node: ir.Node,
    index: int,
    data: np.ndarray | ir.TensorProtocol,
    name: str,
) -> None:
    """Give input `index` of `node` the constant `data`: in place when only this node reads
    the old initializer (so the old weights are freed at once), else as a new initializer."""
    tensor = ir.Tensor(data, name=name) if isinstance(data, np.ndarray) else data
    old = node.inputs[index]
    if (
        old is not None
        and old.is_initializer()
        and len(old.uses()) == 1
        and not (old.is_graph_input() or old.is_graph_output())
    ):
        old.const_value = tensor
        old.shape = ir.Shape(tensor.shape.numpy())
        return
    value = ir.Value(
        name=name,
        shape=ir.Shape(tensor.shape.numpy()),
        type=ir.TensorType(tensor.dtype),
        const_value=tensor,
    )
    graph.register_initializer(value)
    node.replace_input_with(index, value)


def _foldable_conv(value: ir.Value) -> ir.Node | None:
    """The Conv producing `value`, if its weights are constant and `value` has one reader."""
    conv = value.producer()
    if conv is None or conv.op_type != "Conv" or conv.domain not in ("", "ai.onnx"):
        return None
    if value.is_graph_output() or len(value.uses()) != 1:
        return None
    weight = conv.inputs[1] if len(conv.inputs) > 1 else None
    if weight is None or weight.const_value is None:  # never read the weights just to check
        return None
    if len(conv.inputs) > 2 and conv.inputs[2] is not None and conv.inputs[2].const_value is None:
        return None
    return conv


def _bn_params(bn: ir.Node) -> tuple[np.ndarray, np.ndarray] | None:
    """(scale, shift) of an inference-mode BN with constant parameters, in float64."""
    if len(bn.inputs) != 5:
        return None
    training = bn.attributes.get("training_mode")
    if training is not None and training.as_int() != 0:
        return None
    if any(out.uses() or out.is_graph_output() for out in bn.outputs[1:]):
        return None
    arrays = [const_array(value) for value in bn.inputs[1:]]
    if any(array is None for array in arrays):
        return None
    gamma, beta, mean, var = (np.asarray(a, dtype=np.float64).reshape(-1) for a in arrays)  # type: ignore[arg-type]
    eps_attr = bn.attributes.get("epsilon")
    eps = eps_attr.as_float() if eps_attr is not None else 1e-5
    scale = gamma / np.sqrt(var + np.float64(np.float32(eps)))
    return scale, beta - mean * scale


def _per_channel(constant: np.ndarray, out_dims: tuple[int, ...] | None) -> np.ndarray | None:
    """The per-channel vector of a constant that broadcasts along axis 1 of a Conv output
    (shapes like [C,1,1], [1,C,1,1], [1] or scalar), else None."""
    if out_dims is None or constant.ndim > len(out_dims):
        return None
    padded = (1,) * (len(out_dims) - constant.ndim) + constant.shape
    channels = out_dims[1]
    for axis, dim in enumerate(padded):
        if axis == 1:
            if dim not in (1, channels):
                return None
        elif dim != 1:
            return None
    return np.asarray(constant, dtype=np.float64).reshape(-1)


def _bypass(graph: ir.Graph, node: ir.Node, conv_out: ir.Value) -> None:
    """Remove `node` (now folded into the Conv) and let its readers read the Conv output.

    The Conv keeps the folded node's name, so reports and opstats still trace it."""
    conv = conv_out.producer()
    if conv is not None:
        conv.meta[FUSED_NODES_KEY] = (*fused_node_names(conv), node.name or node.op_type)
    replace_value(node.outputs[0], conv_out)
    graph.remove(node, safe=True)
