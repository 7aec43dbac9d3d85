"""Profile jobs as a specification: `POST /v1/qpcs/{id}/profile` runs a stored QPC on the
functional runtime with stats and stores opstats' summary and trace; the worker runs them from
the compile jobs' queue.

API tests go over real HTTP (uvicorn in a thread, httpx) with a recording queue; the test
plays the worker with `worker.runner.process_job`, the function both queues run, so the id
dispatch (compile or profile) is exercised too. Core flows run on SQLite + filesystem blobs
and on PostgreSQL + database blobs.
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import random
import time
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from sqlalchemy.orm import Session

from app.domain.db.base import utcnow
from app.domain.db.models import JobStatus, ProfileJob, Team
from app.domain.services import jobs, models, profiles
from app.domain.services.errors import ServiceError
from compiler_core import CompileOptions
from tests.api_helpers import LiveServer, Servers
from tests.conftest import Farm, tiny_model_bytes
from worker import claims
from worker.inprocess import InProcessQueue
from worker.reaper import reap_once
from worker.runner import process_job

LEVEL_70 = {"aic-num-cores": 2, "stats-level": 70}
NODES = ("fc1", "act1", "fc2", "probs")


def mlp(scale: float) -> onnx.ModelProto:
    """x[1,8] -> MatMul -> Relu -> MatMul -> Softmax: several kernels, one of them fused."""
    rng = np.random.default_rng(int(scale * 1e6))
    w1 = numpy_helper.from_array((rng.standard_normal((8, 16)) * scale).astype(np.float32), "W1")
    w2 = numpy_helper.from_array((rng.standard_normal((16, 4)) * scale).astype(np.float32), "W2")
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "W1"], ["h"], name="fc1"),
            helper.make_node("Relu", ["h"], ["r"], name="act1"),
            helper.make_node("MatMul", ["r", "W2"], ["z"], name="fc2"),
            helper.make_node("Softmax", ["z"], ["y"], name="probs", axis=-1),
        ],
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        [w1, w2],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def unique_mlp() -> bytes:
    """Bytes no other test uploads (the QPC cache is keyed by them)."""
    return mlp(random.uniform(0.05, 1.0)).SerializeToString()


def npz(**arrays: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, allow_pickle=False, **arrays)
    return buffer.getvalue()


# ------------------------------------------------------------------------------ fixtures


@pytest.fixture
def local(servers: Servers) -> LiveServer:
    return servers.get("sqlite")


def play_worker(server: LiveServer, job_id: str) -> JobStatus | None:
    """What a worker does with an enqueued id (compile or profile)."""
    return process_job(
        uuid.UUID(job_id),
        session_factory=server.state.session_factory,
        store=server.state.store,
        worker_name="test-worker",
    )


def compiled_qpc(server: LiveServer, client: httpx.Client, options: dict[str, Any]) -> str:
    """The id of the QPC of a fresh model compiled with `options`."""
    model = client.post("/v1/models", files={"file": ("mlp.onnx", unique_mlp())}).json()
    job = client.post("/v1/compile-jobs", json={"model_id": model["id"], "options": options})
    assert job.status_code == 202, job.text
    assert play_worker(server, job.json()["id"]) == JobStatus.succeeded
    qpc_id: str = client.get(f"/v1/compile-jobs/{job.json()['id']}").json()["qpc_id"]
    return qpc_id


def profiled(server: LiveServer, client: httpx.Client, qpc_id: str, **post: Any) -> dict:
    """Submit a profile (202, enqueued), run it as the worker does, return its JSON."""
    response = client.post(f"/v1/qpcs/{qpc_id}/profile", **post)
    assert response.status_code == 202, response.text
    profile = response.json()
    assert profile["status"] == "queued"
    assert response.headers["location"] == f"/v1/profiles/{profile['id']}"
    sent = list(zip(server.queue.ids, server.queue.kinds, strict=True))
    assert (uuid.UUID(profile["id"]), "profile") in sent
    play_worker(server, profile["id"])
    done: dict = client.get(f"/v1/profiles/{profile['id']}").json()
    return done


# ------------------------------------------------------------------------------- the API


def test_a_profile_of_a_level_70_qpc_stores_the_opstats_summary_and_trace(
    server: LiveServer,
) -> None:
    with server.client(server.new_key()) as api:
        qpc_id = compiled_qpc(server, api, LEVEL_70)
        profile = profiled(server, api, qpc_id, json={"iterations": 2})

        assert profile["status"] == "succeeded", profile["error"]
        assert (profile["iterations"], profile["inputs"], profile["attempts"]) == (2, "random", 1)
        summary = profile["summary"]
        assert summary["estimated"] is True and summary["stats_level"] == 70
        assert summary["inferences"] == 2 and summary["inference_cycles"] > 0
        # Every ONNX node is covered by exactly one operator, fused or not.
        covered = [node for op in summary["operators"] for node in op["nodes"]]
        assert sorted(covered) == sorted(NODES)
        assert all(0 < op["share_percent"] <= 100 for op in summary["operators"])
        assert [op["cycles"] for op in summary["operators"]] == sorted(
            (op["cycles"] for op in summary["operators"]), reverse=True
        )
        assert {c["core"] for c in summary["cores"]} == {0, 1}

        text = api.get(profile["summary_txt_url"])
        assert text.status_code == 200 and text.headers["content-type"].startswith("text/plain")
        assert all(op["op"] in text.text for op in summary["operators"])

        table = api.get(profile["summary_csv_url"])
        assert table.headers["content-type"].startswith("text/csv")
        rows = list(csv.DictReader(io.StringIO(table.text)))
        # Per core, its operators' cycles plus the waits before them are its inference.
        for core in summary["cores"]:
            mine = [r for r in rows if r["core"] == f"c{core['core']:02d}"]
            assert mine
            spent = sum(float(r["cycles"]) + float(r["wait_before_cycles"]) for r in mine)
            assert spent == pytest.approx(core["inference_pcycles"])

        trace = api.get(profile["trace_url"])
        assert trace.status_code == 200
        assert "attachment" in trace.headers["content-disposition"]
        events = json.loads(trace.content)["traceEvents"]
        names = {e["args"]["name"] for e in events if e.get("name") == "process_name"}
        assert {"NSP core c00", "NSP core c01"} <= names
        spans = [e for e in events if e.get("ph") == "X" and e.get("cat") == "op"]
        assert {n for e in spans for n in e["args"]["onnx_nodes"]} == set(NODES)
        assert {e["args"]["inference"] for e in spans} == {0, 1}


def test_a_qpc_compiled_below_stats_level_70_is_refused_at_submit_saying_why(
    server: LiveServer,
) -> None:
    """The API refuses what the worker would fail (the web's job page refuses alike), before
    reading an uploaded .npz."""
    with server.client(server.new_key()) as api:
        qpc_id = compiled_qpc(server, api, {"aic-num-cores": 2})  # the default level, 40
        posts: list[dict[str, Any]] = [
            {"json": {}},
            {"files": {"inputs": ("in.npz", npz(x=np.zeros(4)))}},
        ]
        for post in posts:
            answer = api.post(f"/v1/qpcs/{qpc_id}/profile", **post)
            body = answer.json()
            assert (answer.status_code, body["code"]) == (409, "stats_level_too_low"), body
            assert "-stats-level=70" in body["message"]
            assert body["flag"] == "-stats-level" and body["stats_level"] == 40


def test_uploaded_npz_inputs_are_run_and_inputs_the_qpc_does_not_take_fail_the_job(
    local: LiveServer,
) -> None:
    with local.client(local.new_key()) as api:
        qpc_id = compiled_qpc(local, api, LEVEL_70)
        x = np.linspace(-1, 1, 8, dtype=np.float32).reshape(1, 8)
        good = profiled(
            local,
            api,
            qpc_id,
            data={"iterations": "3"},
            files={"inputs": ("in.npz", npz(x=x))},
        )
        assert good["status"] == "succeeded", good["error"]
        assert good["inputs"] == "uploaded" and good["iterations"] == 3
        assert good["summary"]["inferences"] == 3

        wrong = profiled(local, api, qpc_id, files={"inputs": ("in.npz", npz(image=x))})
        assert wrong["status"] == "failed"
        assert wrong["error"]["code"] == "bad_inputs"
        assert "image" in wrong["error"]["message"]  # names the input it does not take


def test_a_profile_whose_outputs_overflow_float16_says_where_in_its_summary(
    local: LiveServer,
) -> None:
    from tests.models import OVERFLOW_INPUTS, overflowing_model

    with local.client(local.new_key()) as api:
        body = overflowing_model().SerializeToString()
        model = api.post("/v1/models", files={"file": ("overflow.onnx", body)}).json()
        options = {"convert-to-fp16": True, "stats-level": 70}
        job = api.post("/v1/compile-jobs", json={"model_id": model["id"], "options": options})
        assert play_worker(local, job.json()["id"]) == JobStatus.succeeded
        qpc_id = api.get(f"/v1/compile-jobs/{job.json()['id']}").json()["qpc_id"]
        done = profiled(local, api, qpc_id, files={"inputs": ("in.npz", npz(**OVERFLOW_INPUTS))})
    assert done["status"] == "succeeded", done["error"]
    numerics = done["summary"]["numerics"]
    assert numerics["code"] == "non_finite"
    assert numerics["nodes"] == ["/proj/MatMul", "/proj/Mul"]
    assert numerics["outputs"]["y"]["nan"] == 16
    assert "FP32NodeInstanceNames" in numerics["suggestion"]


def test_inputs_that_are_not_an_npz_and_bad_iterations_are_422_and_nothing_is_queued(
    local: LiveServer,
) -> None:
    with local.client(local.new_key()) as api:
        qpc_id = compiled_qpc(local, api, LEVEL_70)
        queued = list(local.queue.ids)
        not_npz = api.post(
            f"/v1/qpcs/{qpc_id}/profile", files={"inputs": ("in.npz", b"not a zip at all")}
        )
        assert (not_npz.status_code, not_npz.json()["code"]) == (422, "bad_inputs")
        a_model = api.post(
            f"/v1/qpcs/{qpc_id}/profile", files={"inputs": ("m.onnx", tiny_model_bytes())}
        )
        assert (a_model.status_code, a_model.json()["code"]) == (422, "bad_inputs")
        message = a_model.json()["message"]
        assert "is an ONNX model" in message and "numpy.savez" in message
        assert "pickle" not in message
        for body in ({"iterations": 0}, {"iterations": 101}, {"iterations": "many"}, [1]):
            response = api.post(f"/v1/qpcs/{qpc_id}/profile", json=body)
            assert (response.status_code, response.json()["code"]) == (422, "invalid_request")
        assert local.queue.ids == queued


def test_another_teams_qpcs_and_profiles_answer_404(local: LiveServer) -> None:
    with local.client(local.new_key()) as owner, local.client(local.new_key()) as other:
        qpc_id = compiled_qpc(local, owner, LEVEL_70)
        profile = profiled(local, owner, qpc_id, json={"iterations": 1})
        assert profile["status"] == "succeeded"

        submit = other.post(f"/v1/qpcs/{qpc_id}/profile", json={})
        assert (submit.status_code, submit.json()["code"]) == (404, "not_found")
        for path in ("", "/summary.txt", "/summary.csv", "/trace.json"):
            response = other.get(f"/v1/profiles/{profile['id']}{path}")
            assert (response.status_code, response.json()["code"]) == (404, "not_found")
        unknown = owner.get(f"/v1/profiles/{uuid.uuid4()}")
        assert unknown.status_code == 404


# ------------------------------------------------------------------------------ workers


def queued_profile(farm: Farm, session: Session, team: Team) -> uuid.UUID:
    model = models.store_model(
        session, farm.store, team, io.BytesIO(unique_mlp()), "mlp.onnx", max_bytes=64 << 20
    )
    job, _ = jobs.submit_job(session, team, model, CompileOptions.from_json(LEVEL_70))
    session.commit()
    assert run(farm, job.id) == JobStatus.succeeded
    session.refresh(job)
    assert job.qpc is not None
    profile = profiles.submit(session, team, job.qpc, iterations=1)
    session.commit()
    return profile.id


def test_the_worker_still_fails_a_profile_queued_for_a_qpc_below_stats_level_70(
    farm: Farm, session: Session, team: Team
) -> None:
    """A profile row that skipped the submit-time check (queued before it existed) is failed
    by the worker's own analysis, with the same code."""
    model = models.store_model(
        session, farm.store, team, io.BytesIO(unique_mlp()), "mlp.onnx", max_bytes=64 << 20
    )
    job, _ = jobs.submit_job(session, team, model, CompileOptions())  # the default level, 40
    session.commit()
    assert run(farm, job.id) == JobStatus.succeeded
    session.refresh(job)
    assert job.qpc is not None
    with pytest.raises(ServiceError) as refused:
        profiles.submit(session, team, job.qpc, iterations=1)
    assert refused.value.code == "stats_level_too_low"
    row = ProfileJob(team_id=team.id, qpc_id=job.qpc.id, status=JobStatus.queued, iterations=1)
    session.add(row)
    session.commit()

    run(farm, row.id)
    failed = status_of(farm, row.id)
    assert failed.status == JobStatus.failed
    assert failed.error_code == "stats_level_too_low"


def run(farm: Farm, job_id: uuid.UUID) -> JobStatus | None:
    return process_job(job_id, session_factory=farm.db.sessions, store=farm.store, worker_name="w1")


def status_of(farm: Farm, profile_id: uuid.UUID) -> ProfileJob:
    with farm.session() as session:
        row = session.get(ProfileJob, profile_id)
        assert row is not None
        return row


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_the_in_process_queue_runs_a_profile_and_a_redelivered_id_runs_nothing(
    farm: Farm, session: Session, team: Team
) -> None:
    profile_id = queued_profile(farm, session, team)
    queue = InProcessQueue(farm.db.sessions, farm.store).start()
    try:
        queue.enqueue(profile_id)
        wait_for(lambda: not status_of(farm, profile_id).status.is_active, "the profile")
    finally:
        queue.close()
    done = status_of(farm, profile_id)
    assert done.status == JobStatus.succeeded, done.error_message
    assert done.summary is not None and done.trace_sha256 is not None
    assert farm.store.exists(done.trace_sha256)
    assert run(farm, profile_id) is None  # a duplicate message: nothing to claim
    assert status_of(farm, profile_id).attempts == 1


def test_the_sweep_hands_a_dead_workers_profile_to_another_worker(
    farm: Farm, session: Session, team: Team
) -> None:
    profile_id = queued_profile(farm, session, team)
    old = utcnow() - dt.timedelta(minutes=5)
    assert claims.claim_job(session, "profile", profile_id, "dead-worker", now=old) is not None

    class Recording:
        def __init__(self) -> None:
            self.sent: list[tuple[uuid.UUID, str]] = []

        def enqueue(self, job_id: uuid.UUID, kind: str = "compile") -> None:
            self.sent.append((job_id, kind))

        def close(self) -> None: ...

        def ping(self) -> bool:
            return True

    recording = Recording()
    assert reap_once(farm.db.sessions, recording, stale_after_s=60) == [profile_id]
    assert recording.sent == [(profile_id, "profile")]  # to the profile task
    assert run(farm, profile_id) == JobStatus.succeeded
    done = status_of(farm, profile_id)
    assert (done.attempts, done.worker) == (2, "w1")


def test_openapi_documents_the_profile_routes_and_both_submit_bodies(local: LiveServer) -> None:
    with local.client() as client:
        schema = client.get("/openapi.json").json()

    assert set(schema["paths"]) >= {
        "/v1/qpcs/{qpc_id}/profile",
        "/v1/profiles/{profile_id}",
        "/v1/profiles/{profile_id}/summary.txt",
        "/v1/profiles/{profile_id}/summary.csv",
        "/v1/profiles/{profile_id}/trace.json",
    }
    body = schema["paths"]["/v1/qpcs/{qpc_id}/profile"]["post"]["requestBody"]["content"]
    assert set(body) == {"application/json", "multipart/form-data"}
    assert "inputs" in body["multipart/form-data"]["schema"]["properties"]
