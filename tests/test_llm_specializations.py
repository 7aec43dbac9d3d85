"""The specializations LLM users run, on the functional runtime against ONNX Runtime.

- Scatters into retained state done in place: QEfficient's continuous-batching cache write
  (ScatterND with [slot, head, position] indices built at run time) and ScatterElements
  write only the new rows, by the program's DMA; the host moves none of the cache and the
  metrics' bytes are the runtime's DMA bytes.
- Continuous batching (`full_batch_size`): a `batch_index` input selects the cache slots a
  decode step updates; decodes of any subset of the slots, in any order, equal ONNX
  Runtime's per slot over several steps (and each slot's tokens equal that prompt's own
  greedy generation: slots do not leak into each other).
- Speculative decoding (`num_speculative_tokens` = k): a decode specialization of k + 1
  tokens; greedy verification of drafts (some wrong) generates ONNX Runtime's tokens.
- Chunked prefill: a prompt longer than the prefill length in several runs (the last one
  padded) then decode: the tokens equal ONNX Runtime's from one whole-prompt prefill.
- The vendor's specialization keys as they are, and clear errors for wrong ones.

fp32 throughout: logits within FP32_LOGITS_ATOL of ONNX Runtime's.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import pytest
from onnx import TensorProto, numpy_helper

from compiler_core.build import CompileResult
from compiler_core.compile import compile_model
from compiler_core.errors import CompileError
from compiler_core.lowering.program import (
    DmaGather,
    DmaScatter,
    DmaStore,
    Program,
    gathered_bytes,
    scattered_bytes,
)
from compiler_core.qpc.container import load_qpc
from compiler_core.runtime import Executor, QpcSession
from compiler_core.specializations import parse_specializations
from tests.cb_decoder_model import FedBack, cb_decoder, empty_cb_cache
from tests.decoder_model import (
    empty_cache,
    greedy_decode,
    kv_decoder,
    ort_runner,
    past_names,
    retained_name,
)

FP32_LOGITS_ATOL = 1e-4
LAYERS, HEADS, D_MODEL, VOCAB = 2, 2, 32, 48
HEAD_DIM = D_MODEL // HEADS
SLOTS, CB_CTX, CB_PREFILL = 4, 32, 4


def _spec_file(tmp: Path, specs: list[dict[str, int]]) -> str:
    path = tmp / "specializations.json"
    path.write_text(
        json.dumps({"specializations": [{k: str(v) for k, v in s.items()} for s in specs]})
    )
    return f"-network-specialization-config={path}"


def _cb_spec(batch: int, seq: int) -> dict[str, int]:
    return {"batch_size": batch, "seq_len": seq, "ctx_len": CB_CTX, "full_batch_size": SLOTS}


def _cb_name(batch: int, seq: int) -> str:
    return ",".join(f"{k}={v}" for k, v in _cb_spec(batch, seq).items())


# ---------------------------------------------------------------- continuous batching


@pytest.fixture(scope="module")
def cb_model() -> onnx.ModelProto:
    return cb_decoder(vocab=VOCAB, d_model=D_MODEL, heads=HEADS, layers=LAYERS, ctx_len=CB_CTX)


@pytest.fixture(scope="module")
def cb_compiled(
    cb_model: onnx.ModelProto, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[CompileResult]:
    tmp = tmp_path_factory.mktemp("cb")
    specs = [_cb_spec(1, CB_PREFILL), _cb_spec(1, 1), _cb_spec(2, 1), _cb_spec(SLOTS, 1)]
    flags = [_spec_file(tmp, specs), "-retained-state", "-aic-num-cores=2", "-aic-perf-metrics"]
    result = compile_model(cb_model.SerializeToString(), flags)
    yield result
    result.cleanup()


def _cache_stores(program: Program) -> list[DmaStore]:
    offsets = {program.tensors[i].ddr_offset for i in program.retained}
    return [
        i
        for s in program.streams
        for i in s
        if isinstance(i, DmaStore) and program.tensors[i.tensor].ddr_offset in offsets
    ]


def test_a_scatter_nd_into_the_cache_is_a_dma_of_the_batch_rows_only(
    cb_compiled: CompileResult,
) -> None:
    for name, program in cb_compiled.programs.items():
        batch, seq = (int(name.split(",")[i].split("=")[1]) for i in (0, 1))
        for i, o in program.retained.items():
            assert program.tensors[i].ddr_offset == program.tensors[o].ddr_offset
        scatters = [i for s in program.streams for i in s if isinstance(i, DmaScatter)]
        assert len(scatters) == 2 * LAYERS
        assert all(program.tensors[s.source].name != "" for s in scatters)
        rows = batch * seq * HEADS * HEAD_DIM * 4  # fp32 rows of one cache
        assert [scattered_bytes(program, s) for s in scatters] == [rows] * (2 * LAYERS)
        assert _cache_stores(program) == []


def test_cb_retained_ports_carry_no_host_bytes(cb_compiled: CompileResult) -> None:
    metrics = cb_compiled.metrics["specializations"][_cb_name(2, 1)]
    ports = {p["port"]: p for p in metrics["memory_traffic"]["per_port"]}
    retained = {n for p in past_names(LAYERS) for n in (p, retained_name(p))}
    assert {n for n, p in ports.items() if p.get("retained")} == retained
    assert all(ports[n]["host_bytes"] == 0 for n in retained)
    # input_ids, position_ids, batch_index (int64) and the logits
    assert sum(p["host_bytes"] for n, p in ports.items() if n not in retained) == (
        3 * 2 * 8 + 2 * VOCAB * 4
    )


def test_cb_metrics_bytes_equal_the_runtime_dma_bytes(cb_compiled: CompileResult) -> None:
    name = _cb_name(2, 1)
    program = cb_compiled.programs[name]
    qpc = load_qpc(str(cb_compiled.qpc_path))
    try:
        executor = Executor(program, qpc.segments["constants.bin"], 8_323_072)
        executor.run(
            {
                "input_ids": np.array([[5], [7]]),
                "position_ids": np.array([[3], [9]]),
                "batch_index": np.array([[3], [1]]),
            }
        )
    finally:
        qpc.close()
    total = cb_compiled.metrics["specializations"][name]["memory_traffic"]["total"]
    assert total["ddr_write_bytes"] == sum(t.ddr_write for t in executor.traffic)
    assert total["ddr_read_bytes"] == sum(t.ddr_read for t in executor.traffic)


PROMPTS = [
    np.array([[3, 17, 5, 40, 22, 9, 11]], np.int64),
    np.array([[8, 1, 33]], np.int64),
    np.array([[12, 44, 6, 6, 19, 2]], np.int64),
    np.array([[25, 30, 4, 13, 7]], np.int64),
]
SCHEDULE = [[0, 1, 2, 3], [2, 0], [3], [1, 3], [0, 1, 2, 3], [2], [3, 2, 1, 0], [0, 2]]
"""The slots each decode step serves, in batch order: subsets of 1, 2 and all 4 slots."""


def _prefill_cb(run: FedBack | QpcSession, slot: int, prompt: np.ndarray) -> np.ndarray:
    """The prompt in CB_PREFILL-token chunks into `slot`; the last real position's logits."""
    length = prompt.shape[1]
    last = np.zeros(0)
    for start in range(0, length, CB_PREFILL):
        ids = prompt[:, start : start + CB_PREFILL]
        real = ids.shape[1]
        pad = CB_PREFILL - real
        feeds = {
            "input_ids": np.pad(ids, ((0, 0), (0, pad))),
            "position_ids": np.arange(start, start + CB_PREFILL, dtype=np.int64)[None, :],
            "batch_index": np.array([[slot]], np.int64),
        }
        runner = run.run if isinstance(run, QpcSession) else run
        last = np.asarray(runner(feeds)["logits"])[0, real - 1]
    return last


