"""Scoring like a card: the runtime's per-inference host overheads (a submit's doorbell,
descriptor fetch and completion; a DMA descriptor per host buffer) are device-table
parameters that every batch pays, on top of the host link and the SoC's DDR."""

from __future__ import annotations

import dataclasses
from typing import Any

import onnx
import pytest
from onnx import TensorProto, helper

from app.console.configure import _space_body
from compiler_core.compile import compile_model
from compiler_core.configurator.scoring import host_overhead_us, score
from compiler_core.configurator.search import results
from compiler_core.configurator.space import build_space, with_cards
from compiler_core.configurator.table import render, rows_of
from compiler_core.devices import (
    MAX_CARDS_PER_HOST,
    get_device,
    link_between,
    list_devices,
    pcie_bytes_per_s,
)
from compiler_core.errors import CompileError

PRO = get_device("aic100-pro")


def metrics(device_us: float, host_us: float, *, buffers: int = 2, ddr: int = 0) -> dict[str, Any]:
    return {
        "device": PRO.name,
        "estimated_device_latency_us": device_us,
        "host_transfer_us": host_us,
        "host_buffers": buffers,
        "memory_traffic": {"total": {"ddr_read_bytes": ddr, "ddr_write_bytes": 0}},
    }


def test_every_device_states_its_host_overheads_and_host_link() -> None:
    for device in list_devices():
        assert 0 < device.dma_descriptor_s < device.inference_submit_s < 100e-6, device.name
        assert device.host_link_bytes_per_s == pcie_bytes_per_s(device.host_link_lanes)
    ultra = get_device("aic100-ultra")
    assert ultra.host_link_lanes == 2 * PRO.host_link_lanes  # x16 behind the switch, x8


def test_one_host_link_rate_a_socs_port_in_the_cost_model_and_the_link_table() -> None:
    # the rate a program's inputs land at (doorbells, host_transfer_us) is the SoC port of
    # the multi-device link table: Gen4 x8 after encoding and packet overhead, 13.5 GB/s
    for device in list_devices():
        assert device.soc_link_bytes_per_s == link_between("p2p", same_card=True).bytes_per_s
        assert device.soc_link_bytes_per_s <= device.host_link_bytes_per_s
    assert PRO.soc_link_bytes_per_s == pytest.approx(13.55e9, rel=1e-3)


def test_the_overhead_is_the_submit_plus_a_descriptor_per_host_buffer() -> None:
    two = host_overhead_us(metrics(10.0, 1.0, buffers=2), PRO)
    five = host_overhead_us(metrics(10.0, 1.0, buffers=5), PRO)
    assert two == pytest.approx((PRO.inference_submit_s + 2 * PRO.dma_descriptor_s) * 1e6)
    assert five - two == pytest.approx(3 * PRO.dma_descriptor_s * 1e6)


def test_small_batches_pay_the_per_inference_overhead_so_throughput_rises_with_batch() -> None:
    """Device time and transfers grow with the batch, the submit does not: the throughput
    rises with the batch towards the bound the device and the link set, never above it."""
    per_image_dev, per_image_host = 2.0, 0.5
    bound = 1e6 / (per_image_dev + per_image_host)
    rates = []
    for batch in (1, 2, 4, 8, 16, 64, 256):
        m = metrics(per_image_dev * batch, per_image_host * batch)
        s = score(m, instances=1, batchsize=batch, set_size=1)
        assert s.period_us == pytest.approx(batch * 2.5 + s.host_overhead_us)
        rates.append(s.throughput)
    assert all(b > a for a, b in zip(rates, rates[1:], strict=False)), rates
    assert rates[0] < bound / 2  # batch 1: the 2.5 us of work waits behind ~10 us of submit
    assert rates[-1] < bound and rates[-1] > 0.95 * bound


def test_queued_batches_hide_the_submit_unless_a_run_is_shorter_than_it() -> None:
    long_run = score(metrics(100.0, 10.0), instances=1, batchsize=1, set_size=2)
    assert long_run.period_us == pytest.approx(100.0)
    short_run = score(metrics(2.0, 0.5), instances=1, batchsize=1, set_size=2)
    assert short_run.period_us == pytest.approx(short_run.host_overhead_us)


@pytest.mark.parametrize("set_size", [1, 4])
def test_dearer_host_overheads_lower_the_score(set_size: int) -> None:
    m = metrics(3.0, 1.0, buffers=2)
    base = score(m, instances=2, batchsize=1, set_size=set_size, device=PRO)
    slow_submit = dataclasses.replace(PRO, inference_submit_s=2 * PRO.inference_submit_s)
    dearer = score(m, instances=2, batchsize=1, set_size=set_size, device=slow_submit)
    assert dearer.throughput < base.throughput and dearer.latency_us > base.latency_us
    more_buffers = score(
        metrics(3.0, 1.0, buffers=12), instances=2, batchsize=1, set_size=set_size, device=PRO
    )
    assert more_buffers.throughput < base.throughput


