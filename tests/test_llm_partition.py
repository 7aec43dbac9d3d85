"""Multi-device partitioning (issue 20, item 2): a decoder sliced over a 2-device partition
(`-mdp-load-partition-config`), every device's program in one QPC, run by the functional
runtime with the links between the devices modelled.

Tolerance policy: fp32 tokens equal ONNX Runtime's over 64 greedy steps and the chosen
logits within 1e-4 (the all-reduces add the devices' partial sums in device order, a
different order from one device's, so bits may differ); fp16 (cache float16 through the
custom-IO list) tokens equal, logits within 0.1 as on one device (tests/test_llm_decode.py);
an MXINT8 cache tokens equal, logits within 0.25 (tests/test_llm_mxint8.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from compiler_core.build import CompileResult
from compiler_core.compile import compile_model
from compiler_core.devices import get_device
from compiler_core.errors import CompileError
from compiler_core.lowering.program import LinkSend, LinkWait
from compiler_core.mdp.build import dump_from_qpc
from compiler_core.mdp.config import parse_partition_config
from compiler_core.options import CompileOptions
from compiler_core.qpc.container import load_qpc
from compiler_core.qpc.inspect import inspect_qpc, render_inspect
from compiler_core.qpc.validate import render_validation, validate_qpc
from compiler_core.runtime import QpcSession
from compiler_core.runtime.executor import RuntimeFault
from tests.decoder_model import (
    Generation,
    empty_cache,
    greedy_decode,
    kv_decoder,
    ort_runner,
    past_names,
    retained_name,
)
from tests.models import sparse_matmul_header

PROMPT = np.array([[3, 17, 5, 40, 22, 9, 11, 30]], np.int64)
STEPS = 64
CTX = PROMPT.shape[1] + STEPS + 8
LAYERS, HEADS, D_MODEL = 2, 2, 32
FP32_LOGITS_ATOL = 1e-4
FP16_LOGITS_ATOL = 0.1
MXINT8_LOGITS_ATOL = 0.25
ULTRA = get_device("aic100-ultra")

TWO_DEVICES = {
    "connections": [{"devices": [0, 1], "type": "p2p"}],
    "partitions": [
        {
            "name": "Partition0",
            "devices": [{"deviceId": 0, "numCores": 2}, {"deviceId": 1, "numCores": 2}],
        }
    ],
}


@pytest.fixture(scope="module")
def model() -> onnx.ModelProto:
    return kv_decoder(layers=LAYERS, heads=HEADS, d_model=D_MODEL, ctx_len=CTX)


@pytest.fixture(scope="module")
def reference(model: onnx.ModelProto) -> Generation:
    return greedy_decode(ort_runner(model), PROMPT, STEPS, feed_back=True, cache=empty_cache(model))


def _flags(
    tmp: Path, precision: str = "fp32", config: dict | None = None, prefill: int = PROMPT.shape[1]
) -> list[str]:
    spec = tmp / "spec.json"
    spec.write_text(
        json.dumps(
            {
                "specializations": [
                    {"batch_size": "1", "seq_len": str(prefill)},
                    {"batch_size": "1", "seq_len": "1"},
                ]
            }
        )
    )
    partition = tmp / "partition.json"
    partition.write_text(json.dumps(config or TWO_DEVICES))
    flags = [
        f"-network-specialization-config={spec}",
        "-retained-state",
        f"-mdp-load-partition-config={partition}",
        "-aic-device=aic100-ultra",
        f"-aic-binary-dir={tmp / 'out'}",
        "-aic-perf-metrics",
    ]
    if precision in ("fp16", "mxint8"):
        custom = tmp / "custom_io.yaml"
        names = [n for p in past_names(LAYERS) for n in (p, retained_name(p))]
        kind = "float16" if precision == "fp16" else "mxint8"
        custom.write_text("".join(f"- IOName: {n}\n  Precision: {kind}\n" for n in names))
        flags += ["-convert-to-fp16", f"-custom-IO-list-file={custom}"]
    return flags


@pytest.fixture(scope="module")
def compiled(model: onnx.ModelProto, tmp_path_factory: pytest.TempPathFactory) -> CompileResult:
    tmp = tmp_path_factory.mktemp("mdp")
    return compile_model(model.SerializeToString(), _flags(tmp))


def _decode(qpc: Path) -> Generation:
    with QpcSession(qpc) as session:
        return greedy_decode(session.run, PROMPT, STEPS, feed_back=False)


def test_two_device_decode_equals_onnx_runtime_over_64_steps(
    compiled: CompileResult, reference: Generation
) -> None:
    got = _decode(compiled.qpc_path)
    assert got.tokens == reference.tokens
    np.testing.assert_allclose(got.logits, reference.logits, atol=FP32_LOGITS_ATOL)


def test_two_device_decode_in_fp16(
    model: onnx.ModelProto, reference: Generation, tmp_path: Path
) -> None:
    result = compile_model(model.SerializeToString(), _flags(tmp_path, "fp16"))
    got = _decode(result.qpc_path)
    assert got.tokens == reference.tokens
    np.testing.assert_allclose(got.logits, reference.logits, atol=FP16_LOGITS_ATOL)


def test_two_device_decode_with_an_mxint8_cache(tmp_path: Path) -> None:
    """head_dim 32: one MX block per cached row and head, as tests/test_llm_mxint8.py."""
    wide = kv_decoder(layers=LAYERS, heads=HEADS, d_model=64, ctx_len=CTX)
    reference = greedy_decode(
        ort_runner(wide), PROMPT, STEPS, feed_back=True, cache=empty_cache(wide)
    )
    result = compile_model(wide.SerializeToString(), _flags(tmp_path, "mxint8"))
    got = _decode(result.qpc_path)
    assert got.tokens == reference.tokens
    np.testing.assert_allclose(got.logits, reference.logits, atol=MXINT8_LOGITS_ATOL)


def test_a_prefill_exchange_larger_than_vtcm_goes_ddr_to_ddr_and_equals_onnx_runtime(
    tmp_path: Path,
) -> None:
    """A 64-token prefill under an 8 KB VTCM budget: every exchange of the prefill (the
    all-reduces' parts, the vocab-split logits) is larger than the budget, as a 1024-token
    prefill's are for a 7 B decoder. Link transfers move DDR to DDR, so it compiles, and the
    tokens equal ONNX Runtime's."""
    prefill, steps, ratio = 64, 8, 0.001
    prompt = np.random.default_rng(1).integers(0, 48, (1, prefill))
    model = kv_decoder(layers=LAYERS, heads=HEADS, d_model=D_MODEL, ctx_len=prefill + steps + 8)
    reference = greedy_decode(
        ort_runner(model), prompt, steps, feed_back=True, cache=empty_cache(model)
    )
    flags = [*_flags(tmp_path, prefill=prefill), f"-vtcm-working-set-limit-ratio={ratio}"]
    result = compile_model(model.SerializeToString(), flags)
    budget = int(ULTRA.vtcm_bytes_per_core * ratio)
    program = result.programs[f"batch_size=1,seq_len={prefill}"]
    waits = [i for s in program.streams for i in s if isinstance(i, LinkWait)]
    assert len(waits) == 2 * LAYERS + 1
    assert all(program.tensors[w.tensor].nbytes > budget for w in waits)
    with QpcSession(result.qpc_path) as session:
        got = greedy_decode(session.run, prompt, steps, feed_back=False)
    assert got.tokens == reference.tokens
    np.testing.assert_allclose(got.logits, reference.logits, atol=FP32_LOGITS_ATOL)


def test_each_device_keeps_its_heads_of_the_cache(compiled: CompileResult) -> None:
    """The cache is split by heads: each device's retained buffer is half the model's."""
    with QpcSession(compiled.qpc_path) as session:
        for device in session.devices:
            shapes = {name: array.shape for name, array in device.state.items()}
            assert shapes == {name: (1, HEADS // 2, CTX, D_MODEL // HEADS) for name in shapes}
            assert len(shapes) == 2 * LAYERS


def test_every_block_all_reduces_over_the_link_and_the_logits_are_gathered(
    compiled: CompileResult,
) -> None:
    program = compiled.programs["batch_size=1,seq_len=1"]
    waits = [i for s in program.streams for i in s if isinstance(i, LinkWait)]
    sends = [i for s in program.streams for i in s if isinstance(i, LinkSend)]
    assert len(waits) == 2 * LAYERS + 1  # attention and MLP of each block, the logits
    assert all(w.count == 2 for w in waits)
    assert sorted({s.peer for s in sends}) == [0, 1]
    assert len(sends) == 2 * len(waits)


def test_a_missing_link_wait_is_caught_by_the_runtime(compiled: CompileResult) -> None:
    with QpcSession(compiled.qpc_path) as session:
        device = session.devices[1]
        decode = next(s for s in device.specializations if s.symbols.get("seq_len") == 1)
        program = device._container.program(decode.program)
        for stream in program.streams:
            first = next((i for i, x in enumerate(stream) if isinstance(x, LinkWait)), None)
            if first is not None:
                del stream[first]
                break
        else:
            pytest.fail("no link wait in device 1's decode program")
        session.run({"input_ids": PROMPT, "position_ids": np.arange(8)[None]})
        with pytest.raises(RuntimeFault, match="before a link wait saw their transfers land"):
            session.run({"input_ids": PROMPT[:, :1], "position_ids": np.array([[8]])})


def test_a_missing_link_transfer_is_a_deadlock_naming_the_wait(compiled: CompileResult) -> None:
    with QpcSession(compiled.qpc_path) as session:
        device = session.devices[0]
        program = device._container.program(device.specializations[0].program)
        for stream in program.streams:
            sends = [i for i, x in enumerate(stream) if isinstance(x, LinkSend) and x.peer == 1]
            if sends:
                del stream[sends[0]]
                break
        with pytest.raises(
            RuntimeFault, match=r"device 1: core 0 waits for 2 link transfers into \S+ \(1 landed\)"
        ):
            session.run({"input_ids": PROMPT, "position_ids": np.arange(8)[None]})


def test_dump_writes_the_partition_the_compile_used_and_it_loads_back(
    model: onnx.ModelProto, tmp_path: Path
) -> None:
    dump = tmp_path / "dumped.json"
    flags = [*_flags(tmp_path), f"-mdp-dump-partition-config={dump}"]
    compile_model(model.SerializeToString(), flags)
    written = json.loads(dump.read_text())
    assert written == TWO_DEVICES
    again = parse_partition_config(dump.read_text(), ULTRA)
    assert again == parse_partition_config(json.dumps(TWO_DEVICES), ULTRA)
    from_qpc = tmp_path / "from_qpc.json"
    dump_from_qpc(tmp_path / "out" / "programqpc.bin", str(from_qpc))  # what submit writes
    assert json.loads(from_qpc.read_text()) == TWO_DEVICES


def test_a_single_device_compile_dumps_one_soc(model: onnx.ModelProto, tmp_path: Path) -> None:
    dump = tmp_path / "one.json"
    compile_model(
        model.SerializeToString(),
        [
            "-aic-num-cores=2",
            "-onnx-define-symbol=batch_size,1",
            "-onnx-define-symbol=seq_len,1",
            f"-mdp-dump-partition-config={dump}",
        ],
    )
    assert json.loads(dump.read_text()) == {
        "partitions": [{"name": "Partition0", "devices": [{"deviceId": 0, "numCores": 2}]}]
    }


def test_the_qpc_holds_every_devices_program_and_names_the_partition(
    compiled: CompileResult,
) -> None:
    with load_qpc(compiled.qpc_path) as qpc:
        meta = qpc.mdp
        assert meta is not None
        assert [(d["deviceId"], d["numCores"]) for d in meta["devices"]] == [(0, 2), (1, 2)]
        assert meta["link"]["kind"] == "p2p"
        for index in range(2):
            device = qpc.device(index)
            assert device.program("program.bin").meta["mdp"]["rank"] == index


def test_inspect_and_validate_name_the_devices_and_cores(compiled: CompileResult) -> None:
    summary = inspect_qpc(compiled.qpc_path)
    devices = summary["mdp"]["devices"]
    assert [(d["device_id"], d["num_cores"]) for d in devices] == [(0, 2), (1, 2)]
    text = render_inspect(summary)
    assert "Partition: 2 devices, p2p link" in text
    assert "device 1: SoC 1, 2 cores" in text
    report = validate_qpc(compiled.qpc_path, "aic100-ultra")
    assert report.ok, render_validation(report)
    checks = {c.name: c for c in report.checks}
    assert checks["partition"].message == "2 devices: SoC 0 (2 cores), SoC 1 (2 cores)"
    assert checks["device1-program-decodes"].ok
    assert checks["device-socs"].message.startswith("needs 2 SoCs (device ids 0, 1)")
    assert checks["device-instances"].message == "an AIC100 Ultra card holds 2 copies over 2 SoCs"


def test_validate_against_a_card_with_fewer_socs_says_so(compiled: CompileResult) -> None:
    report = validate_qpc(compiled.qpc_path, "aic100-standard")
    assert not report.ok
    failed = [c for c in report.checks if not c.ok]
    assert [c.name for c in failed] == ["device-socs", "device-instances"]
    assert failed[0].message == ("needs 2 SoCs (device ids 0, 1), an AIC100 Standard card has 1")


def test_validate_catches_a_device_program_of_another_rank(
    compiled: CompileResult, tmp_path: Path
) -> None:
    """Device 1's segments swapped for device 0's: the partition check names it."""
    from compiler_core.qpc.container import Segment, write_qpc

    with load_qpc(compiled.qpc_path) as qpc:
        segments = [
            Segment(
                name,
                bytes(qpc.segments[name.replace("device1/", "device0/")]),
                qpc.segment_offsets[name],
            )
            for name in qpc.segments
            if not name.endswith(".crc")
        ]
    write_qpc(tmp_path / "swapped.bin", segments)
    report = validate_qpc(tmp_path / "swapped.bin")
    partition = next(c for c in report.checks if c.name == "partition")
    assert not partition.ok
    assert partition.message == "device 1's program is not device 1 of 2 (it says 0 of 2)"


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("[1, 2]", "must hold a JSON object"),
        ('{"partitions": []}', "'partitions' must be a non-empty list"),
        ('{"partitions": [{"name": "a", "devices": []}]}', r"partitions\[0\].devices"),
        (
            '{"partitions": [{"devices": [{"deviceId": 0, "numCores": 17}]}]}',
            "numCores 17 is out of range: a AIC100 Ultra SoC has 16 cores",
        ),
        (
            '{"partitions": [{"devices": [{"deviceId": 0}, {"deviceId": 0}]}]}',
            "deviceId 0 appears twice",
        ),
        (
            '{"partitions": [{"devices": [{"deviceId": 99}]}]}',
            "deviceId 99 is not a SoC of the host",
        ),
        (
            '{"connections": [{"devices": [0, 5], "type": "p2p"}], '
            '"partitions": [{"devices": [{"deviceId": 0}, {"deviceId": 1}]}]}',
            r"names device\(s\) \[5\] that no partition uses",
        ),
        (
            '{"connections": [{"devices": [0, 1], "type": "nvlink"}], '
            '"partitions": [{"devices": [{"deviceId": 0}, {"deviceId": 1}]}]}',
            'type "nvlink" is not known',
        ),
        ('{"partitions": [{"devices": [{"deviceId": "0"}]}]}', "must be an integer"),
        ('{"partition": []}', "unknown key"),
        ("{", "not JSON"),
    ],
)
def test_partition_config_errors_name_what_is_wrong(config: str, message: str) -> None:
    with pytest.raises(CompileError, match=message) as info:
        parse_partition_config(config, ULTRA)
    assert info.value.code == "invalid_partition_config"
    assert "-mdp-load-partition-config" in info.value.message


def test_no_connection_means_traffic_through_the_host() -> None:
    config = parse_partition_config(
        '{"partitions": [{"devices": [{"deviceId": 0}, {"deviceId": 1}]}]}', ULTRA
    )
    link = config.slowest_link(ULTRA)
    assert link is not None and link.kind == "host"
    p2p = parse_partition_config(json.dumps(TWO_DEVICES), ULTRA).slowest_link(ULTRA)
    assert p2p is not None and p2p.kind == "p2p" and p2p.latency_s < link.latency_s


def test_the_farm_refuses_the_dump_option_and_takes_the_config_from_the_archive() -> None:
    from app.domain.services.farm_options import farm_options

    with pytest.raises(CompileError, match="-mdp-dump-partition-config is not accepted"):
        farm_options(flags=["-mdp-dump-partition-config=out.json"])
    options = farm_options(flags=["-mdp-load-partition-config=partition.json"])
    assert options.mdp_load_partition_config == "partition.json"
    with pytest.raises(CompileError):
        farm_options(flags=["-mdp-load-partition-config=../partition.json"])


def test_options_parse_both_flags() -> None:
    opts = CompileOptions.from_flags(["-mdp-load-partition-config=p.json"])
    assert opts.to_flags() == ["-mdp-load-partition-config=p.json"]


def test_the_fit_check_suggests_the_devices_that_make_it_fit_and_they_do(tmp_path: Path) -> None:
    """40.5 GiB of fp16 weights: one Ultra SoC (32 GiB) is too small; sliced over 2 SoCs
    each keeps 20.25 GiB."""
    from compiler_core.fit import check_fit

    k = n = 144 * 1024
    path = sparse_matmul_header(tmp_path, k, n)
    alone = check_fit(path, CompileOptions.from_flags(["-aic-device=aic100-ultra"]))
    assert not alone.fits and alone.devices == 1
    suggestion = next(s for s in alone.suggestions if s.startswith("-mdp-load-partition-config"))
    assert suggestion.startswith("-mdp-load-partition-config over 2 SoCs (one card; 21.")
    config = tmp_path / "two.json"
    config.write_text(json.dumps(TWO_DEVICES))
    options = CompileOptions.from_flags(
        ["-aic-device=aic100-ultra", f"-mdp-load-partition-config={config}"]
    )
    sliced = check_fit(path, options)
    assert sliced.fits and sliced.devices == 2
    assert sliced.weights_bytes == k * n  # half of k * n * 2 bytes
    standard = check_fit(path, CompileOptions.from_flags(["-aic-device=aic100-standard"]))
    assert any(
        s.startswith("-mdp-load-partition-config over 3 SoCs (3 AIC100 Standard cards")
        for s in standard.suggestions
    ), standard.suggestions


def test_the_kv_cache_is_counted_per_soc_when_sliced(
    model: onnx.ModelProto, tmp_path: Path
) -> None:
    from compiler_core.fit import check_fit

    config = tmp_path / "two.json"
    config.write_text(json.dumps(TWO_DEVICES))
    flags = ["-retained-state", "-onnx-define-symbol=batch_size,1", "-onnx-define-symbol=seq_len,1"]
    one = check_fit(model.SerializeToString(), CompileOptions.from_flags(flags))
    two = check_fit(
        model.SerializeToString(),
        CompileOptions.from_flags([*flags, f"-mdp-load-partition-config={config}"]),
    )
    assert two.kv_cache_bytes * 2 == one.kv_cache_bytes
    assert two.weights_bytes < one.weights_bytes


def test_a_kernel_with_weights_right_after_an_exchange_equals_onnx_runtime(tmp_path: Path) -> None:
    """LayerNorm over a split axis needs the whole row: an all-gather, then a kernel whose
    weights load while the parts travel (they are hoisted to the exchange)."""
    from onnx import TensorProto, numpy_helper
    from onnx import helper as oh

    rng = np.random.default_rng(1)
    inits = [
        numpy_helper.from_array(rng.standard_normal((32, 64)).astype(np.float32), "w"),
        numpy_helper.from_array(rng.standard_normal(64).astype(np.float32), "scale"),
        numpy_helper.from_array(rng.standard_normal(64).astype(np.float32), "bias"),
    ]
    graph = oh.make_graph(
        [
            oh.make_node("MatMul", ["x", "w"], ["h"]),
            oh.make_node("LayerNormalization", ["h", "scale", "bias"], ["y"], axis=-1),
        ],
        "gathered",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 32])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 64])],
        inits,
    )
    small = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    partition = tmp_path / "partition.json"
    partition.write_text(json.dumps(TWO_DEVICES))
    result = compile_model(
        small.SerializeToString(),
        [f"-mdp-load-partition-config={partition}", f"-aic-binary-dir={tmp_path / 'out'}"],
    )
    x = rng.standard_normal((1, 8, 32)).astype(np.float32)
    with QpcSession(result.qpc_path) as session:
        got = session.run({"x": x})["y"]
    expected = ort_runner(small)({"x": x})["y"]
    np.testing.assert_allclose(got, expected, atol=1e-5)


