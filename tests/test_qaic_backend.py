"""The vendor SDK as a compile backend, against a stand-in SDK the tests write
(`tests/qaic_standin.py`, following the vendor's documented CLI): a job for `qaic` runs
`<sdk>/exec/qaic-compile` with the job's flags, stores the `programqpc.bin` it writes, keeps
its stdout/stderr as the report's log and parses the metrics and warnings it prints; a
failing run fails the job with its status and stderr; flags only qpcfarm knows are refused
for this backend; `qaic-qpc validate` validates what it made; `qaic-runner` and
`qaic-opstats` profile it when the host has a card."""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.orm import Session

from app.domain.compilers import Compiler, local_compilers
from app.domain.db.models import JobStatus, Qpc, Team
from app.domain.services import jobs, models, qpcs, validations
from app.domain.services.errors import ServiceError
from app.domain.services.limits import Limits
from app.domain.settings import Settings, get_settings
from compiler_core import CompileError, CompileOptions
from tests import qaic_standin
from tests.conftest import Farm, tiny_model_bytes
from worker import compile_jobs
from worker.compile_process import CompileProcess

QAIC = Compiler("qaic", qaic_standin.VERSION)


@pytest.fixture
def sdk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    root = qaic_standin.write_sdk(tmp_path / "qti-aic")
    monkeypatch.setenv("QPCFARM_QAIC_SDK", str(root))
    get_settings.cache_clear()
    try:
        yield root
    finally:
        get_settings.cache_clear()


def vendor_job(
    farm: Farm, session: Session, team: Team, flags: list[str], scale: float = 0.3,
    compiler: CompileProcess | None = None,
):  # fmt: skip
    model = models.store_model(
        session, farm.store, team, io.BytesIO(tiny_model_bytes(scale)), "m.onnx",
        max_bytes=1 << 30,
    )  # fmt: skip
    options = CompileOptions.from_flags(flags)
    job, _ = jobs.submit_job(session, team, model, options, compiler=QAIC)
    session.commit()
    claimed = compile_jobs.claim(session, job.id, "vendor-worker")
    assert claimed is not None
    return compile_jobs.run_compile(session, farm.store, claimed, compiler=compiler)


def test_a_host_with_the_sdk_offers_qaic_at_its_version(sdk: Path, tmp_path: Path) -> None:
    assert QAIC in local_compilers(Settings(data_dir=tmp_path, qaic_sdk=sdk))


def test_a_qaic_job_runs_qaic_compile_with_its_flags_and_stores_what_it_wrote(
    farm: Farm, session: Session, team: Team, sdk: Path
) -> None:
    job = vendor_job(farm, session, team, ["-aic-num-cores=4", "-convert-to-fp16"])

    assert job.status is JobStatus.succeeded, (job.error_code, job.error_message)
    (call,) = qaic_standin.calls(sdk)
    argv = call["argv"]
    assert isinstance(argv, list)
    assert argv[0].startswith("-m=") and argv[-1].startswith("-aic-binary-dir=")
    assert {"-aic-num-cores=4", "-convert-to-fp16", "-aic-hw", "-aic-perf-metrics",
            "-aic-perf-warnings"} <= set(argv)  # fmt: skip
    qpc = session.get(Qpc, job.qpc_id)
    assert qpc is not None and qpc.compiler_version == str(QAIC)
    with farm.store.open(qpc.sha256) as stream:
        assert stream.read().startswith(qaic_standin.MAGIC)
    report = qpcs.get_report(session, qpc)
    assert report is not None
    assert "Compilation done." in report.log and "--- qaic-compile stderr ---" in report.log
    assert report.metrics["original_mac_estimate"] == 1234567
    assert report.metrics["vtcmmaxsize"] == 8323072 and report.metrics["estimated"] is False
    assert [w["code"] for w in report.warnings] == ["vendor_warning"]
    assert "HVX" in report.warnings[0]["message"]


def test_a_failing_qaic_compile_fails_the_job_with_its_status_and_stderr(
    farm: Farm, session: Session, team: Team, sdk: Path
) -> None:
    (sdk / "fail").write_text("3")

    job = vendor_job(farm, session, team, [], scale=0.4)

    assert job.status is JobStatus.failed and job.error_code == "vendor_compile_failed"
    assert "status 3" in (job.error_message or "")
    assert "unsupported operator Foo" in (job.error_message or "")
    assert job.error_detail and job.error_detail["details"]["exit_code"] == 3


