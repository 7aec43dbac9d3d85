"""Comparing two compiles (`GET /v1/compare`, the `/compare` page, `qpcfarm compare A B`):
metrics side by side with the ratio B/A and a change bucket, warnings added and removed,
pass times, and a failed job against a passed one ("failed -> passed").

The bucket rule is checked on figures given here; the service is checked on real compiles
of one model at 1 and 4 cores, whose report figures differ by the core count the compiler
was asked for (`num_cores` 1 -> 4 is a 4x change: bucket 2x, the largest reached)."""

from __future__ import annotations

import random
import re
import uuid
from typing import Any

import httpx
import pytest

from app.console.compare import compare_command
from app.domain.compilers import DEFAULT
from app.domain.services import compilers
from app.domain.services.compare import Side, bucket_of, compare_sides
from compiler_core.profiling.opstats import OPSTATS_LEVEL
from tests.api_helpers import LiveServer, Servers, form_csrf, web_client
from tests.conftest import tiny_model, tiny_model_bytes
from worker import compile_jobs

# ------------------------------------------------------------------------------ the rule


@pytest.mark.parametrize(
    ("a", "b", "bucket", "direction"),
    [
        (100.0, 100.0, "same", "same"),
        (100.0, 109.0, "same", "up"),
        (100.0, 110.0, "1.1x", "up"),
        (100.0, 125.0, "1.2x", "up"),
        (100.0, 150.0, "1.5x", "up"),
        (100.0, 50.0, "2x", "down"),  # factor either way
        (100.0, 499.0, "2x", "up"),
        (100.0, 500.0, "5x", "up"),
        (100.0, 10.0, "10x", "down"),
        (100.0, 1.0, "10x", "down"),
        (0.0, 3.0, "10x", "up"),  # from nothing: off the scale, no ratio
    ],
)
def test_the_change_bucket_is_the_largest_factor_either_way_reached(
    a: float, b: float, bucket: str, direction: str
) -> None:
    ratio, got, way = bucket_of(a, b)
    assert (got, way) == (bucket, direction)
    assert ratio == (None if a == 0 else b / a)


def side(status: str = "passed", **fields: Any) -> Side:
    return Side(ref=uuid.uuid4(), kind="qpc", status=status, **fields)


def test_nested_figures_are_dotted_lists_are_left_out_and_one_sided_figures_are_marked() -> None:
    a = side(metrics={"x": 2, "t": {"ddr": 10}, "per_core": [{"y": 1}], "flag": True, "gone": 1})
    b = side(metrics={"x": 4, "t": {"ddr": 10}, "per_core": [{"y": 9}], "flag": False, "new": 5})

    rows = {r["name"]: r for r in compare_sides(a, b)["metrics"]}

    assert set(rows) == {"x", "t.ddr", "gone", "new"}
    assert rows["x"]["ratio"] == 2.0 and rows["x"]["bucket"] == "2x"
    assert rows["t.ddr"]["bucket"] == "same"
    assert rows["gone"]["bucket"] == "removed" and rows["gone"]["b"] is None
    assert rows["new"]["bucket"] == "added" and rows["new"]["ratio"] is None


def test_warnings_are_told_apart_by_code_and_nodes_not_by_the_figures_in_the_message() -> None:
    kept_a = {"code": "spill", "message": "spills 10 MB", "nodes": ["conv1"]}
    kept_b = {"code": "spill", "message": "spills 12 MB", "nodes": ["conv1"]}
    fixed = {"code": "fp32_kernels", "message": "2 fp32 kernels", "nodes": ["mm"]}
    new = {"code": "spill", "message": "spills 1 MB", "nodes": ["conv2"]}

    diff = compare_sides(side(warnings=[kept_a, fixed]), side(warnings=[kept_b, new]))

    assert diff["warnings_added"] == [new]
    assert diff["warnings_removed"] == [fixed]


def test_a_failed_side_compares_as_failed_to_passed_with_every_figure_added() -> None:
    failed = side("failed", error={"code": "dynamic_shape", "message": "m"})

    diff = compare_sides(failed, side(metrics={"x": 1.0}, pass_times={"lower": 0.5}))

    assert diff["status"] == "failed -> passed"
    assert diff["a"]["error"]["code"] == "dynamic_shape"
    assert [r["bucket"] for r in diff["metrics"]] == ["added"]
    assert diff["pass_times"][0]["name"] == "lower" and diff["pass_times"][0]["a"] is None