def _serve(run: FedBack | QpcSession) -> tuple[dict[int, list[int]], list[np.ndarray]]:
    """Prefill every slot, then decode SCHEDULE; each slot's tokens and every step's logits."""
    runner = run.run if isinstance(run, QpcSession) else run
    tokens: dict[int, list[int]] = {}
    lengths: dict[int, int] = {}
    logits: list[np.ndarray] = []
    for slot, prompt in enumerate(PROMPTS):
        last = _prefill_cb(run, slot, prompt)
        logits.append(last)
        tokens[slot] = [int(np.argmax(last))]
        lengths[slot] = prompt.shape[1]
    for slots in SCHEDULE:
        feeds = {
            "input_ids": np.array([[tokens[s][-1]] for s in slots], np.int64),
            "position_ids": np.array([[lengths[s]] for s in slots], np.int64),
            "batch_index": np.array([[s] for s in slots], np.int64),
        }
        out = np.asarray(runner(feeds)["logits"])[:, -1]
        logits.append(out)
        for row, s in enumerate(slots):
            tokens[s].append(int(np.argmax(out[row])))
            lengths[s] += 1
    return tokens, logits


def test_decoding_any_subset_of_the_slots_equals_onnxruntime_per_slot(
    cb_compiled: CompileResult, cb_model: onnx.ModelProto
) -> None:
    reference = FedBack(ort_runner(cb_model), empty_cb_cache(cb_model, SLOTS))
    want_tokens, want_logits = _serve(reference)
    with QpcSession(str(cb_compiled.qpc_path)) as session:
        got_tokens, got_logits = _serve(session)
        assert session.state["past_key.0"].shape == (SLOTS, HEADS, CB_CTX, HEAD_DIM)
    assert got_tokens == want_tokens
    for got, want in zip(got_logits, want_logits, strict=True):
        np.testing.assert_allclose(got, want, atol=FP32_LOGITS_ATOL, rtol=0)
    # each slot alone (one slot, the same prompt, only its own steps) generates the same
    steps = {s: sum(s in slots for slots in SCHEDULE) for s in range(SLOTS)}
    for slot, prompt in enumerate(PROMPTS):
        alone = FedBack(ort_runner(cb_model), empty_cb_cache(cb_model, 1))
        last = _prefill_cb(alone, 0, prompt)
        mine = [int(np.argmax(last))]
        for step in range(steps[slot]):
            feeds = {
                "input_ids": np.array([[mine[-1]]]),
                "position_ids": np.array([[prompt.shape[1] + step]]),
                "batch_index": np.array([[0]]),
            }
            mine.append(int(np.argmax(alone(feeds)["logits"][0, -1])))
        assert got_tokens[slot] == mine


