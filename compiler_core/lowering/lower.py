"""Lower the optimised graph to kernels with tiles on cores, before memory is placed.

Every node becomes one kernel (its fused epilogue included), except pure reinterpretations
(Reshape, Squeeze...) whose output simply aliases its input's bytes. Graph outputs that are
constants or graph inputs get an explicit copy kernel so every output has its own buffer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from compiler_core.cost_rates import int8_step_ops, integer_step
from compiler_core.devices import DeviceProfile
from compiler_core.errors import CompileError
from compiler_core.fusion import base_input_count, epilogue, fused_node_names
from compiler_core.lowering import ksplit
from compiler_core.lowering.lowered import LKernel, LoweredGraph, LTensor, Mxint8Tensor
from compiler_core.lowering.program import (
    KIND_ACTIVATION,
    KIND_CONSTANT,
    KIND_INPUT,
    KIND_OUTPUT,
    SCATTER_IN_PLACE,
    EpilogueDesc,
    KernelDesc,
)
from compiler_core.lowering.splits import KernelSplit, SplitChooser
from compiler_core.lowering.tiling import TilingRequest, plan_tiles
from compiler_core.model_folder import LOCAL, ModelFolder
from compiler_core.nodeinfo import (
    DECLARED_SHAPE,
    OUTER_SCOPE,
    dtype_name,
    node_info,
    node_opset,
    outer_scope_values,
    static_shape,
)
from compiler_core.ops import REGISTRY
from compiler_core.ops.registry import NodeInfo, no_split, whole_inputs


@dataclass(frozen=True)
class LoweringConfig:
    num_cores: int
    ols: int
    mos: int | None
    vtcm_budget: int
    granularity: int
    device: DeviceProfile | None = None
    """Whose rates price the splits (None: cut by bytes read alone)."""
    active_cores: int | None = None
    """Cut kernels over this many of the cores only (None: all); the rest stay idle."""
    k_splits: bool = True
    """Let the chooser split MatMul/Gemm along K where that is faster (see `ksplit`)."""
    retain_state: bool = False
    """-retained-state: `<input>_RetainedState` outputs share their input's device buffer."""
    mxint8: frozenset[str] = frozenset()
    """Retained state stored as MXINT8 blocks, by input or `_RetainedState` output name."""
    mxint8_all: bool = False
    """-mxint8-kv-cache: every retained-state tensor stored as MXINT8."""


def config_from(
    options: object, device: DeviceProfile, folder: ModelFolder = LOCAL
) -> LoweringConfig:
    ratio = float(getattr(options, "vtcm_working_set_limit_ratio", 1.0) or 1.0)
    granularity_kib = int(getattr(options, "size_split_granularity", 1024) or 1024)
    return LoweringConfig(
        num_cores=int(getattr(options, "aic_num_cores", 1) or 1),
        ols=int(getattr(options, "ols", 1) or 1),
        mos=getattr(options, "mos", None),
        vtcm_budget=int(device.vtcm_bytes_per_core * ratio),
        granularity=granularity_kib * 1024,
        device=device,
        # MXFP6 weights are encoded for MatMul/Gemm B operands read whole along K
        k_splits=not getattr(options, "mxfp6_matmul", False),
        retain_state=bool(getattr(options, "retained_state", False)),
        mxint8=_mxint8_names(options, folder),
        mxint8_all=bool(getattr(options, "mxint8_kv_cache", False)),
    )


def _mxint8_names(options: object, folder: ModelFolder) -> frozenset[str]:
    """The custom-IO list's MXINT8 entries, read through the compile's model folder."""
    path = getattr(options, "custom_io_list_file", None)
    if not path:
        return frozenset()
    from compiler_core.custom_io import load_custom_io, mxint8_names

    return mxint8_names(load_custom_io(path, folder))


