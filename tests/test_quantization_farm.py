"""The farm's int8 flow: calibration inputs travel in the model's archive; a -dump-profile job
stores its profile, downloadable from /v1/qpcs/{id}/profile; the profile goes back in an
archive for -load-profile; the cache key covers the profile's and the calibration set's bytes;
the report carries the accuracy figures."""

from __future__ import annotations

import io
import json

import numpy as np

from compiler_core import QpcSession
from tests import test_api
from tests.api_helpers import zip_bytes
from tests.quant_models import calibration, cnn
from tests.test_api import play_worker, submit, upload

servers, local, local_api = test_api.servers, test_api.local, test_api.local_api


def npz(samples) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, x=np.stack([s["x"] for s in samples]))
    return buffer.getvalue()


def test_dump_profile_job_stores_a_profile_that_a_load_profile_job_reuses(local, local_api):
    model = cnn(seed=int(np.random.default_rng().integers(1 << 20)))
    data = model.SerializeToString()
    calib = npz(calibration(model, 6))
    archive = zip_bytes({"model.onnx": data, "calib.npz": calib})
    first = upload(local_api, archive, "model.zip")
    flags = ["-dump-profile=profile.json", "-input-list-file=calib.npz"]
    job = submit(local_api, first["id"], flags=flags).json()
    play_worker(local, job["id"])
    done = local_api.get(f"/v1/compile-jobs/{job['id']}").json()
    assert done["status"] == "succeeded", done
    qpc = local_api.get(f"/v1/qpcs/{done['qpc_id']}").json()
    metrics = qpc["report"]["metrics"]
    assert metrics["quantization_accuracy"]["held_back"]["samples"] == 1
    assert "int8" in metrics["precision"]
    profile = local_api.get(f"/v1/qpcs/{done['qpc_id']}/profile")
    assert profile.status_code == 200, profile.text
    doc = json.loads(profile.content)
    assert doc["format"] == "qpcfarm-quantization-profile" and doc["samples"] == 5

    # the same archive and flags: a cache hit
    again = submit(local_api, first["id"], flags=flags).json()
    assert again["cache_hit"] is True

    # the profile back in an archive: -load-profile compiles the same int8 program
    reuse = upload(
        local_api, zip_bytes({"model.onnx": data, "profile.json": profile.content}), "m.zip"
    )
    job2 = submit(local_api, reuse["id"], flags=["-load-profile=profile.json"]).json()
    play_worker(local, job2["id"])
    done2 = local_api.get(f"/v1/compile-jobs/{job2['id']}").json()
    assert done2["status"] == "succeeded", done2
    qpc1 = local_api.get(f"/v1/qpcs/{done['qpc_id']}/download").content
    qpc2 = local_api.get(f"/v1/qpcs/{done2['qpc_id']}/download").content
    feeds = calibration(model, 1, seed=99)[0]
    with QpcSession(qpc1) as one, QpcSession(qpc2) as two:
        np.testing.assert_array_equal(one.run(feeds)["y"], two.run(feeds)["y"])
    missing = local_api.get(f"/v1/qpcs/{done2['qpc_id']}/profile")
    assert missing.status_code == 404 and missing.json()["code"] == "profile_not_found"

    # another profile's bytes under the same name: a different model identity, no cache hit
    doc["tensors"]["x"]["max"] *= 2
    changed = zip_bytes({"model.onnx": data, "profile.json": json.dumps(doc).encode()})
    other = upload(local_api, changed, "o.zip")
    job3 = submit(local_api, other["id"], flags=["-load-profile=profile.json"]).json()
    assert job3["cache_hit"] is False


def test_calibration_inputs_missing_from_the_upload_are_refused_naming_the_flag(local, local_api):
    model = cnn(seed=int(np.random.default_rng().integers(1 << 20)))
    bare = upload(local_api, model.SerializeToString(), "m.onnx")
    answer = submit(
        local_api, bare["id"], flags=["-dump-profile=p.json", "-input-list-file=calib.npz"]
    )
    assert (answer.status_code, answer.json()["code"]) == (422, "invalid_option")
    assert "-input-list-file" in answer.json()["message"]
    archive = zip_bytes({"model.onnx": model.SerializeToString()})
    packed = upload(local_api, archive, "m.zip")
    job = submit(
        local_api, packed["id"], flags=["-dump-profile=p.json", "-input-list-file=calib.npz"]
    ).json()
    play_worker(local, job["id"])
    done = local_api.get(f"/v1/compile-jobs/{job['id']}").json()
    assert done["status"] == "failed" and "-input-list-file" in done["error"]["message"]