# ---------------------------------------------------------------- ScatterElements in place


def _scatter_elements_model(reduction: str = "none") -> onnx.ModelProto:
    """`state` [4, 6] retained; each run writes `value` [4, 1] at column `at` [4, 1] of
    every row and returns the row sums of the new state."""
    nodes = [
        oh.make_node(
            "ScatterElements",
            ["state", "at", "value"],
            ["state_RetainedState"],
            axis=1,
            reduction=reduction,
        ),
        oh.make_node("ReduceSum", ["state_RetainedState", "axes"], ["sums"], keepdims=0),
    ]
    graph = oh.make_graph(
        nodes,
        "scatter_elements_state",
        [
            oh.make_tensor_value_info("state", TensorProto.FLOAT, [4, 6]),
            oh.make_tensor_value_info("at", TensorProto.INT64, [4, 1]),
            oh.make_tensor_value_info("value", TensorProto.FLOAT, [4, 1]),
        ],
        [
            oh.make_tensor_value_info("state_RetainedState", TensorProto.FLOAT, [4, 6]),
            oh.make_tensor_value_info("sums", TensorProto.FLOAT, [4]),
        ],
        [numpy_helper.from_array(np.array([1], np.int64), "axes")],
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)])


@pytest.mark.parametrize("reduction", ["none", "add"])
def test_scatter_elements_into_retained_state_equals_onnxruntime(reduction: str) -> None:
    """Without a reduction the write is a DMA of the 4 new elements; with one (it reads the
    rows it combines with) the state is copied on the device instead; both equal ORT."""
    model = _scatter_elements_model(reduction)
    result = compile_model(model.SerializeToString(), ["-retained-state", "-aic-perf-metrics"])
    try:
        program = next(iter(result.programs.values()))
        scatters = [i for s in program.streams for i in s if isinstance(i, DmaScatter)]
        if reduction == "none":
            assert [scattered_bytes(program, s) for s in scatters] == [4 * 4]
            assert _cache_stores(program) == []
        else:
            assert scatters == []
        ports = result.metrics["memory_traffic"]["per_port"]
        assert all(p["host_bytes"] == 0 for p in ports if p.get("retained"))
        reference = FedBack(ort_runner(model), {"state": np.zeros((4, 6), np.float32)})
        rng = np.random.default_rng(3)
        with QpcSession(str(result.qpc_path)) as session:
            for _ in range(5):
                feeds: dict[str, np.ndarray] = {
                    "at": rng.integers(-6, 6, (4, 1)),
                    "value": rng.standard_normal((4, 1)).astype(np.float32),
                }
                got = session.run(feeds)["sums"]
                np.testing.assert_allclose(got, reference(feeds)["sums"], atol=1e-5)
            np.testing.assert_allclose(session.state["state"], reference.cache["state"], atol=1e-6)
    finally:
        result.cleanup()