class _Builder:
    def __init__(self, graph: ir.Graph, opset: int, config: LoweringConfig) -> None:
        self.graph = graph
        self.opset = opset
        self.config = config
        self.tensors: list[LTensor] = []
        self.by_value: dict[int, int] = {}
        self.kernels: list[LKernel] = []
        self.output_values = {id(v) for v in graph.outputs}

    def tensor(self, value: ir.Value) -> int:
        key = id(value)
        if key in self.by_value:
            return self.by_value[key]
        shape = static_shape(value)
        dtype = dtype_name(value.dtype)
        if shape is None or dtype is None:
            producer = value.producer()
            raise CompileError(
                "dynamic_shape",
                f"value '{value.name}' has no static shape or type after the graph passes",
                node=producer.name if producer is not None else None,
            )
        if value.const_value is not None:
            kind = KIND_CONSTANT
        elif value.is_graph_input():
            kind = KIND_INPUT
        elif key in self.output_values:
            kind = KIND_OUTPUT
        else:
            kind = KIND_ACTIVATION
        tid = len(self.tensors)
        self.tensors.append(
            LTensor(
                id=tid,
                name=value.name or f"t{tid}",
                dtype=dtype,
                shape=shape,
                kind=kind,
                data=value.const_value if kind == KIND_CONSTANT else None,
            )
        )
        self.by_value[key] = tid
        return tid

    def add_kernel(
        self,
        info: NodeInfo,
        inputs: list[int],
        outputs: list[int],
        steps: tuple[EpilogueDesc, ...],
        nodes: tuple[str, ...],
        op_types: tuple[str, ...],
        *,
        whole: bool = False,
    ) -> None:
        """`whole`: the output shape is data-dependent (declared by the model), so the kernel
        runs untiled on one core and reads its shape operands at run time; the runtime then
        checks the shape it produces against the plan."""
        opdef = REGISTRY.lookup(info.op_type, info.domain, info.opset)
        if opdef is None:
            raise CompileError(
                "unsupported_operator",
                f"no kernel for {info.op_type} (opset {info.opset}) at node '{info.name}'",
                node=info.name,
            )
        tiling_def = (
            dataclasses.replace(opdef, split_axes=no_split, input_boxes=whole_inputs)
            if whole
            else opdef
        )
        n_base = len(info.in_shapes)
        extra = inputs[n_base:]
        kid = len(self.kernels)
        request = TilingRequest(
            info=info,
            opdef=tiling_def,
            extra_shapes=tuple(self.tensors[t].shape for t in extra),
            extra_dtypes=tuple(self.tensors[t].dtype for t in extra),
            num_cores=self.config.num_cores,
            ols=self.config.ols,
            mos=self.config.mos,
            budget=self.config.vtcm_budget,
            granularity=self.config.granularity,
            rotate=kid,
            indexed=frozenset(
                i
                for i in opdef.indexed_inputs
                if i < len(inputs)
                and inputs[i] >= 0
                and self.tensors[inputs[i]].kind == KIND_CONSTANT
                and not whole
            ),
        )
        tiles = [] if self.config.device is not None else plan_tiles(request)
        macs = int(opdef.macs(info))
        out_elems = int(np.prod(info.out_shapes[0], dtype=np.int64)) if info.out_shapes else 0
        desc = KernelDesc(
            id=kid,
            name=info.name,
            info=info,
            inputs=tuple(inputs),
            outputs=tuple(outputs),
            epilogue=steps,
            kernel=opdef.kernel_name,
            unit=opdef.unit,
            macs=macs + out_elems * len(steps),
            nodes=nodes,
            op_types=op_types,
        )
        self.kernels.append(LKernel(desc=desc, tiles=tiles, request=request))

    def lower_node(self, node: ir.Node) -> None:
        opset = node_opset(node, self.graph.opset_imports, self.opset)
        opdef = REGISTRY.lookup(node.op_type, node.domain, opset)
        steps = epilogue(node)
        live = list(node.outputs)
        while live and not live[-1].name and not live[-1].uses():
            live.pop()  # omitted optional outputs
        # An unnamed output in the middle (LSTM's Y beside Y_h) is computed and dropped.
        outputs = [self.tensor(v) if v.name or v.uses() else -1 for v in live]
        declared = any(v.meta.get(DECLARED_SHAPE) for v in node.outputs)
        if (
            opdef is not None
            and not declared
            and opdef.alias
            and not steps
            and len(outputs) == 1
            and node.inputs
            and node.inputs[0] is not None
            and self.tensors[outputs[0]].kind == KIND_ACTIVATION
        ):
            src = self.tensor(node.inputs[0])
            self.tensors[outputs[0]].alias_of = src
            return
        n_base = base_input_count(node)
        info = node_info(node, opset)
        info = NodeInfo(
            op_type=info.op_type,
            name=info.name,
            attrs=info.attrs,
            in_shapes=info.in_shapes[:n_base],
            in_dtypes=info.in_dtypes[:n_base],
            out_shapes=info.out_shapes,
            out_dtypes=info.out_dtypes,
            opset=info.opset,
            domain=info.domain,
            consts={k: v for k, v in info.consts.items() if k < n_base},
        )
        inputs = [-1 if v is None else self.tensor(v) for v in node.inputs]
        captured = outer_scope_values(node)
        if captured:
            # Outer-scope values a subgraph reads become base inputs after the node's own.
            assert not steps, "fuse-epilogue never fuses into a node with subgraphs"
            info = dataclasses.replace(
                info,
                attrs={**info.attrs, OUTER_SCOPE: [v.name or "" for v in captured]},
                in_shapes=(*info.in_shapes, *(static_shape(v) for v in captured)),
                in_dtypes=(*info.in_dtypes, *(dtype_name(v.dtype) for v in captured)),
            )
            inputs = [*inputs[:n_base], *(self.tensor(v) for v in captured)]
        out_dtype = info.out_dtypes[0] if info.out_dtypes else "float32"
        descs = tuple(
            EpilogueDesc(
                op_type=s.op_type,
                node_name=s.node_name,
                inputs=self._epilogue_refs(s.inputs, inputs, n_base),
                attrs=dict(s.attrs),
                opset=self.opset,
                out_dtype=out_dtype,
                domain=s.domain,
            )
            for s in steps
        )
        names = fused_node_names(node)
        op_types = (node.op_type, *(s.op_type for s in steps))
        self.add_kernel(info, inputs, outputs, descs, names, op_types, whole=declared)

    @staticmethod
    def _epilogue_refs(
        refs: tuple[int | None, ...], inputs: list[int], n_base: int
    ) -> tuple[int | None, ...]:
        """Point every epilogue operand at an operand slot of its own.

        A step may read one of the base op's inputs (`Conv(x) + x`); the base op's slot holds
        the box the base op needs (a halo, every channel), not the output tile's box, so the
        step gets a separate slot whose box follows the output tile.
        """
        out: list[int | None] = []
        for ref in refs:
            if ref is not None and 0 <= ref < n_base:
                inputs.append(inputs[ref])
                ref = len(inputs) - 1
            out.append(ref)
        return tuple(out)

    def copy_kernel(self, src: int, dst: int) -> None:
        t = self.tensors[dst]
        info = NodeInfo(
            op_type="Identity",
            name=f"copy_to_{t.name}",
            attrs={},
            in_shapes=(self.tensors[src].shape,),
            in_dtypes=(self.tensors[src].dtype,),
            out_shapes=(t.shape,),
            out_dtypes=(t.dtype,),
            opset=self.opset,
        )
        self.add_kernel(info, [src], [dst], (), (info.name,), ("Identity",))