# --------------------------------------------------------------------------- over HTTP


def _upload(client: httpx.Client, data: bytes) -> str:
    answer = client.post("/v1/models", files={"file": ("m.onnx", data)})
    assert answer.status_code == 201, answer.text
    return str(answer.json()["id"])


def _job(server: LiveServer, client: httpx.Client, model_id: str, flags: list[str]) -> dict:
    job = client.post("/v1/compile-jobs", json={"model_id": model_id, "flags": flags}).json()
    with server.state.session_factory() as session:
        claimed = compile_jobs.claim(session, uuid.UUID(job["id"]), "test-worker")
        assert claimed is not None
        compile_jobs.run_compile(session, server.state.store, claimed)
    done: dict = client.get(f"/v1/compile-jobs/{job['id']}").json()
    return done


def test_two_qpcs_of_one_model_compare_with_the_figures_of_their_reports(
    server: LiveServer,
) -> None:
    key = server.new_key()
    with server.client(key) as api:
        model = _upload(api, tiny_model_bytes(scale=random.uniform(0.01, 1.0)))
        one = _job(server, api, model, ["-aic-num-cores=1"])
        four = _job(server, api, model, ["-aic-num-cores=4"])

        answer = api.get("/v1/compare", params={"a": one["qpc_id"], "b": four["qpc_id"]})

    assert answer.status_code == 200, answer.text
    body = answer.json()
    rows = {r["name"]: r for r in body["metrics"]}
    assert body["status"] == "passed -> passed"
    assert rows["num_cores"]["a"] == 1 and rows["num_cores"]["b"] == 4
    assert rows["num_cores"]["ratio"] == 4 and rows["num_cores"]["bucket"] == "2x"
    latency = rows["estimated_latency_us"]
    assert latency["a"] == one["metrics"]["estimated_latency_us"]
    assert latency["b"] == four["metrics"]["estimated_latency_us"]
    assert body["changed"]["2x"] >= 1
    assert {r["name"] for r in body["pass_times"]} == set(one["pass_times"]) | set(
        four["pass_times"]
    )
    assert body["a"]["compiler_version"] and body["a"]["kind"] == "qpc"


def test_a_failed_job_against_a_passed_one_is_failed_to_passed(server: LiveServer) -> None:
    with server.client(server.new_key()) as api:
        dynamic = tiny_model(scale=random.uniform(0.01, 1.0), batch="N").SerializeToString()
        failed = _job(server, api, _upload(api, dynamic), [])
        passed = _job(server, api, _upload(api, tiny_model_bytes(scale=0.5)), [])

        body = api.get("/v1/compare", params={"a": failed["id"], "b": passed["id"]}).json()

    assert body["status"] == "failed -> passed"
    assert body["a"]["error"]["code"] == "dynamic_shape"
    assert body["a"]["compiler_version"] is None  # it named no compiler: the default
    assert body["b"]["kind"] == "job" and body["b"]["qpc_id"] == passed["qpc_id"]


def test_unknown_or_other_teams_ids_are_404_and_an_unfinished_job_is_409(
    server: LiveServer,
) -> None:
    with server.client(server.new_key()) as mine, server.client(server.new_key()) as theirs:
        model = _upload(mine, tiny_model_bytes(scale=random.uniform(0.01, 1.0)))
        queued = mine.post("/v1/compile-jobs", json={"model_id": model, "flags": []}).json()
        done = _job(server, theirs, _upload(theirs, tiny_model_bytes(scale=0.25)), [])

        unfinished = mine.get("/v1/compare", params={"a": queued["id"], "b": queued["id"]})
        foreign = mine.get("/v1/compare", params={"a": done["qpc_id"], "b": queued["id"]})
        malformed = mine.get("/v1/compare", params={"a": "x", "b": queued["id"]})

    assert unfinished.status_code == 409 and unfinished.json()["code"] == "not_comparable"
    assert foreign.status_code == 404 and foreign.json()["code"] == "not_found"
    assert malformed.status_code == 422


