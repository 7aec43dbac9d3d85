"""The split chooser's caches and shortcuts (issue 25, compile time): transfer prices shared by
alike kernels, kept per producer cut, each kernel's candidate times kept per choice of its
producers' cuts across the price search, transfers priced only for cuts whose compute and
weight price can still win, and boxes cut only for the cuts the search visits (tiles built
only for those it picks), must pick exactly what pricing every candidate afresh picks, at
every price the search may try and in any order."""

from __future__ import annotations

import itertools

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler_core import compile_model
from compiler_core.lowering import splits
from compiler_core.lowering.tiling import (
    _middle_longest,
    _ranges,
    assign_cores,
    cut_tiles,
    tiles_of,
)
from compiler_core.ops.conv import conv_grid_boxes, conv_input_boxes
from compiler_core.ops.registry import NodeInfo


def _network() -> onnx.ModelProto:
    """Alike and unlike conv layers (a stride-2 one changes the shapes), then a Gemm head."""
    rng = np.random.default_rng(7)
    nodes, inits, x = [], [], "x"
    widths = [128, 128, 256, 256, 256]  # 7.6 MB of weights: more than VTCM holds at once
    for b, (stride, cout) in enumerate(zip([1, 1, 2, 1, 1], widths, strict=True)):
        cin = 64 if b == 0 else widths[b - 1]
        w = (rng.standard_normal((cout, cin, 3, 3)) * 0.02).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"w{b}"))
        nodes.append(
            helper.make_node("Conv", [x, f"w{b}"], [f"c{b}"], pads=[1] * 4, strides=[stride] * 2)
        )
        nodes.append(helper.make_node("Relu", [f"c{b}"], [f"r{b}"]))
        x = f"r{b}"
    inits.append(numpy_helper.from_array(rng.standard_normal((256, 10)).astype(np.float32), "fc"))
    nodes += [
        helper.make_node("GlobalAveragePool", [x], ["pooled"]),
        helper.make_node("Flatten", ["pooled"], ["flat"]),
        helper.make_node("Gemm", ["flat", "fc"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "convs",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64, 28, 28])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 10])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _fresh_pick(chooser: splits.SplitChooser, price: float) -> list[splits._Candidate]:
    """Each kernel's cheapest candidate, every candidate built and every transfer priced again
    (no cache but `_held`'s boxes), in the chooser's arithmetic order."""
    chosen: list[splits._Candidate | None] = [None] * len(chooser.kernels)
    for k, cands in enumerate(chooser.candidates):
        ks = chooser.kernels[k]
        for c in cands:
            if not c.built:
                chooser._ready(c)

        def cost(c: splits._Candidate, k: int = k, ks: splits.KernelSplit = ks) -> tuple:
            move = 0.0
            for i, source in chooser._moved[k]:
                producer = chosen[source] if source >= 0 else None
                transfer, descriptors = chooser._operand_move(ks, c, i, producer)
                move += transfer
                move += descriptors
            stem = chooser._stem[k] and 1 in c.parts  # a stem's tie: channels whole first
            return (c.busiest + move + min(price * c.resident, c.stream), stem, c.resident)

        chosen[k] = min(cands, key=cost)
    return [c for c in chosen if c is not None]


@pytest.mark.parametrize("cores", [4, 14])
def test_the_cached_price_search_picks_what_pricing_afresh_picks(
    cores: int, monkeypatch: pytest.MonkeyPatch, tmp_path: object
) -> None:
    seen: list[splits.SplitChooser] = []
    choose = splits.SplitChooser.choose

    def recording(self: splits.SplitChooser) -> object:
        seen.append(self)
        return choose(self)

    monkeypatch.setattr(splits.SplitChooser, "choose", recording)
    compile_model(_network(), [f"-aic-num-cores={cores}", f"-aic-binary-dir={tmp_path}"])
    assert seen
    chooser = seen[0]
    assert any(len(c) > 1 for c in chooser.candidates)  # there is a choice to make
    # the search skipped work: cuts it never built, transfers it never priced
    assert any(not c.built for cands in chooser.candidates for c in cands)
    assert any(t is None for times in chooser._times for ts in times.values() for t in ts)
    picks = set()
    # in no monotone order, caches warm; the negative prices (a reward per resident byte, which
    # the chooser never asks for) make a network this small change its cuts, and so its
    # producers' cuts, from one pick to the next
    for price in (0.0, -0.05, 1e-3, -0.5, 0.2, 0.0, -0.01, 1e6, -0.05, 0.1):
        cached, used = chooser._pick(price)
        fresh = _fresh_pick(chooser, price)
        assert [id(c) for c in cached] == [id(c) for c in fresh], price
        assert used == sum(c.resident for c in fresh if price * c.resident <= c.stream)
        picks.add(tuple(id(c) for c in cached))
    assert len(picks) > 1  # the price changes the cuts, so producers' cuts vary between picks