def lower_graph(graph: ir.Graph, opset: int, config: LoweringConfig) -> LoweredGraph:
    builder = _Builder(graph, opset, config)
    inputs = [builder.tensor(v) for v in graph.inputs]
    for node in graph:
        builder.lower_node(node)
    outputs: list[int] = []
    for value in graph.outputs:
        tid = builder.tensor(value)
        if builder.tensors[tid].kind != KIND_OUTPUT:
            src = tid
            out = len(builder.tensors)
            builder.tensors.append(
                LTensor(
                    id=out,
                    name=value.name or f"t{out}",
                    dtype=builder.tensors[src].dtype,
                    shape=builder.tensors[src].shape,
                    kind=KIND_OUTPUT,
                )
            )
            builder.copy_kernel(src, out)
            tid = out
        outputs.append(tid)
    retained = _retain_state(builder, inputs, outputs) if config.retain_state else {}
    if config.mxint8 and not config.retain_state:
        raise CompileError(
            "invalid_option",
            "-custom-IO-list-file: Precision mxint8 stores retained state; it needs "
            "-retained-state",
            flag="-custom-IO-list-file",
        )
    lowered = LoweredGraph(
        tensors=builder.tensors,
        kernels=builder.kernels,
        inputs=inputs,
        outputs=outputs,
        num_cores=config.num_cores,
        network_name=graph.name or "network",
        retained=retained,
    )
    if config.device is not None:
        choose_splits(
            lowered, config.device, config.vtcm_budget, config.active_cores, config.k_splits
        )
    return lowered