def test_mdp_devices_is_a_partition_over_the_first_socs(
    model: onnx.ModelProto, tmp_path: Path
) -> None:
    """`-mdp-devices=2` compiles what a config listing SoCs 0 and 1 (p2p) compiles."""
    flags = [f for f in _flags(tmp_path) if not f.startswith("-mdp-load-partition-config")]
    result = compile_model(model.SerializeToString(), [*flags, "-mdp-devices=2"])
    with load_qpc(result.qpc_path) as qpc:
        meta = qpc.mdp
        assert meta is not None
        assert meta["partition"]["partitions"][0]["devices"] == [
            {"deviceId": 0, "numCores": 1},
            {"deviceId": 1, "numCores": 1},
        ]
    with pytest.raises(CompileError, match="not both"):
        CompileOptions.from_flags(["-mdp-devices=2", "-mdp-load-partition-config=p.json"])
    with pytest.raises(CompileError, match="at most 32 AIC100 Ultra SoCs"):
        CompileOptions.from_flags(["-aic-device=aic100-ultra", "-mdp-devices=33"])


def test_the_configurator_sweeps_the_number_of_devices(
    model: onnx.ModelProto, tmp_path: Path
) -> None:
    """A devices dimension: each point a compile over that many SoCs, scored in tokens/s."""
    from compiler_core.configurator.local import run_local
    from compiler_core.configurator.space import parse_mapping

    path = tmp_path / "decoder.onnx"
    path.write_bytes(model.SerializeToString())
    base = [
        f for f in _flags(tmp_path)
        if not f.startswith(("-mdp-load-partition-config", "-aic-binary-dir"))
    ]  # fmt: skip
    space = parse_mapping({"parameters": {"devices": [1, 2], "cores": [2]}}, base)
    assert len(space.groups) == 2
    assert "-mdp-devices=2" not in space.valid_points[0].flags()
    assert "-mdp-devices=2" in space.valid_points[1].flags()
    sweep = run_local(path, space, objective="max-decode-tokens-per-s")
    assert sweep.failed == 0 and sweep.compiles == 2
    by_devices = {r.point.params["devices"]: r for r in sweep.ranked}
    for devices in (1, 2):
        score = by_devices[devices].score
        assert score is not None and score.decode_tokens_per_s is not None
        assert score.decode_tokens_per_s > 0


