"""The API's JSON shapes (pydantic), separate from the ORM rows they are built from.

Families: `XCreate` (request), `XOut` (one resource), `XList{items, count}` (a page; `count`
is the total number of matching rows, not the page length).
"""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, model_validator
from sqlalchemy import Row

from app.domain.db.models import CompileJob, CompileReport, JobStatus, ProfileJob, Qpc, Validation

OPTIONS_SCHEMA_NAME = "CompileOptions"
"""Component name of `compiler_core.options.options_json_schema()` in the OpenAPI document."""

OptionsJSON = Annotated[
    dict[str, Any], WithJsonSchema({"$ref": f"#/components/schemas/{OPTIONS_SCHEMA_NAME}"})
]


class _Out(BaseModel):
    model_config = ConfigDict(from_attributes=True)


class TensorOut(BaseModel):
    name: str
    dtype: str | None
    shape: list[int | str | None] | None = Field(
        description="Dims; a symbolic dim is its name (bind it with -onnx-define-symbol)."
    )


class ModelOut(_Out):
    id: uuid.UUID
    sha256: str
    size: int
    name: str
    kind: str = Field(
        description='"onnx", "archive" (a model with its external data), or the framework '
        'format it is converted from ("torch_export", "torchscript", "saved_model", '
        '"frozen_graph", "tflite")'
    )
    opset: int
    inputs: list[TensorOut]
    outputs: list[TensorOut]
    input_shapes: str | None = Field(
        default=None,
        description="A framework model's `input_shapes` given at upload (`x:1x3x224x224,...`): "
        "the `-input-shapes` of its compiles that give none (a compile's own wins). "
        "None for ONNX and for an upload without them.",
    )
    created_at: dt.datetime


class ModelList(BaseModel):
    items: list[ModelOut]
    count: int
    limit: int
    offset: int


class JobCreate(BaseModel):
    """Options as a JSON object (keys are flag names) or as `qaic-compile` flag strings, not
    both (neither: the defaults)."""

    model_config = ConfigDict(
        extra="forbid", json_schema_extra={"not": {"required": ["options", "flags"]}}
    )

    model_id: uuid.UUID
    options: OptionsJSON | None = Field(
        default=None, examples=[{"aic-num-cores": 4, "convert-to-fp16": True}]
    )
    flags: list[str] | None = Field(
        default=None, examples=[["-aic-num-cores=4", "-convert-to-fp16"]]
    )
    compiler: str | None = Field(
        default=None,
        max_length=64,
        description="`backend` or `backend@version` (GET /v1/compilers): the job runs only "
        "on a worker that has it; null: the farm's default (`qpcfarm` of any worker).",
        examples=["qpcfarm@0.1.0", "qaic"],
    )

    @model_validator(mode="after")
    def _one_form(self) -> JobCreate:
        if self.options is not None and self.flags is not None:
            raise ValueError("give either `options` or `flags`, not both")
        return self


class JobError(BaseModel):
    model_config = ConfigDict(extra="allow")

    code: str
    message: str


class JobOut(BaseModel):
    id: uuid.UUID
    model_id: uuid.UUID
    status: JobStatus
    stage: str | None
    progress: float
    error: JobError | None
    options: dict[str, Any] = Field(description="The canonical options the compile runs with.")
    compiler: str | None = Field(
        default=None, description="`backend@version` asked for; null: the farm's default."
    )
    device: str
    qpc_id: uuid.UUID | None
    cache_hit: bool = Field(description="The QPC was reused from an identical earlier compile.")
    attached: bool = Field(
        default=False,
        description="This answer is an identical job that was already queued or running.",
    )
    cancel_requested: bool
    attempts: int
    metrics: dict[str, Any] | None = None
    warnings: list[dict[str, Any]] = Field(default_factory=list)
    pass_times: dict[str, float] = Field(default_factory=dict)
    created_at: dt.datetime
    started_at: dt.datetime | None
    finished_at: dt.datetime | None

    @classmethod
    def of(
        cls, job: CompileJob | Row[Any], report: CompileReport | None, *, attached: bool = False
    ) -> JobOut:
        """The answer for a job: an ORM object, or a row of its columns (the submit path)."""
        error = None
        if job.error_code is not None:
            error = JobError(
                **{
                    **(job.error_detail or {}),
                    "code": job.error_code,
                    "message": job.error_message or "",
                }
            )
        return cls(
            id=job.id,
            model_id=job.model_id,
            status=job.status,
            stage=job.stage,
            progress=job.progress,
            error=error,
            options=job.options,
            compiler=job.compiler,
            device=job.device,
            qpc_id=job.qpc_id,
            cache_hit=job.cache_hit,
            attached=attached,
            cancel_requested=job.cancel_requested,
            attempts=job.attempts,
            metrics=report.metrics if report else None,
            warnings=report.warnings if report else [],
            pass_times=report.pass_times if report else {},
            created_at=job.created_at,
            started_at=job.started_at,
            finished_at=job.finished_at,
        )


class JobList(BaseModel):
    items: list[JobOut]
    count: int
    limit: int
    offset: int


class ReportOut(_Out):
    metrics: dict[str, Any]
    warnings: list[dict[str, Any]]
    pass_times: dict[str, float]
    log: str


class QpcOut(BaseModel):
    id: uuid.UUID
    sha256: str
    size: int
    compiler_version: str
    device: str
    requirements: dict[str, Any]
    created_at: dt.datetime
    report: ReportOut | None
    download_url: str
    pinned: bool = False
    """A pinned QPC is never collected by retention (`PUT`/`DELETE /v1/qpcs/{id}/pin`)."""

    @classmethod
    def of(cls, qpc: Qpc, report: CompileReport | None) -> QpcOut:
        return cls(
            id=qpc.id,
            sha256=qpc.sha256,
            size=qpc.size,
            compiler_version=qpc.compiler_version,
            device=qpc.device,
            requirements=qpc.requirements,
            created_at=qpc.created_at,
            report=ReportOut.model_validate(report) if report else None,
            download_url=f"/v1/qpcs/{qpc.id}/download",
            pinned=qpc.pinned_at is not None,
        )


