"""The tiny KV-cache decoder of tests/decoder_model.py: a valid model whose cache is right
(prefill then decode equals one long prefill on ONNX Runtime), whose greedy choices are clear,
and which our compiler compiles, with symbols bound, into QPCs that agree with ONNX Runtime.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import onnx
import pytest

from compiler_core.compile import compile_model
from compiler_core.runtime import run_qpc
from tests.decoder_model import (
    Generation,
    Runner,
    empty_cache,
    generate_reference,
    generate_with,
    greedy_decode,
    kv_decoder,
    ort_runner,
    past_names,
    retained_name,
    top2_margin,
)

PROMPT = np.array([[3, 17, 5, 40, 22, 9, 11, 30]], np.int64)
NEW_TOKENS = 10
PREFILL_LEN = PROMPT.shape[1]
LOGITS_ATOL = 1e-4
MIN_MARGIN = 0.05
"""Smallest top-1 minus top-2 logit allowed in the greedy steps: 500 times LOGITS_ATOL."""


@pytest.fixture(scope="module")
def model() -> onnx.ModelProto:
    return kv_decoder()


@pytest.fixture(scope="module")
def ort(model: onnx.ModelProto) -> Runner:
    return ort_runner(model)


@pytest.fixture(scope="module")
def generation(model: onnx.ModelProto, ort: Runner) -> Generation:
    return greedy_decode(ort, PROMPT, NEW_TOKENS, feed_back=True, cache=empty_cache(model))


def _feeds(ids: np.ndarray, start: int, cache: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    positions = start + np.arange(ids.shape[1], dtype=np.int64)
    return {
        "input_ids": ids.astype(np.int64),
        "position_ids": np.broadcast_to(positions, ids.shape).copy(),
        **cache,
    }


def _random_cache(
    model: onnx.ModelProto, batch_size: int = 1, seed: int = 7
) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        name: rng.standard_normal(value.shape).astype(np.float32)
        for name, value in empty_cache(model, batch_size).items()
    }


def test_kv_decoder_passes_full_check_with_symbolic_batch_and_seq_len(
    model: onnx.ModelProto,
) -> None:
    onnx.checker.check_model(model, full_check=True)
    layers = 2
    assert [i.name for i in model.graph.input] == [
        "input_ids",
        "position_ids",
        *past_names(layers),
    ]
    assert [o.name for o in model.graph.output] == [
        "logits",
        *(retained_name(n) for n in past_names(layers)),
    ]
    dims = {
        i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]
        for i in [*model.graph.input, *model.graph.output]
    }
    assert dims["input_ids"] == dims["position_ids"] == ["batch_size", "seq_len"]
    assert dims["past_key.1"] == dims["past_value.1_RetainedState"] == ["batch_size", 2, 24, 16]
    assert dims["logits"] == ["batch_size", "seq_len", 48]


def test_prefill_then_decode_logits_equal_one_full_sequence_prefill(
    model: onnx.ModelProto, ort: Runner, generation: Generation
) -> None:
    sequence = np.concatenate([PROMPT, [generation.tokens]], axis=1)
    full = ort(_feeds(sequence, 0, empty_cache(model)))["logits"][0]
    steps = full[PREFILL_LEN - 1 : PREFILL_LEN - 1 + NEW_TOKENS]
    np.testing.assert_allclose(generation.logits, steps, atol=LOGITS_ATOL, rtol=0)


def test_greedy_tokens_have_a_clear_margin_and_match_generate_reference(
    model: onnx.ModelProto, generation: Generation
) -> None:
    assert top2_margin(generation.logits).min() > MIN_MARGIN
    assert generate_reference(model, PROMPT, NEW_TOKENS) == generation.tokens
    assert generation.tokens == [26, 26, 12, 14, 6, 6, 6, 6, 35, 40]  # seed 0 pinned


def test_retained_state_rewrites_only_the_rows_at_position_ids(
    model: onnx.ModelProto, ort: Runner
) -> None:
    past = _random_cache(model)
    out = ort(_feeds(PROMPT[:, :3], 5, past))
    for name, before in past.items():
        after = out[retained_name(name)]
        assert after.shape == before.shape
        untouched = np.r_[0:5, 8:24]
        np.testing.assert_array_equal(after[:, :, untouched], before[:, :, untouched])
        assert not np.isclose(after[:, :, 5:8], before[:, :, 5:8]).any()


def test_queries_ignore_cache_rows_after_their_position(
    model: onnx.ModelProto, ort: Runner
) -> None:
    past = _random_cache(model)
    base = ort(_feeds(PROMPT[:, :4], 6, past))["logits"]
    changed = {name: value.copy() for name, value in past.items()}
    for value in changed.values():
        value[:, :, 10:] += 100.0
    np.testing.assert_array_equal(ort(_feeds(PROMPT[:, :4], 6, changed))["logits"], base)


def test_each_batch_row_writes_and_attends_from_its_own_start(
    model: onnx.ModelProto, ort: Runner
) -> None:
    past = _random_cache(model, batch_size=2)
    ids = PROMPT[:, :3].repeat(2, axis=0)
    positions = np.array([[0, 1, 2], [9, 10, 11]], np.int64)
    both = ort({"input_ids": ids, "position_ids": positions, **past})
    for b in range(2):
        row_past = {name: value[b : b + 1] for name, value in past.items()}
        alone = ort(_feeds(ids[b : b + 1], int(positions[b, 0]), row_past))
        for name, value in alone.items():
            np.testing.assert_allclose(both[name][b : b + 1], value, atol=1e-6, rtol=0)


def test_generate_with_no_feed_back_passes_no_cache_to_a_stateful_runner(
    model: onnx.ModelProto, ort: Runner, generation: Generation
) -> None:
    state = empty_cache(model)

    def stateful(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        assert sorted(feeds) == ["input_ids", "position_ids"]
        out = ort({**feeds, **state})
        state.update({name: out[retained_name(name)] for name in state})
        return out

    assert generate_with(stateful, PROMPT, NEW_TOKENS, feed_back=False) == generation.tokens


def test_generate_with_feed_back_needs_the_initial_cache(ort: Runner) -> None:
    with pytest.raises(ValueError, match="initial cache"):
        generate_with(ort, PROMPT, 2, feed_back=True)


@pytest.fixture(scope="module")
def compiled(model: onnx.ModelProto) -> Iterator[dict[int, str]]:
    """QPC paths by seq_len: a prefill (8) and a decode (1) specialization, batch 1, 2 cores."""
    results = {
        seq_len: compile_model(
            model.SerializeToString(),
            [
                "-onnx-define-symbol=batch_size,1",
                f"-onnx-define-symbol=seq_len,{seq_len}",
                "-aic-num-cores=2",
            ],
        )
        for seq_len in (PREFILL_LEN, 1)
    }
    yield {seq_len: str(result.qpc_path) for seq_len, result in results.items()}
    for result in results.values():
        result.cleanup()


def _assert_outputs_match(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, atol=LOGITS_ATOL, rtol=0, err_msg=name)


def test_compiled_prefill_matches_onnxruntime(
    model: onnx.ModelProto, ort: Runner, compiled: dict[int, str]
) -> None:
    feeds = _feeds(PROMPT, 0, empty_cache(model))
    _assert_outputs_match(run_qpc(compiled[PREFILL_LEN], feeds), ort(feeds))


def test_compiled_decode_with_explicit_past_matches_onnxruntime(
    model: onnx.ModelProto, ort: Runner, compiled: dict[int, str], generation: Generation
) -> None:
    prefill = ort(_feeds(PROMPT, 0, empty_cache(model)))
    past = {name: prefill[retained_name(name)] for name in past_names(2)}
    feeds = _feeds(np.array([[generation.tokens[0]]]), PREFILL_LEN, past)
    _assert_outputs_match(run_qpc(compiled[1], feeds), ort(feeds))


def test_compiled_prefill_and_decode_generate_the_reference_tokens(
    model: onnx.ModelProto, compiled: dict[int, str], generation: Generation
) -> None:
    def run(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return run_qpc(compiled[feeds["input_ids"].shape[1]], feeds)

    got = greedy_decode(run, PROMPT, NEW_TOKENS, feed_back=True, cache=empty_cache(model))
    assert got.tokens == generation.tokens
    np.testing.assert_allclose(got.logits, generation.logits, atol=LOGITS_ATOL, rtol=0)
