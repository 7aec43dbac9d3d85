"""Configurator sweeps over the live API with real processes, in both deployment modes:

- embedded (`qpcfarm serve` alone): a brute sweep of a small space on a small model, every
  combination scored and the best QPC checked against ONNX Runtime; the same space in optimize
  mode is all cache hits; `qpcfarm configure --server` prints the ranked table and writes the
  best QPC; a cancel stops what is queued;
- farm (`serve` + `worker` on PostgreSQL and redis): an optimize sweep whose worker is
  SIGKILLed mid-compile and whose API is restarted still finishes, every compile once.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import onnx
import onnxruntime as ort

from tests.conftest import tiny_model
from tests.service_helpers import (
    Api,
    Processes,
    free_port,
    processes,
    qpcfarm_argv,
    read_key_line,
    service_env,
    slow_model,
    wait_for_http,
    wait_for_worker,
    wait_until,
)
from tests.test_service_e2e import FarmServices, farm, start_farm_api

__all__ = ["farm"]  # the fixture, imported for the farm-mode test

TERMINAL = ("succeeded", "failed", "cancelled")

SMALL_SPACE = {
    "parameters": {
        "cores": [1, 2],
        "instances": [1, 2],
        "batchsize": [1, 2],
        "ols": [1, 2],
        "set_size": [1, 2],
    },
    "constraints": ["cores * instances <= 2"],
}
"""32 combinations: 16 fail a rule (ols 2 on one core, 4 cores in use), 16 valid in 6 groups
(cores x batch x ols; instances and set size need no compile)."""


def sweep_api(api: Api, method: str, path: str, **kwargs: Any) -> tuple[int, dict[str, Any]]:
    with api.client() as http:
        answer = http.request(method, path, **kwargs)
    return answer.status_code, answer.json()


def create(api: Api, body: dict[str, Any]) -> dict[str, Any]:
    status, sweep = sweep_api(api, "POST", "/v1/sweeps", json=body)
    assert status == 201, sweep
    return sweep


def wait_sweep(api: Api, sweep_id: str, timeout: float = 120.0) -> dict[str, Any]:
    def finished() -> dict[str, Any] | None:
        _, sweep = sweep_api(api, "GET", f"/v1/sweeps/{sweep_id}")
        return sweep if sweep["status"] in TERMINAL else None

    return wait_until(finished, f"sweep {sweep_id} to finish", timeout)


def start_embedded(procs: Processes, tmp_path: Path) -> Api:
    env = service_env(QPCFARM_DATA_DIR=str(tmp_path / "data"), QPCFARM_WORKER_CONCURRENCY="1")
    port = free_port()
    serve = procs.start("serve", ["serve", "--port", str(port)], env, capture_stdout=True)
    api = Api(f"http://127.0.0.1:{port}", read_key_line(serve))
    wait_for_http(api.base_url, serve)
    return api


def runs_like_onnxruntime(qpc: bytes, model: onnx.ModelProto, batch: int, tmp_path: Path) -> None:
    from compiler_core.runtime import run_qpc

    path = tmp_path / f"{hashlib.sha256(qpc).hexdigest()[:12]}.qpc"
    path.write_bytes(qpc)
    x = np.linspace(-1, 1, batch * 4, dtype=np.float32).reshape(batch, 4)
    expected = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
    got = np.asarray(run_qpc(str(path), {"x": x})["y"])
    np.testing.assert_allclose(got, expected, rtol=2e-3, atol=2e-3)  # fp16 compute


def check_sweep_page(api: Api, sweep: dict[str, Any]) -> None:
    """The sweep's page over plain HTTP, signed in with the key: one linked point per scored
    combination, the Pareto front, the best marked, and a table sorted as the link asks."""
    with httpx.Client(base_url=api.base_url, follow_redirects=True, timeout=60) as web:
        csrf = re.search(r'name="csrf" value="([^"]+)"', web.get("/sign-in").text)
        assert csrf is not None
        form = {"api_key": api.key, "csrf": csrf.group(1), "next": "/sweeps"}
        listing = web.post("/sign-in", data=form)
        assert listing.status_code == 200 and sweep["id"] in listing.text
        page = web.get(f"/sweeps/{sweep['id']}", params={"sort": "latency"})
        assert page.status_code == 200
        assert "script-src 'self'" in page.headers["content-security-policy"]
        html = page.text
        points = re.findall(
            r'<a href="/jobs/([0-9a-f-]+)" class="point([^"]*)" data-index="(\d+)"', html
        )
        assert len(points) == len(sweep["results"])
        by_index = {r["index"]: r for r in sweep["results"]}
        assert all(job == by_index[int(i)]["job_id"] for job, _, i in points)
        assert [int(i) for _, cls, i in points if "best" in cls] == [sweep["best"]["index"]]
        front = {int(i) for _, cls, i in points if "front" in cls}
        assert front == set(sweep["pareto_front"]) and 'id="pareto-front"' in html
        table = html.split('id="sweep-results"', 1)[1]
        shown = [float(x) for x in re.findall(r'<td class="latency">([0-9.]+)</td>', table)]
        assert len(shown) == len(sweep["results"]) and shown == sorted(shown)
        assert 'class="result best' in table
        live = web.get(f"/sweeps/{sweep['id']}/live")
        assert live.status_code == 200 and live.headers.get("x-poll-done") == "1"


# -------------------------------------------------------------------------------- embedded


def test_embedded_brute_sweep_scores_every_valid_combination_and_optimize_reuses_its_qpcs(
    tmp_path: Path,
) -> None:
    model = tiny_model(batch="N")  # -batchsize binds N
    with processes(tmp_path) as procs:
        api = start_embedded(procs, tmp_path)
        model_id = api.upload(model.SerializeToString(), "tiny.onnx")["id"]
        body = {"model_id": model_id, "space": SMALL_SPACE, "base_flags": ["-convert-to-fp16"]}
        created = create(api, {**body, "mode": "brute"})
        assert created["progress"]["invalid_combinations"] == 16
        assert created["progress"]["compile_groups"] == 6
        assert all("reason" in i and i["reason"] for i in created["invalid"])
        brute = wait_sweep(api, created["id"])
        assert brute["status"] == "succeeded", brute["error"]
        assert brute["estimated"] is True
        results = brute["results"]
        assert len(results) == 16 and all(r["error"] is None for r in results)
        assert all(r["latency_us"] > 0 and r["throughput"] > 0 and r["qpc_id"] for r in results)
        assert all("-convert-to-fp16" in r["flags"] for r in results)
        best = brute["best"]
        assert best["throughput"] == max(r["throughput"] for r in results)
        assert results[0]["index"] == best["index"] and best["rank"] == 1
        assert brute["progress"]["compiles_run"] + brute["progress"]["cache_hits"] == 6
        assert best["index"] in brute["pareto_front"]

        qpc = api.download_qpc(best["qpc_id"])
        runs_like_onnxruntime(qpc, model, best["batchsize"], tmp_path)
        check_sweep_page(api, brute)

        optimize = wait_sweep(api, create(api, {**body, "mode": "optimize"})["id"])
        assert optimize["status"] == "succeeded", optimize["error"]
        p = optimize["progress"]
        assert p["compiles_run"] == 0 and p["cache_hits"] == p["compiles_submitted"] > 0
        assert p["compiles_submitted"] <= 6
        by_index = {r["index"]: r for r in results}
        for r in optimize["results"]:  # the same figures as brute's for the same combination
            assert r["throughput"] == by_index[r["index"]]["throughput"]

        # the CLI against the same farm: the space as the vendor's CSV
        csv = tmp_path / "space.csv"
        rows = [
            f"{r['cores']},{r['instances']},{r['batchsize']},{r['params']['ols']},{r['set_size']}"
            for r in results
        ]
        csv.write_text("cores,instances,batchsize,ols,set_size\n" + "\n".join(rows) + "\n")
        onnx_path = tmp_path / "tiny.onnx"
        onnx.save(model, str(onnx_path))
        out = tmp_path / "out"
        env = service_env(QPCFARM_API_KEY=api.key)
        done = subprocess.run(
            qpcfarm_argv("configure", f"-m={onnx_path}", "--search-space", str(csv),
                         "-convert-to-fp16", f"-aic-binary-dir={out}", "--server", api.base_url),
            env=env, cwd=tmp_path, capture_output=True, timeout=300,
        )  # fmt: skip
        stderr = done.stderr.decode()
        assert done.returncode == 0, stderr
        table = done.stdout.decode()
        assert "latency_us" in table and "estimate" in table
        assert len([line for line in table.splitlines() if line.strip()[:1].isdigit()]) == 16
        assert "cache hits" in stderr and "wrote" in stderr
        assert (out / "programqpc.bin").read_bytes() == qpc  # the best is the same QPC


def test_a_cancelled_sweep_stops_its_queued_compiles_and_keeps_its_results(
    tmp_path: Path,
) -> None:
    with processes(tmp_path) as procs:
        api = start_embedded(procs, tmp_path)
        model_id = api.upload(slow_model(layers=600).SerializeToString(), "slow.onnx")["id"]
        space = {"parameters": {"cores": [1, 2, 4, 8], "instances": [1]}}
        sweep = create(api, {"model_id": model_id, "space": space, "mode": "brute"})
        assert sweep["progress"]["compiles_submitted"] == 4

        status, cancelled = sweep_api(api, "POST", f"/v1/sweeps/{sweep['id']}/cancel")
        assert status == 200, cancelled
        assert cancelled["status"] == "cancelled"

        def jobs_settled() -> list[dict[str, Any]] | None:
            found = [api.job(r["job_id"]) for r in cancelled["results"]]
            return found if all(j["status"] in TERMINAL for j in found) else None

        jobs = wait_until(jobs_settled, "the sweep's jobs to stop", 120)
        assert sum(j["status"] == "cancelled" for j in jobs) >= 3  # at most one had finished
        status, again = sweep_api(api, "POST", f"/v1/sweeps/{sweep['id']}/cancel")
        assert status == 409 and again["code"] == "not_cancellable"
        time.sleep(1.0)  # a read does not start anything for a cancelled sweep
        _, read = sweep_api(api, "GET", f"/v1/sweeps/{sweep['id']}")
        assert read["status"] == "cancelled"
        assert read["progress"]["compiles_submitted"] == 4


def test_sweep_requests_are_checked_before_anything_is_queued(tmp_path: Path) -> None:
    with processes(tmp_path) as procs:
        api = start_embedded(procs, tmp_path)
        model_id = api.upload(tiny_model(batch="N").SerializeToString(), "tiny.onnx")["id"]
        one = {"parameters": {"cores": [1]}}
        bad: list[tuple[dict[str, Any], str]] = [
            ({"space": {"parameters": {"colour": [1]}}}, "invalid_search_space"),
            ({"space": one, "space_csv": "cores\n1\n"}, "invalid_request"),
            ({"space": {"parameters": {"ols": [4]}}}, "invalid_search_space"),  # none valid
            ({"space": one, "base_flags": ["-nope"]}, "invalid_search_space"),
            ({"space": one, "objective": "max-throughput-under-latency"}, "invalid_objective"),
            # the configurator sets the local-only options itself; the farm holds every
            # compile group to its option rules like a compile (file options in the model)
            ({"space": one, "base_flags": ["-operators-supported=onnx"]}, "invalid_search_space"),
            ({"space": {"parameters": {"operators-supported": ["onnx"]}}}, "invalid_search_space"),
            ({"space": one, "base_flags": ["-load-profile=/etc/passwd"]}, "invalid_option"),
        ]
        for extra, code in bad:
            status, answer = sweep_api(
                api, "POST", "/v1/sweeps", json={"model_id": model_id, **extra}
            )
            assert status == 422 and answer["code"] == code, (extra, answer)
        status, listing = sweep_api(api, "GET", "/v1/sweeps")
        assert status == 200 and listing["count"] == 0
        status, _ = sweep_api(api, "GET", "/v1/sweeps/00000000-0000-0000-0000-000000000000")
        assert status == 404


# ------------------------------------------------------------------------------------ farm


def test_farm_optimize_sweep_survives_a_killed_worker_and_an_api_restart(
    farm: FarmServices, tmp_path: Path
) -> None:
    with processes(tmp_path) as procs:
        api = start_farm_api(procs, farm.env, tmp_path)
        doomed = procs.start("worker-doomed", ["worker"], farm.env)
        wait_for_worker(doomed)
        model_id = api.upload(slow_model(layers=500).SerializeToString(), "slow.onnx")["id"]
        space = {"parameters": {"cores": [1, 2, 4, 8], "ols": [1, 2]}}
        sweep = create(api, {"model_id": model_id, "space": space, "mode": "optimize"})
        first_job = sweep["results"][0]["job_id"]
        running = api.wait(first_job, ("running", "succeeded", "failed"))
        assert running["status"] == "running", "the compile ended before the worker was killed"
        doomed.kill()
        # the API goes too: a new one carries the sweep on from the database
        procs.started[0].kill()
        port = free_port()
        serve = procs.start("serve", ["serve", "--port", str(port)], farm.env)
        api = Api(f"http://127.0.0.1:{port}", api.key)
        wait_for_http(api.base_url, serve)
        replacement = procs.start("worker-new", ["worker"], farm.env)
        wait_for_worker(replacement)

        done = wait_sweep(api, sweep["id"], timeout=300)
        assert done["status"] == "succeeded", done["error"]
        assert api.job(first_job)["attempts"] >= 2
        p = done["progress"]
        assert p["compiles_failed"] == 0 and p["rounds"] >= 2
        assert done["best"] is not None and done["best"]["qpc_id"]
        job_ids = [r["job_id"] for r in done["results"]]
        assert len(set(job_ids)) == p["compiles_submitted"]  # every compile once
