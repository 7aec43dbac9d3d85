"""What the farm can target and whether it is up: devices, operators, health probes."""

from __future__ import annotations

import logging
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from sqlalchemy import text

from app.api.deps import CurrentTeam, SessionDep, SettingsDep
from app.api.errors import ApiError
from app.api.schemas import CompilerOut, DeviceOut, Health, OperatorOut
from app.domain.services import compilers

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", tags=["targets"])
health_router = APIRouter(tags=["health"])

FRAMEWORKS = ("onnx",)


@router.get("/devices", response_model=list[DeviceOut])
def list_devices(_team: CurrentTeam) -> list[DeviceOut]:
    """The device profiles QPCs are compiled for and validated against (modelled figures)."""
    from compiler_core.devices import list_devices as profiles

    return [
        DeviceOut(
            name=d.name,
            display_name=d.display_name,
            hw_version=d.hw_version,
            num_cores=d.num_cores,
            socs=d.socs,
            cores_per_soc=d.cores_per_soc,
            vtcm_bytes=d.vtcm_bytes_per_core,
            l2_bytes=d.l2_bytes,
            ddr_bytes=d.ddr_bytes,
            ddr_bandwidth_bytes_per_s=d.ddr_bandwidth_bytes_per_s,
            clock_hz=d.clock_hz,
            fp16_tflops=d.fp16_tflops,
            dtypes=sorted(d.dtypes),
            pci_device_id=d.pci_device_id,
            modelled=d.modelled,
        )
        for d in profiles()
    ]


@router.get("/compilers", response_model=list[CompilerOut])
def list_compilers(
    _team: CurrentTeam, session: SessionDep, settings: SettingsDep
) -> list[CompilerOut]:
    """The compilers live workers have (`backend@version`, newest first per backend), with
    how many workers have each: what a compile job's `compiler` may name."""
    rows = compilers.available(session, fresh_s=compilers.fresh_s(settings.stale_after_s))
    return [CompilerOut(**row) for row in rows]


@router.get("/operators", response_model=list[OperatorOut])
def list_operators(
    _team: CurrentTeam,
    framework: Annotated[str, Query(description="Only `onnx` for now.")] = "onnx",
) -> list[OperatorOut]:
    """The supported operators (`-operators-supported=onnx`): opset range and data types."""
    if framework.lower() not in FRAMEWORKS:
        raise ApiError(
            "unknown_framework",
            f"unknown framework {framework!r}; supported: {', '.join(FRAMEWORKS)}",
            422,
            {"known": list(FRAMEWORKS)},
        )
    from compiler_core.ops import REGISTRY

    return [
        OperatorOut(
            op=opdef.op_type,
            domain=opdef.domain or "ai.onnx",
            since=opdef.since,
            until=opdef.until,
            dtypes=sorted(opdef.dtypes),
        )
        for opdef in REGISTRY.all()
    ]


@health_router.get("/healthz", response_model=Health)
def healthz() -> Health:
    """The process answers (liveness)."""
    return Health(status="ok")


@health_router.get("/readyz", response_model=Health, responses={503: {"model": Health}})
async def readyz(request: Request) -> Any:
    """The database answers, the job queue (broker) pings and the blob store takes a write
    (readiness); 503 if not, `checks` saying which."""
    checks: dict[str, str] = {}
    ready = True
    try:
        await run_in_threadpool(_ping_database, request.app.state.engine)
        checks["database"] = "ok"
    except Exception as exc:  # noqa: BLE001 - any failure means: not ready
        log.warning("readiness: database unavailable: %s", exc)
        checks["database"] = f"unavailable: {type(exc).__name__}"
        ready = False
    ping = getattr(request.app.state.queue, "ping", None)
    if callable(ping):
        try:
            answered = await run_in_threadpool(ping)
            problem = None if answered is not False else "unavailable"
        except Exception as exc:  # noqa: BLE001
            problem = f"unavailable: {type(exc).__name__}"
        if problem is None:
            checks["queue"] = "ok"
        else:
            log.warning("readiness: job queue %s", problem)
            checks["queue"] = problem
            ready = False
    try:
        await run_in_threadpool(request.app.state.store.check_writable)
        checks["blobs"] = "ok"
    except Exception as exc:  # noqa: BLE001 - any failure means: not ready
        log.warning("readiness: blob store unavailable: %s", type(exc).__name__)
        checks["blobs"] = f"unavailable: {type(exc).__name__}"
        ready = False
    health = Health(status="ok" if ready else "unavailable", checks=checks)
    headers = None if ready else {"Retry-After": "5"}
    return JSONResponse(health.model_dump(), status_code=200 if ready else 503, headers=headers)


def _ping_database(engine: Any) -> None:
    with engine.connect() as conn:
        conn.execute(text("SELECT 1"))
