"""The configurator on an LLM: objectives on tokens/s with bounds on the time to first token
and per output token, and dimensions sweeping the KV-cache precision (fp16 / MXINT8), the
weight precision (fp16 / MXFP6) and the continuous-batching slots (`-full-batch-size`).

A small continuous-batching decoder is compiled for every combination of a space (in this
process, through the configurator's own group compile) and the search ranks them: the
tokens figures are each compile's LLM report re-derived by the scoring, and the objective
picks the combination the figures say it must.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path
from typing import Any

import onnx
import pytest

from compiler_core.configurator import build_space
from compiler_core.configurator.local import compile_group
from compiler_core.configurator.scoring import (
    OBJECTIVE_TABLE,
    OBJECTIVES,
    LlmBounds,
    Score,
    host_overhead_us,
    meets,
    parse_llm_bounds,
    parse_objective,
)
from compiler_core.configurator.search import Result, best, ranked, results
from compiler_core.configurator.space import SearchSpace
from compiler_core.devices import get_device
from compiler_core.errors import CompileError
from tests.cb_decoder_model import cb_decoder
from tests.conftest import tiny_model
from tests.service_helpers import qpcfarm_argv, service_env

CTX, PREFILL = 32, 4


def _model_and_specs(tmp: Path) -> tuple[Path, Path]:
    model = tmp / "cb.onnx"
    onnx.save(cb_decoder(ctx_len=CTX), model)
    specs = tmp / "specializations.json"
    specs.write_text(
        json.dumps(
            {
                "specializations": [
                    {"batch_size": "1", "seq_len": str(PREFILL), "ctx_len": str(CTX)},
                    {"seq_len": "1", "ctx_len": str(CTX)},
                ]
            }
        )
    )
    return model, specs


def _sweep(tmp: Path, parameters: dict[str, list[Any]]) -> tuple[SearchSpace, dict[int, Any]]:
    """Every group of the space compiled here; (space, metrics by group)."""
    model, specs = _model_and_specs(tmp)
    base = [f"-network-specialization-config={specs}", "-retained-state"]
    rows = [dict(zip(parameters, combo, strict=True)) for combo in _product(parameters)]
    space = build_space(rows, base)
    done: dict[int, Any] = {}
    for group in space.groups:
        outcome = compile_group(str(model), group.options.to_json(), str(tmp / f"g{group.index}"))
        assert "metrics" in outcome, outcome
        done[group.index] = outcome["metrics"]
    return space, done


def _score(r: Result) -> Score:
    assert r.score is not None, r.error
    return r.score


def _figure(r: Result, name: str) -> float:
    value = getattr(_score(r), name)
    assert isinstance(value, float), (name, value)
    return value


def _product(parameters: dict[str, list[Any]]) -> list[tuple[Any, ...]]:
    import itertools

    return list(itertools.product(*parameters.values()))


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory) -> tuple[SearchSpace, list[Result], dict]:
    tmp = tmp_path_factory.mktemp("llm-sweep")
    space, done = _sweep(
        tmp,
        {
            "full-batch-size": [1, 4],
            "kv_precision": ["fp16", "mxint8"],
            "weight_precision": ["fp16", "mxfp6"],
        },
    )
    return space, results(space, done), done


def test_the_tokens_figures_are_each_compiles_llm_report(swept: tuple) -> None:
    """The scoring's step is the report's decode step plus the runtime's host overhead of a
    submit, never faster (the scoring also holds a step to the DDR bandwidth its bytes need,
    as it does for any inference)."""
    space, items, done = swept
    assert len(items) == 8 and all(r.score is not None for r in items)
    for r in items:
        llm = done[r.point.group]["llm"]
        tpot, ttft = _figure(r, "tpot_ms"), _figure(r, "ttft_ms")
        each = done[r.point.group]["specializations"]
        full = next(d for d in llm["decode"] if d["batch"] == llm["full_batch"])
        step_us = each[full["specialization"]]["estimated_latency_us"]
        prefill_us = each[llm["prefill_specialization"]]["estimated_latency_us"]
        assert llm["full_batch"] == r.point.params["full-batch-size"]
        device = get_device(done[r.point.group]["device"])
        step_over = host_overhead_us(each[full["specialization"]], device)
        prefill_over = host_overhead_us(each[llm["prefill_specialization"]], device)
        assert step_over > 0  # every token's step is a submit of its own
        assert step_us - 1e-3 <= tpot * 1e3 - step_over == pytest.approx(step_us, rel=0.05)
        tokens = llm["full_batch"] * 1e3 / tpot
        assert _figure(r, "tokens_per_s") == pytest.approx(tokens, rel=1e-9)
        assert _figure(r, "decode_tokens_per_s") == pytest.approx(1e3 / tpot, rel=1e-9)
        assert prefill_us - 1e-3 <= ttft * 1e3 - prefill_over == pytest.approx(prefill_us, rel=0.05)


def test_the_precision_dimensions_set_the_vendor_flags(swept: tuple) -> None:
    space, items, done = swept
    for r in items:
        options = r.point.options
        assert options.mxint8_kv_cache == (r.point.params["kv_precision"] == "mxint8")
        assert options.mxfp6_matmul == (r.point.params["weight_precision"] == "mxfp6")
        assert options.full_batch_size == r.point.params["full-batch-size"]
        kv = done[r.point.group]["llm"]["kv_bytes_per_sequence"]
        fp16_kv = 2 * 2 * 2 * CTX * 16 * 4  # layers x (k, v) x heads x ctx x head_dim x fp32
        assert (kv < fp16_kv) == (r.point.params["kv_precision"] == "mxint8")


def test_max_tokens_per_s_picks_the_most_tokens_of_all_sequences(swept: tuple) -> None:
    _, items, _ = swept
    top = best(items, "max-tokens-per-s", None)
    assert top is not None
    assert _figure(top, "tokens_per_s") == max(_figure(r, "tokens_per_s") for r in items)
    assert top.point.params["full-batch-size"] == 4  # four sequences per step beat one
    order = [_figure(r, "tokens_per_s") for r in ranked(items, "max-tokens-per-s", None)]
    assert order == sorted(order, reverse=True)


def test_max_decode_tokens_per_s_picks_the_fastest_step_for_one_sequence(swept: tuple) -> None:
    _, items, _ = swept
    top = best(items, "max-decode-tokens-per-s", None)
    assert top is not None
    assert _figure(top, "tpot_ms") == min(_figure(r, "tpot_ms") for r in items)


def test_a_tpot_bound_keeps_the_best_tokens_per_s_within_it(swept: tuple) -> None:
    _, items, _ = swept
    steps = sorted(_figure(r, "tpot_ms") for r in items)
    bound = (steps[0] + steps[-1]) / 2
    limits = LlmBounds(max_tpot_ms=bound)
    within = [r for r in items if _figure(r, "tpot_ms") <= bound]
    over = [r for r in items if _figure(r, "tpot_ms") > bound]
    assert within and over
    top = best(items, "max-tokens-per-s", None, limits)
    assert top is not None and _figure(top, "tpot_ms") <= bound
    assert _figure(top, "tokens_per_s") == max(_figure(r, "tokens_per_s") for r in within)
    order = ranked(items, "max-tokens-per-s", None, limits)
    assert {id(r) for r in order[: len(within)]} == {id(r) for r in within}
    assert not any(meets(r.score, "max-tokens-per-s", None, limits) for r in over)


def test_a_ttft_bound_nothing_meets_leaves_no_best(swept: tuple) -> None:
    _, items, _ = swept
    tiny = min(_figure(r, "ttft_ms") for r in items) / 2
    assert best(items, "max-tokens-per-s", None, LlmBounds(max_ttft_ms=tiny)) is None
    # ranked by how far over the bound: the least over first
    order = ranked(items, "max-decode-tokens-per-s", None, LlmBounds(max_ttft_ms=tiny))
    assert _figure(order[0], "ttft_ms") == min(_figure(r, "ttft_ms") for r in items)


def test_an_llm_objective_on_a_qpc_without_a_decode_has_no_best(tmp_path: Path) -> None:
    onnx.save(tiny_model(batch="N"), tmp_path / "tiny.onnx")
    space = build_space([{"cores": 1, "batchsize": 1}])
    outcome = compile_group(
        str(tmp_path / "tiny.onnx"), space.groups[0].options.to_json(), str(tmp_path / "g")
    )
    items = results(space, {0: outcome["metrics"]})
    assert items[0].score is not None and items[0].score.tokens_per_s is None
    assert best(items, "max-tokens-per-s", None) is None
    assert best(items, "max-throughput", None) is not None


def test_bounds_must_be_positive_and_belong_to_an_llm_objective() -> None:
    assert parse_llm_bounds("max-tokens-per-s", 500.0, None) == LlmBounds(500.0, None)
    with pytest.raises(CompileError, match="max_tpot_ms bound an LLM objective"):
        parse_llm_bounds("max-throughput", None, 20.0)
    with pytest.raises(CompileError, match="max_ttft_ms must be a positive"):
        parse_llm_bounds("max-tokens-per-s", 0.0, None)
    with pytest.raises(CompileError, match="max_ttft_ms must be a positive"):
        parse_llm_bounds("max-tokens-per-s", math.inf, None)
    with pytest.raises(CompileError, match="max-tokens-per-s, max-decode-tokens-per-s"):
        parse_objective("tokens")


def test_a_precision_dimension_with_another_value_is_an_invalid_combination() -> None:
    space = build_space([{"kv_precision": "int4"}, {"weight_precision": "mxfp6"}])
    bad, good = space.points
    assert not bad.valid and "kv_precision must be fp16 or mxint8, not 'int4'" in bad.reason
    assert good.valid and good.options is not None and good.options.mxfp6_matmul


def test_the_objectives_come_from_one_table() -> None:
    from app.api.sweeps import SweepCreate
    from app.console.configure import build_parser

    assert OBJECTIVES == tuple(o.name for o in OBJECTIVE_TABLE)
    schema = SweepCreate.model_json_schema()["properties"]["objective"]
    assert schema["enum"] == list(OBJECTIVES)
    text = build_parser().format_help()
    assert all(name in text.replace("\n", " ").replace(" ", "") for name in OBJECTIVES)


def test_full_batch_size_sets_the_slots_and_the_decode_batch(tmp_path: Path) -> None:
    from compiler_core.compile import compile_model

    model, specs = _model_and_specs(tmp_path)
    flags = [f"-network-specialization-config={specs}", "-retained-state", "-full-batch-size=3"]
    result = compile_model(str(model), flags)
    try:
        shapes = {
            name: {
                t.name: t.shape for t in program.tensors if t.name in ("input_ids", "past_key.0")
            }
            for name, program in result.programs.items()
        }
    finally:
        result.cleanup()
    assert sorted(s["input_ids"] for s in shapes.values()) == [(1, PREFILL), (3, 1)]
    assert {s["past_key.0"][0] for s in shapes.values()} == {3}
    conflicting = tmp_path / "conflict.json"
    conflicting.write_text(
        json.dumps({"specializations": [{"seq_len": "1", "full_batch_size": "2"}]})
    )
    with pytest.raises(CompileError, match="full_batch_size=2: give it in one place"):
        compile_model(
            str(model), [f"-network-specialization-config={conflicting}", "-full-batch-size=3"]
        )


def test_qpcfarm_configure_ranks_an_llm_by_tokens_under_a_tpot_bound(tmp_path: Path) -> None:
    model, specs = _model_and_specs(tmp_path)
    (tmp_path / "space.yaml").write_text("parameters:\n  full-batch-size: [1, 4]\n")
    done = subprocess.run(
        qpcfarm_argv(
            "configure", f"-m={model}", "--search-space", "space.yaml", "--jobs", "1",
            "--objective", "max-tokens-per-s", "--max-tpot-ms", "1000",
            f"-network-specialization-config={specs}", "-retained-state", "--json", "all.json",
        ),
        env=service_env(), cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "tok/s" in done.stdout and "tpot_ms" in done.stdout
    summary = json.loads((tmp_path / "all.json").read_text())
    rates = [row["tokens_per_s"] for row in summary["results"]]
    assert rates == sorted(rates, reverse=True)
    assert summary["best"]["params"]["full-batch-size"] == 4
    refused = subprocess.run(
        qpcfarm_argv(
            "configure", f"-m={model}", "--search-space", "space.yaml",
            "--objective", "max-throughput", "--max-tpot-ms", "5",
        ),
        env=service_env(), cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert refused.returncode == 1
    assert "max_tpot_ms bound an LLM objective" in refused.stderr


def test_a_farm_sweep_keeps_what_the_llm_scoring_reads(swept: tuple) -> None:
    """A farm sweep stores a few numbers of each compile's report (`scoring_metrics`): the
    LLM figures scored from them are those of the whole report."""
    from app.domain.services.sweeps import scoring_metrics
    from compiler_core.configurator.search import score_point

    space, items, done = swept
    for r in items:
        kept = scoring_metrics(done[r.point.group])
        assert score_point(r.point, kept) == r.score
        assert len(json.dumps(kept)) < len(json.dumps(done[r.point.group])) / 4


def test_the_fit_check_counts_the_slots_full_batch_size_sets(tmp_path: Path) -> None:
    """The fit check reads the cache's slots where the compile does: -full-batch-size."""
    from compiler_core.fit import check_fit
    from compiler_core.options import CompileOptions

    model, specs = _model_and_specs(tmp_path)
    flags = [f"-network-specialization-config={specs}", "-retained-state"]
    reports = {
        n: check_fit(str(model), CompileOptions.from_flags([*flags, f"-full-batch-size={n}"]))
        for n in (1, 4)
    }
    assert reports[1].sequences == 1 and reports[4].sequences == 4
    assert reports[4].kv_cache_bytes == 4 * reports[1].kv_cache_bytes


