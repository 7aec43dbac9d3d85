"""Two worker kinds side by side in farm mode (real `qpcfarm serve` and `qpcfarm worker`
processes, PostgreSQL, a private redis-server): one worker without the vendor SDK, one with a
stand-in SDK (`tests/qaic_standin.py`). A job naming `qaic` is refused while no worker has it,
and once one does it runs there (through that compiler's Celery queue), while jobs naming no
compiler still run."""

from __future__ import annotations

from pathlib import Path

from tests import qaic_standin
from tests.conftest import tiny_model_bytes
from tests.service_helpers import processes, wait_for_worker
from tests.test_service_e2e import FarmServices, farm, start_farm_api  # noqa: F401

QAIC = f"qaic@{qaic_standin.VERSION}"


def test_a_job_naming_qaic_waits_for_a_worker_with_the_sdk_and_runs_only_there(
    farm: FarmServices,  # noqa: F811
    tmp_path: Path,
) -> None:
    sdk = qaic_standin.write_sdk(tmp_path / "qti-aic")
    plain_env = {**farm.env, "QPCFARM_QAIC_SDK": str(tmp_path / "no-sdk")}
    vendor_env = {**farm.env, "QPCFARM_QAIC_SDK": str(sdk)}
    with processes(tmp_path) as procs:
        api = start_farm_api(procs, farm.env, tmp_path)
        wait_for_worker(procs.start("worker-plain", ["worker"], plain_env))
        model = api.upload(tiny_model_bytes(0.7))["id"]
        with api.client() as http:
            before = http.get("/v1/compilers").json()
            refused = http.post("/v1/compile-jobs", json={"model_id": model, "compiler": "qaic"})

            wait_for_worker(procs.start("worker-qaic", ["worker"], vendor_env))
            after = http.get("/v1/compilers").json()
            vendor = http.post(
                "/v1/compile-jobs",
                json={"model_id": model, "flags": ["-aic-num-cores=2"], "compiler": "qaic"},
            ).json()
        plain = api.submit(model, {"aic-num-cores": 2})
        vendor_done = api.wait(vendor["id"], ("succeeded", "failed"))
        plain_done = api.wait(plain["id"], ("succeeded", "failed"))
        with api.client() as http:
            vendor_qpc = http.get(f"/v1/qpcs/{vendor_done['qpc_id']}").json()
            plain_qpc = http.get(f"/v1/qpcs/{plain_done['qpc_id']}").json()

    assert [r["backend"] for r in before] == ["qpcfarm"]
    assert refused.status_code == 409 and refused.json()["code"] == "compiler_unavailable"
    assert QAIC in [r["compiler"] for r in after]
    assert vendor["compiler"] == QAIC
    assert vendor_done["status"] == "succeeded", vendor_done["error"]
    assert plain_done["status"] == "succeeded", plain_done["error"]
    assert vendor_qpc["compiler_version"] == QAIC
    assert plain_qpc["compiler_version"] != QAIC
    (call,) = qaic_standin.calls(sdk)  # the vendor compiler ran once: for the qaic job
    assert "-aic-num-cores=2" in call["argv"]  # type: ignore[operator]
