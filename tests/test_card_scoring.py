"""Scoring like a card: the runtime's per-inference host overheads (a submit's doorbell,
descriptor fetch and completion; a DMA descriptor per host buffer) are device-table
parameters that every batch pays, on top of the host link and the SoC's DDR."""

from __future__ import annotations

import dataclasses
from typing import Any

import onnx
import pytest
from onnx import TensorProto, helper

from compiler_core.compile import compile_model
from compiler_core.configurator.scoring import host_overhead_us, score
from compiler_core.cost_rates import HOST_LINK_BYTES_PER_S
from compiler_core.devices import get_device, list_devices, pcie_bytes_per_s

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
        perf["host_bytes"] / HOST_LINK_BYTES_PER_S * 1e6, abs=1e-3
    )
    s = score(perf, instances=1, batchsize=1, set_size=1)
    assert s.host_overhead_us == pytest.approx(host_overhead_us(perf, PRO))