def test_each_exchange_is_charged_from_the_link_table(
    model: onnx.ModelProto, compiled: CompileResult, tmp_path: Path
) -> None:
    """Without a p2p connection the parts are relayed through the host (10 us instead of
    2 us each way, at the same bytes): the decode step waits longer for its 5 exchanges."""
    from compiler_core.devices import HOST_RELAY_LATENCY_S, P2P_LATENCY_S

    through_host = {"partitions": TWO_DEVICES["partitions"]}
    relayed = compile_model(model.SerializeToString(), _flags(tmp_path, config=through_host))
    decode = "batch_size=1,seq_len=1"
    p2p_metrics = compiled.metrics["specializations"][decode]
    host_metrics = relayed.metrics["specializations"][decode]
    assert compiled.metrics["mdp"]["link"]["kind"] == "p2p"
    assert relayed.metrics["mdp"]["link"]["kind"] == "host"
    slower_us = host_metrics["estimated_latency_us"] - p2p_metrics["estimated_latency_us"]
    expected_us = (2 * LAYERS + 1) * (HOST_RELAY_LATENCY_S - P2P_LATENCY_S) * 1e6
    assert 0.5 * expected_us <= slower_us <= 1.5 * expected_us
    assert compiled.metrics["mdp"]["link_bytes_per_device"] > 0