def test_a_scatter_index_outside_the_cache_is_a_runtime_fault(cb_compiled: CompileResult) -> None:
    with QpcSession(str(cb_compiled.qpc_path)) as session:
        feeds = {
            "input_ids": np.array([[5]]),
            "position_ids": np.array([[3]]),
            "batch_index": np.array([[SLOTS]]),  # one past the last slot
        }
        with pytest.raises(CompileError, match=r"outside the cache") as caught:
            session.run(feeds)
        assert caught.value.code == "runtime_fault"


def test_an_mxint8_cache_written_by_scatter_nd_stays_in_mx_blocks(
    cb_model: onnx.ModelProto, tmp_path: Path
) -> None:
    """`-mxint8-kv-cache` with ScatterND slices spanning the last axis: whole MX rows; the
    prefill's and the decodes' logits stay within the MXINT8 tolerance of test_llm_mxint8
    (0.25) and their tokens equal ONNX Runtime's."""
    flags = [
        _spec_file(tmp_path, [_cb_spec(1, CB_PREFILL), _cb_spec(2, 1)]),
        "-retained-state",
        "-mxint8-kv-cache",
        "-aic-perf-metrics",
    ]
    result = compile_model(cb_model.SerializeToString(), flags)
    try:
        program = result.programs[_cb_name(2, 1)]
        scatters = [i for s in program.streams for i in s if isinstance(i, DmaScatter)]
        blocks = (HEAD_DIM + 31) // 32
        assert [scattered_bytes(program, s) for s in scatters] == [2 * HEADS * blocks * 33] * (
            2 * LAYERS
        )
        # the decode's slot gather reads the two slots' blocks only
        gathers = _cache_gathers(program)
        slot_blocks = HEADS * CB_CTX * blocks * 33
        read = sum(gathered_bytes(program.tensors[g.tensor], g) for g in gathers)
        assert read == 2 * slot_blocks * 2 * LAYERS
        reference = FedBack(ort_runner(cb_model), empty_cb_cache(cb_model, SLOTS))
        with QpcSession(str(result.qpc_path)) as session:
            last = {}
            for slot, prompt in ((3, PROMPTS[0]), (1, PROMPTS[1])):
                got = _prefill_cb(session, slot, prompt)
                want = _prefill_cb(reference, slot, prompt)
                np.testing.assert_allclose(got, want, atol=0.25, rtol=0)
                assert int(np.argmax(got)) == int(np.argmax(want))
                last[slot] = (int(np.argmax(got)), prompt.shape[1])
            for _ in range(4):  # decodes of both slots: the gather DMA decodes MX blocks
                feeds = {
                    "input_ids": np.array([[last[3][0]], [last[1][0]]]),
                    "position_ids": np.array([[last[3][1]], [last[1][1]]]),
                    "batch_index": np.array([[3], [1]]),
                }
                got = session.run(feeds)["logits"][:, -1]
                want = reference(feeds)["logits"][:, -1]
                np.testing.assert_allclose(got, want, atol=0.25, rtol=0)
                tokens = np.argmax(got, axis=-1)
                assert tokens.tolist() == np.argmax(want, axis=-1).tolist()
                last = {3: (int(tokens[0]), last[3][1] + 1), 1: (int(tokens[1]), last[1][1] + 1)}
    finally:
        result.cleanup()


# ---------------------------------------------------------------- speculative and chunked

CTX = 64
PREFILL, SPEC_K = 8, 3
PROMPT = np.array([[3, 17, 5, 40, 22, 9, 11, 30, 2, 14, 27, 8, 19, 33, 6, 45, 21, 12, 4, 36]])
"""20 tokens: three runs of the 8-token prefill (the last padded with 4 tokens)."""
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def model() -> onnx.ModelProto:
    return kv_decoder(vocab=VOCAB, d_model=D_MODEL, heads=HEADS, layers=LAYERS, ctx_len=CTX)