def test_a_farm_sweep_ranks_an_llm_by_tokens_within_its_bounds(tmp_path: Path) -> None:
    """On an embedded farm: the API takes the LLM objective and its bounds, keeps them with
    the sweep, scores each compile's tokens from the copy of its report the sweep keeps, and
    the page shows the best's tokens."""
    import re

    import httpx

    from tests.api_helpers import zip_bytes
    from tests.service_helpers import processes
    from tests.test_sweep_service import create, start_embedded, sweep_api, wait_sweep

    model, specs = _model_and_specs(tmp_path)
    archive = zip_bytes({"cb.onnx": model.read_bytes(), "specs.json": specs.read_bytes()})
    with processes(tmp_path) as procs:
        api = start_embedded(procs, tmp_path)
        model_id = api.upload(archive, "cb.zip")["id"]
        body = {
            "model_id": model_id,
            "space": {"parameters": {"full-batch-size": [1, 4]}},
            "base_flags": ["-network-specialization-config=specs.json", "-retained-state"],
            "objective": "max-tokens-per-s",
            "max_tpot_ms": 1000.0,
        }
        sweep = wait_sweep(api, create(api, body)["id"], timeout=300)
        assert sweep["status"] == "succeeded", sweep["error"]
        assert sweep["max_tpot_ms"] == 1000.0 and sweep["max_ttft_ms"] is None
        rows = sweep["results"]
        assert all(r["tokens_per_s"] > 0 and r["tpot_ms"] <= 1000.0 for r in rows)
        assert all(r["meets_objective"] for r in rows)
        assert sweep["best"]["tokens_per_s"] == max(r["tokens_per_s"] for r in rows)
        assert sweep["best"]["params"]["full-batch-size"] == 4
        status, refused = sweep_api(
            api, "POST", "/v1/sweeps", json={**body, "objective": "min-latency"}
        )
        assert status == 422 and refused["code"] == "invalid_objective"
        with httpx.Client(base_url=api.base_url, follow_redirects=True, timeout=60) as web:
            csrf = re.search(r'name="csrf" value="([^"]+)"', web.get("/sign-in").text)
            assert csrf is not None
            form = {"api_key": api.key, "csrf": csrf.group(1), "next": f"/sweeps/{sweep['id']}"}
            page = web.post("/sign-in", data=form)
        assert 'id="sweep-best-tokens"' in page.text
        assert "time per output token ≤ 1000.0 ms" in page.text
