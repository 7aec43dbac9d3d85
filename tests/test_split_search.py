"""The split chooser's caches (issue 25, compile time): transfer prices shared by alike
kernels, kept per producer cut, and each kernel's candidate times kept per choice of its
producers' cuts across the price search must pick exactly what pricing every candidate afresh
picks, at every price the search may try and in any order."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler_core import compile_model
from compiler_core.lowering import splits


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
    """Each kernel's cheapest candidate, every transfer priced again (no cache but `_held`'s
    boxes), in the chooser's arithmetic order."""
    chosen: list[splits._Candidate | None] = [None] * len(chooser.kernels)
    for k, cands in enumerate(chooser.candidates):
        ks = chooser.kernels[k]

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
