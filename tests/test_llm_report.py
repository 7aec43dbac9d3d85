"""The LLM report: a QPC with prefill and decode specializations and its KV cache as retained
state gets, in its perf metrics (`llm`), the time to first token of the prefill length, decode
tokens/s per decode batch and at full batch, the KV bytes per sequence and how many sequences
fit the DDR: derived from each specialization's own estimate, printed by `qpcfarm compile
-aic-perf-metrics`, in the API's report and on the job page."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from compiler_core.build import CompileResult
from compiler_core.cli import main
from compiler_core.compile import compile_model
from compiler_core.devices import get_device
from tests.decoder_model import kv_decoder

PREFILL, DECODE = "batch_size=1,seq_len=8", "batch_size=1,seq_len=1"


def _spec(tmp: Path) -> Path:
    path = tmp / "spec.json"
    path.write_text(
        json.dumps(
            {
                "specializations": [
                    {"batch_size": "1", "seq_len": "8"},
                    {"batch_size": "1", "seq_len": "1"},
                    {"batch_size": "1", "num_speculative_tokens": "3"},
                ]
            }
        )
    )
    return path


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CompileResult]:
    tmp = tmp_path_factory.mktemp("llm")
    flags = [f"-network-specialization-config={_spec(tmp)}", "-retained-state", "-aic-num-cores=2"]
    compiled = compile_model(kv_decoder(ctx_len=40).SerializeToString(), flags)
    yield compiled
    compiled.cleanup()


def test_ttft_and_decode_rates_come_from_each_specializations_estimate(
    result: CompileResult,
) -> None:
    metrics = result.metrics
    llm = metrics["llm"]
    each = metrics["specializations"]
    assert llm["prefill_length"] == 8
    assert llm["time_to_first_token_ms"] == pytest.approx(
        each[PREFILL]["estimated_latency_us"] / 1e3, abs=1e-3
    )
    [decode] = llm["decode"]
    latency_s = each[DECODE]["estimated_latency_us"] / 1e6
    assert decode["batch"] == 1
    assert decode["tokens_per_s"] == pytest.approx(1 / latency_s, rel=1e-3)
    assert llm["tokens_per_s_full_batch"] == decode["tokens_per_s"]


def test_kv_bytes_per_sequence_and_the_sequences_the_ddr_holds(result: CompileResult) -> None:
    llm: dict[str, Any] = result.metrics["llm"]
    program = result.programs[DECODE]
    kv = sum(program.tensors[i].nbytes for i in program.retained)
    assert kv == 2 * 2 * 2 * 40 * 16 * 4  # layers x (key, value) x heads x ctx x head_dim x fp32
    assert llm["kv_bytes_per_sequence"] == kv
    ddr = get_device("aic100-pro").ddr_bytes_per_soc
    others = max(p.ddr_size for p in result.programs.values()) - kv
    assert llm["sequences_fit"] == (ddr - others) // kv


def test_a_qpc_without_retained_state_has_no_llm_section(tmp_path: Path) -> None:
    flags = ["-onnx-define-symbol=batch_size,1", "-onnx-define-symbol=seq_len,1"]
    plain = compile_model(kv_decoder(ctx_len=40).SerializeToString(), flags)
    try:
        assert "llm" not in plain.metrics
    finally:
        plain.cleanup()


def test_qpcfarm_compile_prints_the_llm_figures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "decoder.onnx"
    model.write_bytes(kv_decoder(ctx_len=40).SerializeToString())
    flags = [
        f"-m={model}",
        f"-aic-binary-dir={tmp_path / 'out'}",
        f"-network-specialization-config={_spec(tmp_path)}",
        "-retained-state",
        "-aic-perf-metrics",
    ]
    assert main(["compile", *flags]) == 0
    out = capsys.readouterr().out
    for label in (
        "llm:",
        "time_to_first_token_ms",
        "tokens_per_s",
        "kv_bytes_per_sequence",
        "chunked_prefill",
        "tokens_per_s_all_accepted",
    ):
        assert label in out
    assert "sequences_fit" in out


def test_the_job_page_shows_the_llm_figures(tmp_path: Path) -> None:
    import re

    from fastapi.testclient import TestClient

    from app.console.serve import create_farm_app
    from app.domain.settings import Settings
    from tests.api_helpers import zip_bytes
    from tests.test_web_pages import Site, new_key, signed_in, submit, wait_done

    settings = Settings(
        data_dir=tmp_path,
        database_url=f"sqlite:///{tmp_path / 'qpcfarm.db'}",
        broker_url=None,
        blob_store="filesystem",
        require_auth=True,
    )
    app = create_farm_app(settings)
    specs = {
        "specializations": [
            {"batch_size": "1", "seq_len": "8"},
            {"batch_size": "1", "seq_len": "1"},
            {"batch_size": "1", "num_speculative_tokens": "3"},
        ]
    }
    archive = zip_bytes(
        {
            "decoder.onnx": kv_decoder(ctx_len=40, seed=3).SerializeToString(),
            "specs.json": json.dumps(specs).encode(),
        }
    )
    with TestClient(app, base_url="http://localhost", follow_redirects=False) as client:
        site = Site(client, app, new_key(app, "alpha"), new_key(app, "beta"))
        csrf = signed_in(site)
        flags = "-network-specialization-config=specs.json -retained-state -aic-num-cores=2"
        answer = submit(site, csrf, archive, name="decoder.zip", flags=flags)
        assert answer.status_code == 303, answer.text
        job_id = answer.headers["location"].split("submitted=")[1]
        wait_done(site, job_id)
        page = client.get(f"/jobs/{job_id}").text
    assert 'id="llm"' in page
    ttft = re.search(r'id="llm-ttft">([\d.]+) ms \(8-token prompt\)', page)
    assert ttft is not None and float(ttft.group(1)) > 0
    assert re.search(r'class="llm-decode">[\d.]+ tokens/s', page)
    assert re.search(r"4 tokens per step</dt><dd class=\"llm-speculative\">[\d.]+ tokens/s", page)
    assert re.search(r'16-token prompt</dt><dd class="llm-chunked">[\d.]+ ms \(2 prefill', page)
    assert 'id="llm-fit"' in page
