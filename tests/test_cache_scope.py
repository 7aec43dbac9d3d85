"""Whose QPCs a submit reuses (`QPCFARM_CACHE_SCOPE`), over real HTTP on both databases.

`team` (the default): another team's identical submit is a compile of its own, and nothing
it is answered says the first team compiled that model. `farm`: it is a cache hit on a QPC
copied into its own records (its own id, same bytes), answered like any cache hit.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import httpx
import pytest

from tests.api_helpers import LiveServer, live_server
from tests.conftest import tiny_model_bytes
from worker import compile_jobs


def compile_for(server: LiveServer, client: httpx.Client, data: bytes) -> httpx.Response:
    model = client.post("/v1/models", files={"file": ("m.onnx", data)}).json()
    answer = client.post("/v1/compile-jobs", json={"model_id": model["id"], "options": {}})
    if answer.json()["status"] == "queued":
        with server.state.session_factory() as session:
            job = compile_jobs.claim(session, uuid.UUID(answer.json()["id"]), "w")
            assert job is not None
            compile_jobs.run_compile(session, server.state.store, job)
    return answer


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
@pytest.mark.parametrize("scope", ["team", "farm"])
def test_another_teams_identical_submit_by_cache_scope(
    kind: str, scope: str, tmp_path: Path
) -> None:
    data = tiny_model_bytes(0.4242)
    with live_server(kind, tmp_path, cache_scope=scope) as server:
        with server.client(server.new_key()) as a, server.client(server.new_key()) as b:
            first = compile_for(server, a, data).json()
            mine = a.get(f"/v1/compile-jobs/{first['id']}").json()["qpc_id"]

            answer = compile_for(server, b, data)
            theirs = answer.json()
            if scope == "team":
                assert (answer.status_code, theirs["status"]) == (202, "queued")
                assert not theirs["cache_hit"] and theirs["qpc_id"] is None
            else:
                assert (answer.status_code, theirs["cache_hit"]) == (200, True)
            done = b.get(f"/v1/compile-jobs/{theirs['id']}").json()
            assert done["status"] == "succeeded" and done["qpc_id"] != mine
            assert b.get(f"/v1/qpcs/{mine}").status_code == 404
            assert (
                b.get(f"/v1/qpcs/{done['qpc_id']}/download").content
                == a.get(f"/v1/qpcs/{mine}/download").content
            )