@pytest.fixture(scope="module")
def compiled(
    model: onnx.ModelProto, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[CompileResult]:
    tmp = tmp_path_factory.mktemp("spec")
    specs = [
        {"batch_size": 1, "seq_len": PREFILL, "ctx_len": CTX},
        {"batch_size": 1, "seq_len": 1, "ctx_len": CTX},
        {"batch_size": 1, "ctx_len": CTX, "num_speculative_tokens": SPEC_K},
    ]
    flags = [_spec_file(tmp, specs), "-retained-state", "-aic-num-cores=2", "-aic-perf-metrics"]
    result = compile_model(model.SerializeToString(), flags)
    yield result
    result.cleanup()


@pytest.fixture(scope="module")
def reference_tokens(model: onnx.ModelProto) -> list[int]:
    """ONNX Runtime: the whole prompt in one prefill, then greedy decode."""
    run = ort_runner(model)
    return greedy_decode(run, PROMPT, NEW_TOKENS, feed_back=True, cache=empty_cache(model)).tokens


def _chunked_prefill(run: FedBack | QpcSession) -> np.ndarray:
    runner = run.run if isinstance(run, QpcSession) else run
    length = PROMPT.shape[1]
    last = np.zeros(0)
    for start in range(0, length, PREFILL):
        ids = PROMPT[:, start : start + PREFILL]
        real = ids.shape[1]
        feeds = {
            "input_ids": np.pad(ids, ((0, 0), (0, PREFILL - real))).astype(np.int64),
            "position_ids": np.arange(start, start + PREFILL, dtype=np.int64)[None, :],
        }
        last = np.asarray(runner(feeds)["logits"])[0, real - 1]
    return last


def test_the_spec_of_k_speculative_tokens_decodes_k_plus_one(compiled: CompileResult) -> None:
    name = f"batch_size=1,ctx_len={CTX},num_speculative_tokens={SPEC_K}"
    program = compiled.programs[name]
    ids = next(t for t in program.tensors if t.name == "input_ids")
    assert ids.shape == (1, SPEC_K + 1)


def test_chunked_prefill_then_decode_equals_onnxruntime(
    compiled: CompileResult, model: onnx.ModelProto, reference_tokens: list[int]
) -> None:
    ort_chunks = FedBack(ort_runner(model), empty_cache(model))
    with QpcSession(str(compiled.qpc_path)) as session:
        last = _chunked_prefill(session)
        np.testing.assert_allclose(last, _chunked_prefill(ort_chunks), atol=FP32_LOGITS_ATOL)
        tokens = [int(np.argmax(last))]
        for position in range(PROMPT.shape[1], PROMPT.shape[1] + NEW_TOKENS - 1):
            feeds = {"input_ids": np.array([[tokens[-1]]]), "position_ids": np.array([[position]])}
            tokens.append(int(np.argmax(session.run(feeds)["logits"][0, -1])))
    assert tokens == reference_tokens


def test_speculative_decoding_with_wrong_drafts_generates_onnxruntime_tokens(
    compiled: CompileResult, model: onnx.ModelProto, reference_tokens: list[int]
) -> None:
    """Drafts are the reference continuation with every third draft wrong; greedy
    verification keeps the accepted prefix plus the target's own next token. Every
    verification run's k+1 logits equal ONNX Runtime's on the same feeds."""
    ort_steps = FedBack(ort_runner(model), empty_cache(model))
    steps = 0
    with QpcSession(str(compiled.qpc_path)) as session:
        last = _chunked_prefill(session)
        _chunked_prefill(ort_steps)
        tokens = [int(np.argmax(last))]
        position = PROMPT.shape[1]
        while len(tokens) < NEW_TOKENS:
            truth = reference_tokens[len(tokens) : len(tokens) + SPEC_K]
            truth += [0] * (SPEC_K - len(truth))
            drafts = [(t + 1) % VOCAB if (steps + i) % 3 == 2 else t for i, t in enumerate(truth)]
            feeds = {
                "input_ids": np.array([[tokens[-1], *drafts]], np.int64),
                "position_ids": np.arange(position, position + SPEC_K + 1, dtype=np.int64)[None],
            }
            got = session.run(feeds)["logits"][0]
            np.testing.assert_allclose(got, ort_steps(feeds)["logits"][0], atol=FP32_LOGITS_ATOL)
            chosen = [int(t) for t in np.argmax(got, axis=-1)]
            accepted = 0
            while accepted < SPEC_K and drafts[accepted] == chosen[accepted]:
                accepted += 1
            tokens += chosen[: accepted + 1]
            position += accepted + 1
            steps += 1
    assert tokens[:NEW_TOKENS] == reference_tokens
    assert steps < NEW_TOKENS - 1  # drafts were accepted: fewer runs than tokens


# ---------------------------------------------------------------- vendor keys


def test_the_vendor_llm_keys_are_accepted_as_they_are(
    model: onnx.ModelProto, tmp_path: Path
) -> None:
    """QEfficient's decode specialization of a target model: keys the model's inputs do not
    use (ctx_len with a static context, full_batch_exec_size, num_logits_to_keep) compile."""
    specs = [
        {"batch_size": 1, "seq_len": 4, "ctx_len": CTX, "num_logits_to_keep": 4},
        {"batch_size": 1, "seq_len": 1, "ctx_len": CTX, "full_batch_exec_size": 1},
    ]
    result = compile_model(
        model.SerializeToString(), [_spec_file(tmp_path, specs), "-retained-state"]
    )
    try:
        assert len(result.programs) == 2
    finally:
        result.cleanup()


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (
            {"batch_size": 8, "seq_len": 1, "full_batch_size": 4},
            "batch_size=8 exceeds full_batch_size=4",
        ),
        ({"seq_len": 128, "ctx_len": 64}, "seq_len=128 exceeds ctx_len=64"),
        ({"seq_len": 2, "num_logits_to_keep": 3}, "num_logits_to_keep=3 exceeds seq_len=2"),
        ({"full_batch_exec_size": 8, "full_batch_size": 4}, "full_batch_exec_size=8 exceeds"),
        ({"seq_len": 2, "num_speculative_tokens": 3}, "a decode of 4 tokens"),
    ],
)
def test_inconsistent_vendor_keys_are_refused_naming_them(
    entry: dict[str, int], message: str
) -> None:
    with pytest.raises(CompileError, match=message) as caught:
        parse_specializations({"specializations": [entry]})
    assert caught.value.code == "invalid_option"