def _residual() -> onnx.ModelProto:
    """A conv whose residual Add and Relu fuse into it (an epilogue operand), a strided conv
    and a Gemm with a bias."""
    rng = np.random.default_rng(3)

    def weight(name: str, *shape: int) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.05).astype(np.float32), name)

    nodes = [
        helper.make_node("Conv", ["x", "w0"], ["c0"], pads=[1] * 4),
        helper.make_node("Add", ["c0", "x"], ["s0"]),
        helper.make_node("Relu", ["s0"], ["r0"]),
        helper.make_node("Conv", ["r0", "w1"], ["c1"], pads=[1] * 4, strides=[2, 2]),
        helper.make_node("GlobalAveragePool", ["c1"], ["pooled"]),
        helper.make_node("Flatten", ["pooled"], ["flat"]),
        helper.make_node("Gemm", ["flat", "fc", "bias"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "residual",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64, 28, 28])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 10])],
        [weight("w0", 64, 64, 3, 3), weight("w1", 128, 64, 3, 3), weight("fc", 128, 10)]
        + [weight("bias", 10)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("cores", [4, 14])
def test_a_cut_is_priced_on_the_boxes_and_cores_its_built_tiles_have(
    cores: int, monkeypatch: pytest.MonkeyPatch, tmp_path: object
) -> None:
    """Cuts are priced on their boxes alone (`cut_tiles`) and only the picked ones are built
    (`tiles_of`, `assign_cores`): every cut of every kernel, built, must have the boxes and
    cores it was priced on, the epilogue's operands included."""
    seen: list[splits.SplitChooser] = []
    choose = splits.SplitChooser.choose

    def recording(self: splits.SplitChooser) -> object:
        seen.append(self)
        return choose(self)

    monkeypatch.setattr(splits.SplitChooser, "choose", recording)
    compile_model(_residual(), [f"-aic-num-cores={cores}", f"-aic-binary-dir={tmp_path}"])
    chooser = seen[0]
    checked = 0
    for ks, cands in zip(chooser.kernels, chooser.candidates, strict=True):
        req = ks.request
        for c in cands:
            if c.kchoice is not None:
                continue
            first = c.key[2]
            built = assign_cores(tiles_of(req, c.parts), chooser.cores(req), first)
            priced = cut_tiles(req, c.parts, chooser.cores(req), first)
            assert priced == [(t.out_box, t.in_boxes, t.core) for t in built], c.parts
            checked += 1
    assert checked > len(chooser.kernels)
    assert any(len(ks.request.extra_shapes) for ks in chooser.kernels)  # an epilogue operand


def test_a_cut_is_probed_on_its_longest_range_nearest_the_middle() -> None:
    """`fit_tiles` probes one tile per trial cut: along every axis the longest range, of those
    the one nearest the middle (the first of two as near), as picking from every range does."""
    for size in range(0, 70):
        for parts in range(1, size + 4):
            ranges = _ranges(size, parts)
            longest = max(hi - lo for lo, hi in ranges)
            nearest = min(
                (i for i, (lo, hi) in enumerate(ranges) if hi - lo == longest),
                key=lambda i, middle=parts // 2: abs(i - middle),
            )
            assert _middle_longest(size, parts) == ranges[nearest], (size, parts)


CONVS = [
    # (input shape, weight shape, attributes, bias)
    ((2, 8, 13, 11), (12, 8, 3, 3), {"pads": [1, 1, 1, 1]}, True),
    # grouped, strided, dilated, uneven pads: channel cuts straddle groups
    ((1, 8, 17, 9), (16, 2, 3, 3), {"group": 4, "strides": [2, 2], "pads": [0, 1, 2, 1]}, False),
    ((1, 8, 17, 9), (16, 2, 3, 2), {"group": 4, "dilations": [2, 3], "pads": [2, 0, 1, 3]}, True),
    ((1, 6, 9), (6, 1, 5), {"group": 6, "pads": [2, 2]}, True),  # depthwise, 1-d
    ((1, 2, 3), (2, 2, 1), {"pads": [4, 4]}, False),  # edge tiles made only of padding
    ((1, 4, 5, 6, 7), (8, 4, 3, 1, 2), {"strides": [2, 1, 3]}, True),  # 3-d
]


@pytest.mark.parametrize(("x_shape", "w_shape", "attrs", "bias"), CONVS)
def test_a_conv_grid_cut_reads_the_boxes_each_of_its_tiles_reads(
    x_shape: tuple[int, ...], w_shape: tuple[int, ...], attrs: dict, bias: bool
) -> None:
    """`conv_grid_boxes` (the split chooser's whole-cut path) must give, tile for tile, what
    `conv_input_boxes` gives one tile: the chosen tiles and their working sets depend on it."""
    rank = len(x_shape) - 2
    pads = attrs.get("pads", [0] * 2 * rank)
    strides = attrs.get("strides", [1] * rank)
    dilations = attrs.get("dilations", [1] * rank)
    spatial = [
        (x_shape[2 + a] + pads[a] + pads[a + rank] - dilations[a] * (w_shape[2 + a] - 1) - 1)
        // strides[a]
        + 1
        for a in range(rank)
    ]
    out_shape = (x_shape[0], w_shape[0], *spatial)
    info = NodeInfo(
        op_type="Conv",
        name="conv",
        attrs=attrs,
        in_shapes=(x_shape, w_shape, (w_shape[0],) if bias else None),
        in_dtypes=("float32", "float32", "float32" if bias else None),
        out_shapes=(out_shape,),
        out_dtypes=("float32",),
    )
    cuts = [{}, {0: 2}, {1: 3}, {1: 5, 2: 2}, {a: min(d, 3 + a) for a, d in enumerate(out_shape)}]
    cuts.append({a: d for a, d in enumerate(out_shape)})  # one element per tile
    for parts in cuts:
        ranges = [_ranges(d, min(d, parts.get(a, 1))) for a, d in enumerate(out_shape)]
        grid = list(conv_grid_boxes(info, ranges))
        assert grid == [conv_input_boxes(info, box) for box in itertools.product(*ranges)], parts