def _two_input_model() -> onnx.ModelProto:
    a = helper.make_tensor_value_info("a", TensorProto.FLOAT, [1, 64])
    b = helper.make_tensor_value_info("b", TensorProto.FLOAT, [1, 64])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])
    graph = helper.make_graph([helper.make_node("Add", ["a", "b"], ["y"])], "add", [a, b], [y])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_compile_report_counts_the_host_buffers_and_bytes_scoring_reads() -> None:
    result = compile_model(_two_input_model(), ["-aic-num-cores=1"])
    try:
        perf = dict(result.metrics)
    finally:
        result.cleanup()
    assert perf["host_buffers"] == 3  # two inputs, one output
    assert perf["host_bytes"] == 3 * 64 * 4
    assert perf["host_transfer_us"] == pytest.approx(
        perf["host_bytes"] / PRO.soc_link_bytes_per_s * 1e6, abs=1e-3
    )
    s = score(perf, instances=1, batchsize=1, set_size=1)
    assert s.host_overhead_us == pytest.approx(host_overhead_us(perf, PRO))


# ------------------------------------------------------------------------------ whole cards

ULTRA = get_device("aic100-ultra")


def ultra(device_us: float, host_us: float) -> dict[str, Any]:
    return {**metrics(device_us, host_us), "device": ULTRA.name}


def test_an_ultra_card_runs_the_instances_on_each_of_its_four_socs() -> None:
    m = ultra(100.0, 1.0)
    s = score(m, instances=2, batchsize=4, set_size=2)
    assert (s.instances_per_soc, s.socs, s.cards) == (2, 4, 1)
    assert s.period_us == pytest.approx(100.0)  # each SoC has its own DDR and port
    assert s.throughput == pytest.approx(4 * 2 * 4 / 100e-6)
    assert not s.card_link_bound


def test_the_socs_of_a_card_share_its_one_host_link() -> None:
    """Transfers longer than a run: the x16 host link of the card carries four SoCs' worth
    of the x8 ports' traffic, so the card runs twice one SoC's throughput, not four times."""
    m = ultra(10.0, 40.0)
    s = score(m, instances=1, batchsize=1, set_size=2)
    lanes = ULTRA.host_link_lanes
    assert s.period_us == pytest.approx(4 * 40.0 * 8 / lanes)
    assert s.card_link_bound
    one_soc_rate = 1e6 / 40.0  # a lone SoC: its own port bounds it
    assert s.throughput == pytest.approx(one_soc_rate * 4 * 8 / lanes)


def test_each_card_has_a_host_link_of_its_own() -> None:
    m = ultra(10.0, 40.0)
    one = score(m, instances=1, batchsize=1, set_size=2, cards=1)
    three = score(m, instances=1, batchsize=1, set_size=2, cards=3)
    assert (three.socs, three.cards) == (12, 3)
    assert three.period_us == pytest.approx(one.period_us)
    assert three.throughput == pytest.approx(3 * one.throughput)


def test_a_single_soc_card_is_scored_as_before_and_cards_multiply_it() -> None:
    m = metrics(50.0, 5.0)
    one = score(m, instances=4, batchsize=1, set_size=2)
    assert (one.socs, one.cards) == (1, 1) and not one.card_link_bound
    assert one.throughput == pytest.approx(4 / 50e-6)
    two = score(m, instances=4, batchsize=1, set_size=2, cards=2)
    assert two.throughput == pytest.approx(2 * one.throughput)


def test_a_partitioned_qpc_runs_once_per_group_of_socs() -> None:
    m = ultra(100.0, 1.0)
    pairs = score(m, instances=1, batchsize=1, set_size=2, socs_per_instance=2)
    assert pairs.socs == 4 and pairs.throughput == pytest.approx(2 / 100e-6)
    across = score(m, instances=1, batchsize=1, set_size=2, socs_per_instance=8, cards=2)
    assert (across.socs, across.cards) == (8, 2)
    assert across.throughput == pytest.approx(1 / 100e-6)
    with pytest.raises(CompileError, match="does not fit"):
        score(m, instances=1, batchsize=1, set_size=2, socs_per_instance=8)