def test_weights_in_an_external_file_are_sliced_as_written(tmp_path: Path) -> None:
    """A model whose weights are external data (d_model 128: its MatMul weights are over the
    importer's 64 KiB read-at-once size, so they stay mapped): each device's blocks are read
    from the file when wanted, and the tokens are ONNX Runtime's."""
    wide = kv_decoder(layers=1, heads=HEADS, d_model=128, ctx_len=CTX)
    reference = greedy_decode(
        ort_runner(wide), PROMPT, STEPS, feed_back=True, cache=empty_cache(wide)
    )
    folder = tmp_path / "model"
    folder.mkdir()
    path = folder / "decoder.onnx"
    onnx.save(wide, path, save_as_external_data=True, location="weights.data", size_threshold=0)
    result = compile_model(str(path), _flags(tmp_path))
    got = _decode(result.qpc_path)
    assert got.tokens == reference.tokens
    np.testing.assert_allclose(got.logits, reference.logits, atol=FP32_LOGITS_ATOL)


@pytest.mark.parametrize(
    ("heads", "d_model", "devices", "cache_heads"),
    [(3, 48, 2, 3), (4, 64, 4, 1)],
    ids=["3-heads-on-2-devices-keep-the-cache-whole", "4-heads-on-4-devices"],
)
def test_heads_the_devices_do_not_divide_stay_whole_and_still_match(
    tmp_path: Path, heads: int, d_model: int, devices: int, cache_heads: int
) -> None:
    """3 heads over 2 devices: the attention runs whole on each (its inputs gathered), the
    MLP is still sliced; the devices' programs then differ in their constants (a slice's
    start), so transfers find their tensor by name. 4 over 4: one head each."""
    small = kv_decoder(layers=2, heads=heads, d_model=d_model, ctx_len=40)
    reference = greedy_decode(
        ort_runner(small), PROMPT, 16, feed_back=True, cache=empty_cache(small)
    )
    flags = [f for f in _flags(tmp_path) if not f.startswith("-mdp-load-partition-config")]
    result = compile_model(small.SerializeToString(), [*flags, f"-mdp-devices={devices}"])
    with QpcSession(result.qpc_path) as session:
        got = greedy_decode(session.run, PROMPT, 16, feed_back=False)
        cache = next(iter(session.devices[devices - 1].state.values()))
    assert got.tokens == reference.tokens
    np.testing.assert_allclose(got.logits, reference.logits, atol=FP32_LOGITS_ATOL)
    assert cache.shape[1] == cache_heads