def _retain_state(builder: _Builder, inputs: list[int], outputs: list[int]) -> dict[int, int]:
    """Make each `<input>_RetainedState` output and its input one device buffer.

    A scatter (`ops/in_place_scatter.py`) that writes the cache input into its own retained
    output, when nothing else reads the cache, is done in place: the output aliases the input
    and the kernel becomes a scatter DMA of the new rows only. Any other retained output is
    copied into its input on the device by a copy kernel after everything that reads the
    input. Pairs that do not match (no such input, another type or shape) are left for the
    compile to refuse.
    """
    from compiler_core.qpc.networkdesc import RETAINED_SUFFIX

    tensors = builder.tensors
    by_name = {tensors[t].name: t for t in inputs}
    producer = {t: k for k, lk in enumerate(builder.kernels) for t in lk.desc.outputs if t >= 0}
    config = builder.config
    pairs: dict[int, int] = {}
    mx_named: set[str] = set()
    for out in outputs:
        t = tensors[out]
        source = (
            by_name.get(t.name[: -len(RETAINED_SUFFIX)])
            if t.name.endswith(RETAINED_SUFFIX)
            else None
        )
        if source is None or (tensors[source].dtype, tensors[source].shape) != (t.dtype, t.shape):
            continue
        pairs[source] = out
        names = {tensors[source].name, t.name}
        mx = config.mxint8_all or bool(names & config.mxint8)
        mx_named |= names & config.mxint8
        k = producer.get(out)
        if k is not None and _scatters_in_place(builder, k, source, mx):
            _make_in_place(builder, k, source, out, mx)
            _gather_rows_by_dma(builder, out)
        elif mx:
            raise CompileError(
                "unsupported_option",
                f"{tensors[source].name}: MXINT8 storage needs the retained output "
                f"{t.name!r} written in place by a TensorScatter (or a ScatterND writing "
                "whole rows) of its input",
                flag="-custom-IO-list-file" if not config.mxint8_all else "-mxint8-kv-cache",
            )
        else:
            builder.copy_kernel(out, source)
    stray = sorted(config.mxint8 - mx_named)
    if stray:
        raise CompileError(
            "invalid_option",
            f"-custom-IO-list-file: Precision mxint8 is a storage format of retained state "
            f"(-retained-state), but {', '.join(map(repr, stray))} is not a retained input or "
            "output",
            flag="-custom-IO-list-file",
        )
    return pairs


def _root(tensors: list[LTensor], tid: int) -> int:
    while tensors[tid].alias_of is not None:
        tid = tensors[tid].alias_of  # type: ignore[assignment]
    return tid


def _scatters_in_place(builder: _Builder, k: int, source: int, mxint8: bool) -> bool:
    """Kernel k is a plain scatter (TensorScatter, ScatterND or ScatterElements without a
    reduction) into `source`, and no other kernel reads `source`."""
    from compiler_core.ops.in_place_scatter import can_scatter_in_place

    desc = builder.kernels[k].desc
    tensors = builder.tensors
    if desc.info.domain != "" or desc.epilogue or not can_scatter_in_place(desc.info, mxint8):
        return False
    if len(desc.outputs) != 1 or len(desc.inputs) < 3 or desc.inputs[2] < 0:
        return False
    if desc.inputs[0] != source or any(
        _root(tensors, t) == source for t in desc.inputs[1:] if t >= 0
    ):
        return False
    return not any(
        t >= 0 and _root(tensors, t) == source
        for other, lk in enumerate(builder.kernels)
        if other != k
        for t in lk.desc.inputs
    )


def _make_in_place(builder: _Builder, k: int, source: int, out: int, mxint8: bool) -> None:
    from compiler_core.ops.in_place_scatter import whole_input_boxes
    from compiler_core.ops.kv_cache import in_place_input_boxes

    lk = builder.kernels[k]
    builder.tensors[out].alias_of = source
    if mxint8:  # the input and its retained output: one buffer of MX blocks
        for tid in (source, out):
            held = builder.tensors[tid]
            builder.tensors[tid] = Mxint8Tensor(
                id=held.id,
                name=held.name,
                dtype=held.dtype,
                shape=held.shape,
                kind=held.kind,
                alias_of=held.alias_of,
            )
    lk.desc = dataclasses.replace(lk.desc, kernel=SCATTER_IN_PLACE)
    assert lk.request is not None
    tensor_scatter = lk.desc.info.op_type == "TensorScatter"
    boxes = in_place_input_boxes if tensor_scatter else whole_input_boxes
    opdef = dataclasses.replace(
        lk.request.opdef, input_boxes=boxes, output_in_ddr=not tensor_scatter
    )
    if mxint8 and tensor_scatter:  # a tile writes whole MX blocks: never cut the block (last) axis
        whole_rows = _without_last_axis(opdef.split_axes)
        opdef = dataclasses.replace(opdef, split_axes=whole_rows)
    lk.request = dataclasses.replace(lk.request, opdef=opdef)
    if builder.config.device is None:
        lk.tiles = plan_tiles(lk.request)