class CompilerOut(BaseModel):
    compiler: str = Field(description="`backend@version`, what a job's `compiler` names.")
    backend: str = Field(description="`qpcfarm` or `qaic` (the vendor's qaic-compile).")
    version: str
    workers: int = Field(description="Live workers that have it.")


class TeamUsage(BaseModel):
    queued_jobs: int
    running_jobs: int
    stored_bytes: int


class TeamLimitsOut(BaseModel):
    max_queued_jobs: int | None = Field(description="None: no limit")
    max_running_jobs: int | None = Field(description="None: no limit")
    max_stored_bytes: int | None = Field(description="None: no limit")
    retention_days: float | None = Field(
        description="Unreferenced models and QPCs older than this are collected; None: the "
        "farm's default"
    )


class TeamOut(BaseModel):
    team: str
    usage: TeamUsage
    limits: TeamLimitsOut


class ValidateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    device: str | None = Field(
        default=None,
        description="A device profile name (GET /v1/devices); null checks the container only.",
        examples=["aic100-standard"],
    )


class CheckOut(BaseModel):
    name: str
    ok: bool
    message: str


class ValidationOut(BaseModel):
    id: uuid.UUID
    ok: bool
    device: str | None
    checks: list[CheckOut]
    qpc_id: uuid.UUID | None
    qpc_sha256: str
    created_at: dt.datetime

    @classmethod
    def of(cls, row: Validation) -> ValidationOut:
        return cls(
            id=row.id,
            ok=row.ok,
            device=row.device,
            checks=[CheckOut(**c) for c in row.checks],
            qpc_id=row.qpc_id,
            qpc_sha256=row.qpc_sha256,
            created_at=row.created_at,
        )


class ValidationList(BaseModel):
    items: list[ValidationOut]
    count: int
    limit: int
    offset: int


class ProfileCreate(BaseModel):
    """A profile run's settings (JSON body; or form fields before the `inputs` file)."""

    model_config = ConfigDict(extra="forbid")

    iterations: int = Field(default=1, ge=1, le=100, description="Inferences to run.")


class ProfileOut(BaseModel):
    """A profile job: the QPC run on the functional runtime with stats, then opstats.
    `summary` (estimated, per inference) is set once it succeeded."""

    id: uuid.UUID
    qpc_id: uuid.UUID
    status: JobStatus
    iterations: int
    inputs: Literal["uploaded", "random"]
    inputs_sha256: str | None
    error: JobError | None
    summary: dict[str, Any] | None = Field(
        description="`operators` (operator_totals: op, type, unit, cores, cycles, "
        "share_percent, output_bytes, nodes), `op_types`, `cores`, `ports`, "
        "`inference_cycles`, `inference_us`, `stats_level`, `estimated: true`."
    )
    summary_txt_url: str | None
    summary_csv_url: str | None
    trace_url: str | None
    attempts: int
    created_at: dt.datetime
    started_at: dt.datetime | None
    finished_at: dt.datetime | None

    @classmethod
    def of(cls, job: ProfileJob) -> ProfileOut:
        error = None
        if job.error_code is not None:
            error = JobError(
                **{
                    **(job.error_detail or {}),
                    "code": job.error_code,
                    "message": job.error_message or "",
                }
            )
        base = f"/v1/profiles/{job.id}"
        done = job.status == JobStatus.succeeded
        return cls(
            id=job.id,
            qpc_id=job.qpc_id,
            status=job.status,
            iterations=job.iterations,
            inputs="uploaded" if job.inputs_sha256 else "random",
            inputs_sha256=job.inputs_sha256,
            error=error,
            summary=job.summary,
            summary_txt_url=f"{base}/summary.txt" if done else None,
            summary_csv_url=f"{base}/summary.csv" if done else None,
            trace_url=f"{base}/trace.json" if job.trace_sha256 else None,
            attempts=job.attempts,
            created_at=job.created_at,
            started_at=job.started_at,
            finished_at=job.finished_at,
        )


class DeviceOut(BaseModel):
    name: str
    display_name: str
    hw_version: str
    num_cores: int
    socs: int
    cores_per_soc: int
    vtcm_bytes: int = Field(description="Usable VTCM per NSP core.")
    l2_bytes: int
    ddr_bytes: int
    ddr_bandwidth_bytes_per_s: float = Field(description="Per SoC.")
    clock_hz: int
    fp16_tflops: float
    dtypes: list[str]
    pci_device_id: int | None
    modelled: bool = Field(description="True when even the headline figures are modelled.")


class OperatorOut(BaseModel):
    op: str
    domain: str
    since: int
    until: int | None
    dtypes: list[str]


class Health(BaseModel):
    status: Literal["ok", "unavailable"]
    checks: dict[str, str] = Field(default_factory=dict)


class KeyOut(BaseModel):
    """An API key as its team's admins see it: never the key itself (only its sha256 is
    stored), but the prefix people recognise it by."""

    id: uuid.UUID
    prefix: str
    name: str | None
    admin: bool
    created_at: dt.datetime
    revoked_at: dt.datetime | None


class KeyList(BaseModel):
    items: list[KeyOut]
    count: int


class KeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(default=None, max_length=100, description="A label.")
    admin: bool = Field(default=False, description="May manage the team's keys.")


class KeyCreated(KeyOut):
    key: str = Field(description="The key: shown this once, stored only as its sha256.")