def test_the_submit_time_fit_check_reads_the_partition_from_the_archive(
    model: onnx.ModelProto,
) -> None:
    """The farm checks the fit at submit from the upload: the partition file travels in the
    model's archive and the figures are per SoC of it."""
    import io

    from compiler_core.fit import check_upload_fit
    from tests.api_helpers import zip_bytes

    upload = zip_bytes(
        {
            "decoder.onnx": model.SerializeToString(),
            "partition.json": json.dumps(TWO_DEVICES).encode(),
        }
    )
    flags = ["-retained-state", "-onnx-define-symbol=batch_size,1", "-onnx-define-symbol=seq_len,1"]
    one = check_upload_fit(io.BytesIO(upload), CompileOptions.from_flags(flags))
    two = check_upload_fit(
        io.BytesIO(upload),
        CompileOptions.from_flags([*flags, "-mdp-load-partition-config=partition.json"]),
    )
    assert one is not None and two is not None
    assert (one.devices, two.devices) == (1, 2)
    assert two.kv_cache_bytes * 2 == one.kv_cache_bytes


def _stages(*parts: list[int], cores: int = 2) -> dict:
    return {
        "connections": [{"devices": [d for p in parts for d in p], "type": "p2p"}],
        "partitions": [
            {"name": f"Stage{i}", "devices": [{"deviceId": d, "numCores": cores} for d in p]}
            for i, p in enumerate(parts)
        ],
    }