def _gather_rows_by_dma(builder: _Builder, cache: int) -> None:
    """A Gather of a cache written in place (continuous batching's slot gather) fetches only
    the rows its indices name, by a gather DMA, as an embedding lookup does from a weight:
    a decode of some of the slots reads only their caches."""
    for lk in builder.kernels:
        request, desc = lk.request, lk.desc
        if request is None or desc.info.op_type != "Gather" or desc.epilogue:
            continue
        if not desc.inputs or desc.inputs[0] != cache or 0 not in request.opdef.indexed_inputs:
            continue
        request = dataclasses.replace(request, indexed=request.indexed | {0})
        if isinstance(builder.tensors[_root(builder.tensors, cache)], Mxint8Tensor):
            # an MXINT8 cache is fetched in whole MX blocks: never cut the block (last) axis
            whole = _without_last_axis(request.opdef.split_axes)
            request = dataclasses.replace(
                request, opdef=dataclasses.replace(request.opdef, split_axes=whole)
            )
        lk.request = request
        if builder.config.device is None:
            lk.tiles = plan_tiles(lk.request)


def _without_last_axis(
    split_axes: Callable[[NodeInfo], list[int]],
) -> Callable[[NodeInfo], list[int]]:
    def axes(node: NodeInfo) -> list[int]:
        last = len(node.out_shapes[0]) - 1
        return [a for a in split_axes(node) if a != last]

    return axes


RESIDENT_SHARE = 1.0
"""Of each core's VTCM budget, what the split chooser prices resident weights against: all of
it (measured: a tighter share forces channel splits whose padding costs more than streaming
the weights that then do not fit; placement decides what really stays resident)."""


def choose_splits(
    lowered: LoweredGraph,
    device: DeviceProfile,
    budget: int,
    active: int | None = None,
    k_splits: bool = True,
) -> None:
    """Cut every kernel by modelled time (see `splits`), in program order; kernels whose
    fastest cut is along K become a partial product and a reduction (see `ksplit`)."""
    producer: dict[int, int] = {}
    slot_of: dict[int, int] = {}
    for index, lk in enumerate(lowered.kernels):
        for slot, t in enumerate(lk.desc.outputs):
            if t >= 0:
                producer[t] = index
                slot_of[t] = slot
    items = []
    for lk in lowered.kernels:
        assert lk.request is not None
        kinds, producers, reshaped, sizes, slots = [], [], [], [], []
        for tid in lk.desc.inputs:
            slots.append(slot_of.get(lowered.root(tid), 0) if tid >= 0 else 0)
            if tid < 0:
                kinds.append("none")
                producers.append(-1)
                reshaped.append(False)
                sizes.append(0)
                continue
            root = lowered.root(tid)
            held = lowered.tensors[root]
            if held.kind == KIND_CONSTANT:
                kind = "constant"
            elif root in producer and held.kind in (KIND_ACTIVATION, KIND_OUTPUT):
                kind = "chip"
            else:
                kind = "ddr"
            kinds.append(kind)
            producers.append(producer.get(root, -1) if kind == "chip" else -1)
            reshaped.append(lowered.tensors[tid].shape != held.shape)
            sizes.append(held.nbytes)
        items.append(
            KernelSplit(
                request=lk.request,
                unit=lk.desc.unit,
                macs=lk.desc.macs,
                epilogue=tuple(e.out_dtype for e in lk.desc.epilogue),
                inputs=lk.desc.inputs,
                kinds=tuple(kinds),
                producers=tuple(producers),
                slots=tuple(slots),
                reshaped=tuple(reshaped),
                nbytes=tuple(sizes),
                epilogue_ops=tuple(
                    int8_step_ops(
                        e.op_type,
                        e.attrs,
                        e.out_dtype,
                        [k is not None and k >= 0 and kinds[k] == "constant" for k in e.inputs],
                    )
                    if integer_step(e.out_dtype)
                    else 0
                    for e in lk.desc.epilogue
                )
                if any(integer_step(e.out_dtype) for e in lk.desc.epilogue)
                else (),
            )
        )
    chooser = SplitChooser(items, device, int(budget * RESIDENT_SHARE), active, k_splits)
    for lk, tiles in zip(lowered.kernels, chooser.choose(), strict=True):
        lk.tiles = tiles
    ksplit.apply(
        lowered,
        {k: c.kchoice for k, c in enumerate(chooser.picked) if c.kchoice is not None},
    )