def test_a_misspelled_key_is_refused_naming_the_accepted_ones(
    model: onnx.ModelProto, tmp_path: Path
) -> None:
    specs = [{"batch_size": 1, "seq_len": 1, "ctxlen": CTX}]
    with pytest.raises(CompileError, match=r"binds ctxlen.*LLM keys accepted as well: batch_size"):
        compile_model(model.SerializeToString(), [_spec_file(tmp_path, specs), "-retained-state"])


# ---------------------------------------------------------------- the LLM report


def _latency_s(result: CompileResult, name: str) -> float:
    return float(result.metrics["specializations"][name]["estimated_latency_us"]) / 1e6


def test_the_report_gives_tokens_per_s_for_every_decode_batch_of_the_slots(
    cb_compiled: CompileResult,
) -> None:
    llm = cb_compiled.metrics["llm"]
    assert [(d["batch"], d["slots"]) for d in llm["decode"]] == [(1, SLOTS), (2, SLOTS), (4, SLOTS)]
    for d in llm["decode"]:
        latency = _latency_s(cb_compiled, _cb_name(d["batch"], 1))
        assert d["tokens_per_s"] == pytest.approx(d["batch"] / latency, rel=1e-3)
        assert d["time_per_output_token_ms"] == pytest.approx(latency * 1e3, abs=1e-3)
    assert llm["full_batch"] == SLOTS
    assert llm["tokens_per_s_full_batch"] == llm["decode"][-1]["tokens_per_s"]
    assert llm["sequences_compiled"] == SLOTS
    assert llm["prefill_length"] == CB_PREFILL


