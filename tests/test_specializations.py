"""LLM compile options: `-network-specialization-config` (prefill and decode programs in one
QPC sharing one copy of the weights, chosen at run time by the input shapes) and
`-retained-state` (the KV cache stays on the device between runs), shown on the small
KV-cache decoder of tests/decoder_model.py against ONNX Runtime."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import pytest

from compiler_core import QpcSession, compile_model, load_qpc, run_qpc, validate_qpc
from compiler_core.errors import CompileError
from compiler_core.qpc import Segment, qpc_bytes
from compiler_core.specializations import parse_specializations
from tests.decoder_model import (
    empty_cache,
    generate_reference,
    generate_with,
    kv_decoder,
    ort_runner,
    past_names,
    retained_name,
)

PROMPT = np.array([[3, 17, 5, 40, 22, 9, 11, 30]], np.int64)
NEW_TOKENS = 8
PREFILL_DECODE = {
    "specializations": [
        {"name": "prefill", "symbols": {"batch_size": "1", "seq_len": str(PROMPT.shape[1])}},
        {"name": "decode", "symbols": {"batch_size": "1", "seq_len": "1"}},
    ]
}


@pytest.fixture(scope="module")
def decoder() -> onnx.ModelProto:
    return kv_decoder()


@pytest.fixture(scope="module")
def expected_tokens(decoder: onnx.ModelProto) -> list[int]:
    return generate_reference(decoder, PROMPT, NEW_TOKENS)


def _config(tmp_path: Path, doc: object) -> str:
    path = tmp_path / "specializations.json"
    path.write_text(json.dumps(doc))
    return str(path)


def _compile(model: onnx.ModelProto, tmp_path: Path, *flags: str, doc: object = PREFILL_DECODE):
    config = f"-network-specialization-config={_config(tmp_path, doc)}"
    return compile_model(model.SerializeToString(), [config, "-aic-num-cores=2", *flags])


# --- the config file ---------------------------------------------------------------------------


def test_both_json_forms_parse_to_named_symbol_bindings() -> None:
    plain = parse_specializations({"specializations": [{"batch_size": "1", "seq_len": 32}]})
    assert [(s.name, dict(s.symbols)) for s in plain] == [
        ("batch_size=1,seq_len=32", {"batch_size": 1, "seq_len": 32})
    ]
    named = parse_specializations(PREFILL_DECODE)
    assert [s.name for s in named] == ["prefill", "decode"]
    assert dict(named[1].symbols) == {"batch_size": 1, "seq_len": 1}


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ([], "one key"),
        ({"specializations": []}, "non-empty list"),
        ({"specializations": [{"seq_len": "0"}]}, "seq_len must be a positive integer"),
        ({"specializations": [{"seq_len": "x"}]}, "positive integer"),
        ({"specializations": [{"name": "a", "symbols": {}}]}, "symbols must be a non-empty"),
        ({"specializations": [{"name": "a", "symbols": {"s": 1}, "extra": 1}]}, "only"),
        ({"specializations": [{"seq_len": 1}, {"seq_len": "1"}]}, "repeats"),
        (
            {"specializations": [{"name": "a", "symbols": {"s": n}} for n in (1, 2)]},
            "two specializations are named 'a'",
        ),
    ],
)
def test_a_malformed_config_is_an_invalid_option_naming_the_problem(doc, message) -> None:
    with pytest.raises(CompileError, match=message) as info:
        parse_specializations(doc)
    assert info.value.code == "invalid_option"
    assert info.value.flag == "-network-specialization-config"


def test_a_config_that_is_not_json_or_missing_is_an_invalid_option(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    for path in (bad, tmp_path / "missing.json"):
        with pytest.raises(CompileError) as info:
            compile_model(
                kv_decoder().SerializeToString(), [f"-network-specialization-config={path}"]
            )
        assert info.value.code == "invalid_option"


def test_a_symbol_no_input_uses_is_an_invalid_option(decoder, tmp_path: Path) -> None:
    doc = {"specializations": [{"batch_size": "1", "seq_len": "1", "sequence": "4"}]}
    with pytest.raises(CompileError, match="binds sequence, which no input dimension") as info:
        _compile(decoder, tmp_path, doc=doc)
    assert info.value.code == "invalid_option"


# --- one QPC, several programs, one copy of the weights -------------------------------------


def test_specializations_share_one_copy_of_the_constants(decoder, tmp_path: Path) -> None:
    both = _compile(decoder, tmp_path)
    alone = compile_model(
        decoder.SerializeToString(),
        ["-onnx-define-symbol=batch_size,1", "-onnx-define-symbol=seq_len,1", "-aic-num-cores=2"],
    )
    try:
        with load_qpc(both.qpc_path) as qpc:
            names = [e.name for e in qpc.constants()]
            shared = len(qpc.segments["constants.bin"])
            assert {"program.bin", "program.1.bin", "statsdesc.1.bin"} <= set(qpc.segments)
            network = qpc.network
            assert network is not None
            assert [s.name for s in network.specializations] == ["prefill", "decode"]
            assert [s.program for s in network.specializations] == ["program.bin", "program.1.bin"]
        with load_qpc(alone.qpc_path) as qpc:
            single = len(qpc.segments["constants.bin"])
        weights = [n for n in names if n.startswith(("layer", "embed", "lm_head", "pos"))]
        assert weights and len(weights) == len(set(weights)), "a weight is stored twice"
        # The union adds only the few shape-dependent constants of the other specialization.
        assert single <= shared < 1.1 * single
        assert set(both.programs) == {"prefill", "decode"}
        assert validate_qpc(both.qpc_path, device="aic100-standard").ok
    finally:
        both.cleanup()
        alone.cleanup()


def test_the_run_picks_the_specialization_from_the_input_shapes(decoder, tmp_path: Path) -> None:
    result = _compile(decoder, tmp_path)
    ort = ort_runner(decoder)
    cache = empty_cache(decoder)
    prefill = {"input_ids": PROMPT, "position_ids": np.arange(8, dtype=np.int64)[None], **cache}
    try:
        got = run_qpc(result.qpc_path, prefill)
        want = ort(prefill)
        np.testing.assert_allclose(got["logits"], want["logits"], rtol=1e-4, atol=1e-5)
        decode = {
            "input_ids": np.array([[7]], np.int64),
            "position_ids": np.array([[8]], np.int64),
            **{name: want[retained_name(name)] for name in cache},
        }
        got = run_qpc(result.qpc_path, decode)
        np.testing.assert_allclose(got["logits"], ort(decode)["logits"], rtol=1e-4, atol=1e-5)
        with pytest.raises(CompileError, match=r"no specialization takes inputs") as info:
            run_qpc(result.qpc_path, {**prefill, "input_ids": PROMPT[:, :3]})
        assert "prefill: input_ids[1, 8]" in info.value.message
        assert "decode: input_ids[1, 1]" in info.value.message
    finally:
        result.cleanup()


def test_feeding_the_cache_back_by_hand_generates_onnx_runtimes_tokens(
    decoder, expected_tokens, tmp_path: Path
) -> None:
    result = _compile(decoder, tmp_path)
    try:
        with QpcSession(result.qpc_path) as session:
            tokens = generate_with(
                session.run, PROMPT, NEW_TOKENS, feed_back=True, cache=empty_cache(decoder)
            )
    finally:
        result.cleanup()
    assert tokens == expected_tokens


def test_two_compiles_are_byte_identical(decoder, tmp_path: Path) -> None:
    first = _compile(decoder, tmp_path)
    second = _compile(decoder, tmp_path)
    try:
        assert first.qpc == second.qpc
    finally:
        first.cleanup()
        second.cleanup()


def test_a_missing_specialization_program_fails_validation(decoder, tmp_path: Path) -> None:
    result = _compile(decoder, tmp_path)
    try:
        with load_qpc(result.qpc_path) as qpc:
            kept = [
                Segment(name, bytes(data))
                for name, data in qpc.segments.items()
                if name != "program.1.bin" and not name.endswith(".crc")
            ]
    finally:
        result.cleanup()
    report = validate_qpc(qpc_bytes(kept))
    check = report.check("program-decodes")
    assert not check.ok and "program.1.bin" in check.message


# --- retained state ---------------------------------------------------------------------------


def test_retained_state_keeps_the_cache_on_the_device_across_specializations(
    decoder, expected_tokens, tmp_path: Path
) -> None:
    result = _compile(decoder, tmp_path, "-retained-state")
    try:
        network = result.program  # the prefill program
        assert network.num_cores == 2
        with QpcSession(result.qpc_path) as session:
            assert set(session.retained) == set(past_names(2))
            tokens = generate_with(session.run, PROMPT, NEW_TOKENS, feed_back=False)
            assert tokens == expected_tokens
            # The host never sees the retained outputs; the device holds them.
            out = session.run(
                {"input_ids": np.array([[1]], np.int64), "position_ids": np.array([[15]], np.int64)}
            )
            assert set(out) == {"logits"}
            assert np.abs(session.state["past_key.0"][0, :, :16]).sum() > 0
            # A new sequence: reset() zeroes the cache and the same prompt gives the same tokens.
            session.reset()
            assert not session.state["past_key.0"].any()
            assert generate_with(session.run, PROMPT, NEW_TOKENS, feed_back=False) == tokens
    finally:
        result.cleanup()


def test_the_host_does_not_send_retained_inputs(decoder, tmp_path: Path) -> None:
    result = _compile(decoder, tmp_path, "-retained-state")
    feeds = {"input_ids": PROMPT, "position_ids": np.arange(8, dtype=np.int64)[None]}
    try:
        with pytest.raises(CompileError, match="past_key.0 is retained state") as info:
            run_qpc(result.qpc_path, {**feeds, "past_key.0": empty_cache(decoder)["past_key.0"]})
        assert info.value.code == "bad_inputs"
        with load_qpc(result.qpc_path) as qpc:
            network = qpc.network
            assert network is not None
            assert sorted(network.requirements.retained_state) == sorted(past_names(2))
    finally:
        result.cleanup()


def _add_one_model(output: str, out_shape: list[int]) -> bytes:
    graph = oh.make_graph(
        [oh.make_node("Add", ["state", "one"], [output])],
        "g",
        [oh.make_tensor_value_info("state", onnx.TensorProto.FLOAT, [2, 3])],
        [oh.make_tensor_value_info(output, onnx.TensorProto.FLOAT, out_shape)],
        initializer=[onnx.numpy_helper.from_array(np.ones((2, 3), np.float32), "one")],
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)]).SerializeToString()


def test_a_retained_output_accumulates_from_run_to_run_without_specializations() -> None:
    result = compile_model(_add_one_model("state_RetainedState", [2, 3]), ["-retained-state"])
    try:
        with QpcSession(result.qpc_path) as session:
            for _ in range(3):
                assert session.run({}) == {}
            np.testing.assert_array_equal(session.state["state"], np.full((2, 3), 3.0))
    finally:
        result.cleanup()


def test_a_retained_output_without_its_input_is_an_invalid_model() -> None:
    with pytest.raises(CompileError, match="'cache_RetainedState' has no input named 'cache'"):
        compile_model(_add_one_model("cache_RetainedState", [2, 3]), ["-retained-state"])


def test_without_retained_outputs_the_option_warns_that_it_changes_nothing() -> None:
    result = compile_model(_add_one_model("y", [2, 3]), ["-retained-state"])
    try:
        assert any(w["code"] == "retained_state_unused" for w in result.warnings)
        out = run_qpc(result.qpc_path, {"state": np.zeros((2, 3), np.float32)})
        np.testing.assert_array_equal(out["y"], np.ones((2, 3)))
    finally:
        result.cleanup()


def test_a_float16_kv_cache_from_the_custom_io_list_stays_float16_on_the_device(
    decoder, expected_tokens, tmp_path: Path
) -> None:
    """The QEfficient setup: past_* and *_RetainedState in float16 at the boundary, kept on
    the device between runs; the network computes in float32."""
    names = past_names(2)
    io_list = tmp_path / "custom_io.yaml"
    io_list.write_text(
        "".join(
            f"- IOName: {n}\n  Precision: float16\n" for p in names for n in (p, retained_name(p))
        )
    )
    result = _compile(decoder, tmp_path, "-retained-state", f"-custom-IO-list-file={io_list}")
    try:
        with QpcSession(result.qpc_path) as session:
            assert {a.dtype for a in session.state.values()} == {np.dtype(np.float16)}
            tokens = generate_with(session.run, PROMPT, NEW_TOKENS, feed_back=False)
            assert session.state["past_value.1"].dtype == np.float16
    finally:
        result.cleanup()
    assert tokens == expected_tokens


def test_inspect_lists_each_specialization_and_the_retained_state(decoder, tmp_path: Path) -> None:
    from compiler_core.qpc import inspect_qpc, render_inspect

    result = _compile(decoder, tmp_path, "-retained-state")
    try:
        summary = inspect_qpc(result.qpc_path)
    finally:
        result.cleanup()
    assert json.loads(json.dumps(summary))["specializations"][1]["name"] == "decode"
    text = render_inspect(summary)
    assert "specialization prefill (batch_size=1, seq_len=8): program.bin, input_ids[1x8]" in text
    assert "specialization decode (batch_size=1, seq_len=1): program.1.bin, input_ids[1x1]" in text
    assert "retained state: past_key.0, past_value.0, past_key.1, past_value.1" in text
