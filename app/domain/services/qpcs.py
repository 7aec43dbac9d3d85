"""Compiled QPCs as a team sees them: each team has its own rows (a QPC its jobs produced,
or one copied into its records by a farm-wide cache hit)."""

from __future__ import annotations

import uuid

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.domain.db.base import utcnow
from app.domain.db.models import CompileReport, Qpc, Team
from app.domain.services.errors import not_found


def team_can_see(session: Session, team: Team, qpc_id: uuid.UUID) -> bool:
    qpc = session.get(Qpc, qpc_id)
    return qpc is not None and qpc.team_id == team.id


def get_qpc(session: Session, team: Team, qpc_id: uuid.UUID) -> Qpc:
    """A QPC in the team's records (404 for another team's, like a missing one)."""
    qpc = session.get(Qpc, qpc_id)
    if qpc is None or qpc.team_id != team.id:
        raise not_found("qpc", qpc_id)
    return qpc


PROFILE_METRIC = "quantization_profile"
"""The report entry naming the blob of the quantization profile a `-dump-profile` compile
wrote: {"sha256", "size"} (stored by the worker, downloaded from `/v1/qpcs/{id}/profile`)."""
CONVERSION_METRIC = "conversion"
"""The report entry of a TensorFlow or PyTorch model's compile: its format, the converter and
its version (compiler_core/convert), and `onnx`: {"sha256", "size"} of the ONNX it made
(stored by the worker, downloaded from `/v1/qpcs/{id}/converted.onnx`)."""


def get_report(session: Session, qpc: Qpc) -> CompileReport | None:
    return session.execute(
        select(CompileReport).where(CompileReport.qpc_id == qpc.id)
    ).scalar_one_or_none()


def set_pinned(session: Session, qpc: Qpc, pinned: bool) -> Qpc:
    """Pin (retention never collects it) or unpin a QPC of the team's. The caller commits."""
    if pinned and qpc.pinned_at is None:
        qpc.pinned_at = utcnow()
    elif not pinned:
        qpc.pinned_at = None
    session.flush()
    return qpc
