"""Runs of the QPC validator against a device, on stored or uploaded QPCs, kept as rows."""

from __future__ import annotations

import tempfile
import uuid
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.domain.blobs import BlobStore, BlobTooLarge
from app.domain.blobs.base import Source
from app.domain.blobs.integrity import verified_path
from app.domain.compilers import QAIC, QAIC_QPC
from app.domain.db.models import Qpc, Team, Validation
from app.domain.services.errors import ServiceError, from_compile_error, not_found
from app.domain.services.models import too_large
from app.domain.services.pages import Page, paginate
from app.domain.services.qpcs import get_qpc
from compiler_core import CompileError


def validate_stored_qpc(
    session: Session, store: BlobStore, team: Team, qpc: Qpc, device: str | None
) -> Validation:
    """Validate a QPC of the team against `device` (a profile name; None: container and
    program checks only) and record the result. Caller commits."""
    get_qpc(session, team, qpc.id)  # 404 unless the team may see it
    if qpc.compiler_version.startswith(f"{QAIC}@"):
        return _record_vendor(session, store, team, qpc, device)
    return _record(session, store, team, qpc.sha256, qpc.id, device)


def validate_uploaded(
    session: Session,
    store: BlobStore,
    team: Team,
    stream: Source,
    device: str | None,
    *,
    max_bytes: int | None = None,
) -> Validation:
    """Store an uploaded QPC file, validate it and record the result (linked to the team's
    QPC of the same content, if any). An unknown device is refused before the upload is
    stored. Caller commits."""
    _check_device(device)
    try:
        ref = store.put(stream, max_bytes=max_bytes)
    except BlobTooLarge as exc:
        raise too_large(exc) from None
    if ref.size == 0:
        raise ServiceError("empty_upload", "the upload is empty: send a QPC file", 422)
    qpc_id = session.execute(
        select(Qpc.id).where(Qpc.team_id == team.id, Qpc.sha256 == ref.sha256)
    ).scalar_one_or_none()
    return _record(session, store, team, ref.sha256, qpc_id, device)


def get_validation(session: Session, team: Team, validation_id: uuid.UUID) -> Validation:
    row = session.get(Validation, validation_id)
    if row is None or row.team_id != team.id:
        raise not_found("validation", validation_id)
    return row


def list_validations(
    session: Session, team: Team, *, limit: int = 50, offset: int = 0
) -> Page[Validation]:
    query = (
        select(Validation)
        .where(Validation.team_id == team.id)
        .order_by(Validation.created_at.desc(), Validation.id)
    )
    return paginate(session, query, limit, offset)


def _check_device(device: str | None) -> None:
    if device is None:
        return
    from compiler_core.devices import get_device

    try:
        get_device(device)
    except CompileError as exc:
        raise from_compile_error(exc) from None


def _record(
    session: Session,
    store: BlobStore,
    team: Team,
    sha256: str,
    qpc_id: uuid.UUID | None,
    device: str | None,
) -> Validation:
    from compiler_core.qpc.validate import validate_qpc

    _check_device(device)
    with tempfile.TemporaryDirectory(prefix="qpcfarm-validate-") as tmp:
        with verified_path(
            store, sha256, Path(tmp), "programqpc.bin", found_by="validation"
        ) as path:
            try:
                report = validate_qpc(path, device)
            except CompileError as exc:
                raise from_compile_error(exc) from None
    row = Validation(
        team_id=team.id,
        qpc_id=qpc_id,
        qpc_sha256=sha256,
        device=report.device or device,
        ok=report.ok,
        checks=[c.to_dict() for c in report.checks],
    )
    session.add(row)
    session.flush()
    return row


VENDOR_TIMEOUT_S = 300.0
VENDOR_CHECK = "qaic-qpc validate"


def _record_vendor(
    session: Session, store: BlobStore, team: Team, qpc: Qpc, device: str | None
) -> Validation:
    """A QPC the vendor's qaic-compile made is validated by the vendor's `qaic-qpc validate
    -i programqpc.bin` (exit 0: valid), from the SDK of this server
    (`QPCFARM_QAIC_SDK`); 409 `validator_unavailable` where there is none. The device, if
    given, is recorded but not checked (the vendor tool checks the container)."""
    import subprocess

    from app.domain.settings import get_settings

    _check_device(device)
    tool = get_settings().qaic_sdk / QAIC_QPC
    if not tool.is_file():
        raise ServiceError(
            "validator_unavailable",
            f"QPC {qpc.id} was made by {qpc.compiler_version}; validating it needs the "
            f"vendor's qaic-qpc, which this server does not have ({tool})",
            409,
        )
    with tempfile.TemporaryDirectory(prefix="qpcfarm-validate-") as tmp:
        with verified_path(
            store, qpc.sha256, Path(tmp), "programqpc.bin", found_by="validation"
        ) as path:
            try:
                done = subprocess.run(
                    [str(tool), "validate", "-i", str(path)],
                    capture_output=True,
                    timeout=VENDOR_TIMEOUT_S,
                    stdin=subprocess.DEVNULL,
                    check=False,
                )
                ok, output = (
                    done.returncode == 0,
                    (done.stdout + done.stderr).decode("utf-8", errors="replace"),
                )
                message = f"exit status {done.returncode}: {output.strip()[-2000:]}"
            except subprocess.TimeoutExpired:
                ok, message = False, f"no answer within {VENDOR_TIMEOUT_S:g} s"
    row = Validation(
        team_id=team.id,
        qpc_id=qpc.id,
        qpc_sha256=qpc.sha256,
        device=device,
        ok=ok,
        checks=[{"name": VENDOR_CHECK, "ok": ok, "message": message}],
    )
    session.add(row)
    session.flush()
    return row