@pytest.mark.parametrize(
    "parts", [([0], [1]), ([0, 1], [2, 3])], ids=["2-stages", "2-stages-of-2-devices"]
)
def test_pipeline_stages_decode_equals_onnx_runtime(
    model: onnx.ModelProto, reference: Generation, tmp_path: Path, parts: tuple[list[int], ...]
) -> None:
    """Several partitions are pipeline stages: each runs its layers (its own devices slicing
    them), the stage before sends the hidden state, mask and write index to the next."""
    result = compile_model(model.SerializeToString(), _flags(tmp_path, config=_stages(*parts)))
    got = _decode(result.qpc_path)
    assert got.tokens == reference.tokens
    np.testing.assert_allclose(got.logits, reference.logits, atol=FP32_LOGITS_ATOL)
    with QpcSession(result.qpc_path) as session:
        caches = [set(d.state) for d in session.devices]
    first, last = caches[0], caches[-1]
    assert first and last and not first & last  # each stage keeps its own layers' caches
    assert first | last == set(past_names(LAYERS))


def test_a_stage_that_reads_its_inputs_before_they_land_is_caught(
    model: onnx.ModelProto, tmp_path: Path
) -> None:
    result = compile_model(model.SerializeToString(), _flags(tmp_path, config=_stages([0], [1])))
    with QpcSession(result.qpc_path) as session:
        device = session.devices[1]
        program = device._container.program(device.specializations[0].program)
        assert isinstance(program.streams[0][0], LinkWait)
        del program.streams[0][0]
        with pytest.raises(RuntimeFault, match="before a link wait saw their transfers land"):
            session.run({"input_ids": PROMPT, "position_ids": np.arange(8)[None]})


def test_a_pipeline_step_is_its_stages_one_after_another(
    model: onnx.ModelProto, tmp_path: Path
) -> None:
    from compiler_core.devices import P2P_LATENCY_S

    result = compile_model(model.SerializeToString(), _flags(tmp_path, config=_stages([0], [1])))
    metrics = result.metrics
    decode = "batch_size=1,seq_len=1"
    stages = metrics["pipeline_stage_latency_us"][decode]
    assert len(stages) == 2 and all(s > 0 for s in stages)
    total = metrics["specializations"][decode]["estimated_latency_us"]
    assert total == pytest.approx(sum(stages) + P2P_LATENCY_S * 1e6, abs=1e-3)
    tokens = next(d for d in metrics["llm"]["decode"] if d["specialization"] == decode)
    assert tokens["tokens_per_s"] == pytest.approx(1e6 / total, rel=1e-3)
    with load_qpc(result.qpc_path) as qpc:
        meta = qpc.mdp
        assert meta is not None
        assert [d["stage"] for d in meta["devices"]] == [0, 1]
        assert meta["devices"][1]["receives"]  # what stage 0 sends it
    assert validate_qpc(result.qpc_path, "aic100-ultra").ok