def test_a_qaic_compile_that_outruns_the_farms_time_limit_is_killed_and_fails_the_job(
    farm: Farm, session: Session, team: Team, sdk: Path
) -> None:
    """The limits of the worker's own compiles (`CompileProcess.limits`) hold for the vendor's
    tool too: at the time limit it is killed and the job fails `compile_time_limit`."""
    (sdk / "sleep").write_text("60")
    limits = Limits(memory_bytes=4 << 30, time_s=1.0)

    job = vendor_job(farm, session, team, [], scale=0.45, compiler=CompileProcess(limits))

    assert job.status is JobStatus.failed and job.error_code == "compile_time_limit"
    assert job.error_detail and job.error_detail["details"] == {"limit": "time", "limit_s": 1.0}
    (call,) = qaic_standin.calls(sdk)
    with pytest.raises(ProcessLookupError):  # killed and reaped, not left compiling
        os.kill(int(str(call["pid"])), 0)


def test_a_qaic_compile_runs_under_the_farms_memory_limit(
    farm: Farm, session: Session, team: Team, sdk: Path
) -> None:
    """Its address space is capped before it starts: a run within the limit succeeds, one
    that maps more fails the job `compile_memory_limit` (unlimited, the same mapping works:
    it only reserves addresses)."""
    limits = Limits(memory_bytes=512 << 20, time_s=600.0)
    within = vendor_job(farm, session, team, [], scale=0.46, compiler=CompileProcess(limits))
    (sdk / "allocate").write_text(str(1 << 30))
    over = vendor_job(farm, session, team, [], scale=0.47, compiler=CompileProcess(limits))
    unlimited = vendor_job(farm, session, team, [], scale=0.48)

    assert within.status is JobStatus.succeeded, (within.error_code, within.error_message)
    assert over.status is JobStatus.failed and over.error_code == "compile_memory_limit"
    assert over.error_detail and over.error_detail["details"] == {"limit": "memory",
                                                                   "limit_mib": 512}  # fmt: skip
    assert unlimited.status is JobStatus.succeeded, (unlimited.error_code, unlimited.error_message)


def test_options_only_qpcfarm_knows_are_refused_for_the_qaic_backend(
    farm: Farm, session: Session, team: Team, sdk: Path
) -> None:
    with pytest.raises(CompileError) as refused:
        vendor_job(farm, session, team, ["-aic-device=aic100-standard", "-mdp-devices=2",
                                         "-aic-num-cores=2"])  # fmt: skip

    assert refused.value.code == "option_not_for_backend"
    assert "-aic-device" in refused.value.message and "-mdp-devices" in refused.value.message
    assert qaic_standin.calls(sdk) == []


def test_qaic_qpc_validate_validates_what_the_vendor_compiler_made(
    farm: Farm, session: Session, team: Team, sdk: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = vendor_job(farm, session, team, ["-aic-num-cores=2"], scale=0.5)
    qpc = session.get(Qpc, job.qpc_id)
    assert qpc is not None

    row = validations.validate_stored_qpc(session, farm.store, team, qpc, None)

    assert row.ok is True and row.checks[0]["name"] == "qaic-qpc validate"
    assert "NSPs required: 4" in row.checks[0]["message"]

    monkeypatch.setenv("QPCFARM_QAIC_SDK", str(sdk.parent / "elsewhere"))
    get_settings.cache_clear()
    with pytest.raises(ServiceError) as missing:
        validations.validate_stored_qpc(session, farm.store, team, qpc, None)
    assert missing.value.status == 409 and missing.value.code == "validator_unavailable"


def test_a_vendor_qpc_profiles_with_qaic_runner_and_opstats_on_a_card_and_fails_without(
    farm: Farm, session: Session, team: Team, sdk: Path, monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:  # fmt: skip
    from app.domain.db.models import ProfileJob
    from app.domain.services import profiles
    from worker.runner import process_job

    job = vendor_job(farm, session, team, ["-aic-num-cores=2", "-stats-level=70"], scale=0.6)
    qpc = session.get(Qpc, job.qpc_id)
    assert qpc is not None

    def profiled(devices: str) -> ProfileJob:
        monkeypatch.setenv("QPCFARM_QAIC_DEVICES", devices)
        get_settings.cache_clear()
        row = profiles.submit(session, team, qpc, iterations=3)
        session.commit()
        process_job(row.id, session_factory=farm.db.sessions, store=farm.store,
                    worker_name="w", kind="profile")  # fmt: skip
        session.refresh(row)
        return row

    none = profiled(str(tmp_path / "no-such-card*"))
    (tmp_path / "accel0").write_text("")
    ran = profiled(str(tmp_path / "accel*"))

    assert none.status is JobStatus.failed and none.error_code == "no_device"
    assert ran.status is JobStatus.succeeded, (ran.error_code, ran.error_message)
    assert ran.summary is not None and ran.summary["estimated"] is False
    assert ran.summary["runner"]["inf_sec"] == 1234.5
    assert ran.summary_text == "Conv 120 pcycles\n"
    assert ran.summary_csv == "op,pcycles\nConv,120\n"
    assert ran.trace_sha256 is not None