def test_the_cli_prints_the_changed_metrics_and_exits_0(
    servers: Servers, capsys: pytest.CaptureFixture[str]
) -> None:
    server = servers.get("sqlite")
    key = server.new_key()
    with server.client(key) as api:
        model = _upload(api, tiny_model_bytes(scale=random.uniform(0.01, 1.0)))
        one = _job(server, api, model, ["-aic-num-cores=1"])
        two = _job(server, api, model, ["-aic-num-cores=2"])

    code = compare_command([one["id"], two["qpc_id"], "--server", server.url, "--api-key", key])

    out = capsys.readouterr().out
    assert code == 0
    assert "status: passed -> passed" in out
    assert re.search(r"num_cores\s+1\s+2\s+2\.000x\s+\+2x", out), out

    missing = compare_command([str(uuid.uuid4()), two["qpc_id"], "--server", server.url,
                               "--api-key", key])  # fmt: skip
    assert missing == 1 and "not found (HTTP 404)" in capsys.readouterr().err


def test_the_compare_page_shows_both_sides_and_the_changes(servers: Servers) -> None:
    server = servers.get("sqlite")
    key = server.new_key()
    with server.client(key) as api:
        model = _upload(api, tiny_model_bytes(scale=random.uniform(0.01, 1.0)))
        one = _job(server, api, model, ["-aic-num-cores=1"])
        two = _job(server, api, model, ["-aic-num-cores=2"])
    with web_client(server, key) as browser:
        shown = browser.get("/compare", params={"a": one["qpc_id"], "b": two["id"]})
        bad = browser.get("/compare", params={"a": "nope", "b": two["id"]})
        job_page = browser.get(f"/jobs/{two['id']}")

    assert shown.status_code == 200
    assert "passed -&gt; passed" in shown.text or "passed -> passed" in shown.text
    assert re.search(r"<code>num_cores</code></td>\s*<td>1\.0</td><td>2\.0</td>", shown.text)
    assert bad.status_code == 422 and "invalid_request" in bad.text
    assert f'href="/compare?a={two["id"]}"' in job_page.text


def _job_behind(api: httpx.Client, redirect: httpx.Response) -> dict:
    """The job a page's redirect (`/jobs/{id}?...`) leads to, as the API shows it."""
    job_id = redirect.headers["location"].split("?")[0].rsplit("/", 1)[1]
    job: dict = api.get(f"/v1/compile-jobs/{job_id}").json()
    return job


def test_recompile_on_the_job_page_runs_the_model_again_with_the_compiler_or_stats_level_asked(
    server: LiveServer,
) -> None:
    worker = f"w-{uuid.uuid4().hex[:6]}"
    with server.state.session_factory() as session:
        compilers.advertise(session, worker, [DEFAULT], fresh_s=60.0)
    key = server.new_key()
    try:
        with server.client(key) as api:
            model = _upload(api, tiny_model_bytes(scale=random.uniform(0.01, 1.0)))
            old = _job(server, api, model, ["-aic-num-cores=2"])
            with web_client(server, key) as browser:
                csrf = form_csrf(browser, f"/jobs/{old['id']}")
                versioned = browser.post(
                    f"/jobs/{old['id']}/recompile", data={"compiler": str(DEFAULT), "csrf": csrf}
                )
                missing = browser.post(
                    f"/jobs/{old['id']}/recompile", data={"compiler": "qaic@9.9.9", "csrf": csrf}
                )
                profiled = browser.post(
                    f"/jobs/{old['id']}/recompile-for-profile", data={"csrf": csrf}
                )
            for answer, query in ((versioned, "compare_with"), (profiled, "recompiled_from")):
                assert answer.status_code == 303, answer.text
                assert answer.headers["location"].endswith(f"?{query}={old['id']}")
            new = [_job_behind(api, answer) for answer in (versioned, profiled)]
    finally:
        with server.state.session_factory() as session:
            compilers.withdraw(session, worker)

    assert new[0]["compiler"] == str(DEFAULT) and new[0]["options"] == old["options"]
    assert new[1]["options"] == {**old["options"], "stats-level": OPSTATS_LEVEL}
    assert missing.status_code == 409 and "compiler_unavailable" in missing.text