def test_cards_are_a_runtime_parameter_of_the_space_checked_against_the_host() -> None:
    space = build_space(
        [{"cores": 4, "instances": 4, "cards": 1}, {"cores": 4, "instances": 4, "cards": 2},
         {"cores": 4, "instances": 4, "cards": MAX_CARDS_PER_HOST + 1},
         {"cores": 16, "devices": 8, "cards": 1}, {"cores": 16, "devices": 8, "num-cards": 2}],
        ["-aic-device=aic100-ultra"],
    )  # fmt: skip
    valid = [p.index for p in space.valid_points]
    assert valid == [0, 1, 4]
    assert space.points[0].group == space.points[1].group  # no compile of its own
    assert "a host takes at most" in space.points[2].reason
    assert "more than the 4 SoCs" in space.points[3].reason
    assert "cards=2" in space.points[1].flags()
    done = {g.index: ultra(100.0, 1.0) for g in space.groups}
    by_index = {r.point.index: r.score for r in results(space, done)}
    assert by_index[0] and by_index[1] and by_index[4]
    assert (by_index[1].socs, by_index[1].cards) == (8, 2)
    assert by_index[1].throughput == pytest.approx(2 * by_index[0].throughput)
    assert (by_index[4].socs, by_index[4].cards) == (8, 2)


def test_with_cards_fills_the_combinations_that_name_none() -> None:
    space = build_space([{"cores": 4}, {"cores": 4, "cards": 3}], ["-aic-device=aic100-ultra"])
    filled = with_cards(space, 2)
    assert [p.cards for p in filled.points] == [2, 3]
    assert filled.points[0].group == filled.points[1].group


def test_the_table_shows_socs_and_cards_when_a_row_uses_more_than_one_soc() -> None:
    space = with_cards(build_space([{"cores": 8, "instances": 2}], ["-aic-device=aic100-ultra"]), 2)
    rows = rows_of(results(space, {0: ultra(100.0, 1.0)}))
    assert (rows[0]["instances_per_soc"], rows[0]["socs"], rows[0]["cards"]) == (2, 8, 2)
    head = render(rows).splitlines()[0].split()
    assert "SoCs" in head and "cards" in head
    single = rows_of(results(build_space([{"cores": 8}]), {0: metrics(100.0, 1.0)}))
    assert "SoCs" not in render(single).splitlines()[0].split()


def test_configure_cards_reaches_a_farm_sweeps_space(tmp_path) -> None:
    csv_path = tmp_path / "s.csv"
    csv_path.write_text("# a comment\ncores,instances\n4,2\n8,1\n")
    body = _space_body(csv_path, 2)
    assert [p.cards for p in build_space_of(body).points] == [2, 2]
    yaml_path = tmp_path / "s.yaml"
    yaml_path.write_text("parameters:\n  cores: [4, 8]\n  cards: [1]\n")
    assert _space_body(yaml_path, 3)["space"]["parameters"]["cards"] == [1]  # the file's wins
    yaml_path.write_text("parameters:\n  cores: [4, 8]\n")
    assert _space_body(yaml_path, 3)["space"]["parameters"]["cards"] == [3]


def build_space_of(body: dict[str, Any]):
    from compiler_core.configurator.space import parse_csv

    return parse_csv(body["space_csv"], ["-aic-device=aic100-ultra"])


# ------------------------------------------------------------------------------ qpc validate


def _qpc(num_cores: int, ddr_bytes: int | None = None) -> bytes:
    from compiler_core.qpc import Requirements, qpc_bytes
    from tests.test_qpc_container import network_for, our_segments, relu_program

    program = relu_program(num_cores=num_cores)
    req = Requirements.from_program(program)
    if ddr_bytes is not None:
        req = dataclasses.replace(req, ddr_bytes=ddr_bytes)
    return qpc_bytes(our_segments(program, network_for(program, requirements=req)))


def test_validate_says_how_many_instances_a_card_holds_by_cores() -> None:
    from compiler_core.qpc import validate_qpc

    check = validate_qpc(_qpc(4), device="aic100-ultra").check("device-instances")
    assert check.ok
    assert "holds 16 instances: 4 per SoC (by cores 4," in check.message
    assert "x 4 SoCs" in check.message
    pro = validate_qpc(_qpc(4), device="aic100-standard").check("device-instances")
    assert "holds 3 instances: 3 per SoC" in pro.message  # 14 cores hold three 4-core copies


def test_validate_counts_the_instances_each_socs_ddr_holds() -> None:
    from compiler_core.qpc import validate_qpc

    check = validate_qpc(_qpc(1, ddr_bytes=12 << 30), device="aic100-pro").check("device-instances")
    assert check.ok and "holds 2 instances: 2 per SoC (by cores 16, by DDR 2)" in check.message
    too_big = validate_qpc(_qpc(1, ddr_bytes=40 << 30), device="aic100-pro")
    assert not too_big.check("device-instances").ok and not too_big.ok