def test_the_report_gives_the_speculative_step_and_its_break_even(
    compiled: CompileResult,
) -> None:
    llm = compiled.metrics["llm"]
    [spec] = llm["speculative"]
    step = _latency_s(compiled, f"batch_size=1,ctx_len={CTX},num_speculative_tokens={SPEC_K}")
    token = _latency_s(compiled, f"batch_size=1,seq_len=1,ctx_len={CTX}")
    assert spec["tokens_per_step"] == SPEC_K + 1
    assert spec["tokens_per_s_all_accepted"] == pytest.approx((SPEC_K + 1) / step, rel=1e-3)
    want = max(0.0, step / token - 1)  # 0: a step costs no more than one token
    assert spec["accepted_drafts_to_break_even"] == pytest.approx(want, abs=2e-3)
    # the speculative step is not taken for a prefill
    assert llm["prefill_length"] == PREFILL
    assert [d["batch"] for d in llm["decode"]] == [1]


def test_the_report_gives_chunked_prefill_ttft_up_to_the_context(compiled: CompileResult) -> None:
    llm = compiled.metrics["llm"]
    prefill = _latency_s(compiled, f"batch_size=1,seq_len={PREFILL},ctx_len={CTX}")
    chunks = llm["chunked_prefill"]
    assert [(c["prompt_length"], c["runs"]) for c in chunks] == [(16, 2), (32, 4), (64, 8)]
    for c in chunks:
        assert c["time_to_first_token_ms"] == pytest.approx(c["runs"] * prefill * 1e3, abs=1e-3)


def test_the_slot_gather_of_the_cache_is_a_gather_along_the_slot_axis(
    cb_compiled: CompileResult,
) -> None:
    """CtxGatherCB's GatherND (slot from batch_index, every head and row) is compiled as a
    Gather on axis 0, which tiles by head and row: a real cache does not fit VTCM whole."""
    for program in cb_compiled.programs.values():
        ops = [k.info.op_type for k in program.kernels]
        assert "GatherND" not in ops
        assert ops.count("ScatterND") == 2 * LAYERS


def _cache_gathers(program: Program) -> list[DmaGather]:
    offsets = {program.tensors[i].ddr_offset for i in program.retained}
    return [
        i
        for s in program.streams
        for i in s
        if isinstance(i, DmaGather) and program.tensors[i.tensor].ddr_offset in offsets
    ]


def test_a_decode_of_some_slots_reads_only_their_caches(cb_compiled: CompileResult) -> None:
    """The slot Gather is a gather DMA of the batch's slots: its bytes are batch x one slot's
    rows of every cache, not the whole cache."""
    slot_bytes = HEADS * CB_CTX * HEAD_DIM * 4
    for batch in (1, 2, SLOTS):
        program = cb_compiled.programs[_cb_name(batch, 1)]
        gathers = _cache_gathers(program)
        read = sum(gathered_bytes(program.tensors[g.tensor], g) for g in gathers)
        assert read == batch * slot_bytes * 2 * LAYERS


def test_reading_a_cache_before_its_scatter_lands_is_caught(
    cb_compiled: CompileResult, cb_model: onnx.ModelProto
) -> None:
    """The slot gather waits for the scatter of the new row: without those waits it reads
    the row not yet written and the logits differ from ONNX Runtime's."""
    import dataclasses

    from compiler_core.lowering.program import SemWait

    program = cb_compiled.programs[_cb_name(2, 1)]
    gathers = {id(g) for g in _cache_gathers(program)}
    dropped = 0
    streams = []
    for stream in program.streams:
        kept: list = []
        for instr in stream:
            while id(instr) in gathers and kept and isinstance(kept[-1], SemWait):
                kept.pop()
                dropped += 1
            kept.append(instr)
        streams.append(kept)
    assert dropped > 0
    tampered = dataclasses.replace(program, streams=streams)
    feeds = {
        "input_ids": np.array([[5], [7]]),
        "position_ids": np.array([[0], [0]]),
        "batch_index": np.array([[3], [1]]),
    }
    want = FedBack(ort_runner(cb_model), empty_cb_cache(cb_model, SLOTS))(feeds)["logits"]
    qpc = load_qpc(str(cb_compiled.qpc_path))
    try:
        constants = qpc.segments["constants.bin"]
        good = Executor(program, constants, 8_323_072).run(feeds)["logits"]
        bad = Executor(tampered, constants, 8_323_072).run(feeds)["logits"]
    finally:
        qpc.close()
    np.testing.assert_allclose(good, want, atol=FP32_LOGITS_ATOL, rtol=0)
    assert not np.allclose(bad, want, atol=1e-2)
