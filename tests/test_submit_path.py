"""The submit path's own statements (`jobs.submit`, Core, no ORM objects), in both modes:
the rare branches a burst of submits does not reach, and the answer a row gives."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from app.api.schemas import JobOut
from app.domain.db.models import CompileJob, JobStatus, Model, Team
from app.domain.services import jobs
from tests.conftest import Farm, make_team
from tests.test_db_services import OPTIONS, add_model, compiled_job, raises_service_error


def test_a_qpc_stored_between_the_lookup_and_the_insert_turns_the_new_job_into_a_hit(
    farm: Farm, session: Session, team: Team, monkeypatch: pytest.MonkeyPatch
) -> None:
    done = compiled_job(farm, session, team)
    real = jobs._usable_cached_qpc
    lookups: list[uuid.UUID | None] = []

    def first_misses(*args: Any) -> uuid.UUID | None:
        """The first lookup runs before the other compile stored its QPC."""
        found = real(*args) if lookups else None
        lookups.append(found)
        return found

    monkeypatch.setattr(jobs, "_usable_cached_qpc", first_misses)
    row, created = jobs.submit(session, team, done.model_id, OPTIONS)
    session.commit()

    assert lookups == [None, done.qpc_id]
    assert created and row.id != done.id
    assert (row.status, row.cache_hit, row.qpc_id) == (JobStatus.succeeded, True, done.qpc_id)
    assert row.stage == "done" and row.progress == 1.0 and row.finished_at is not None
    stored = session.execute(select(CompileJob).where(CompileJob.id == row.id)).scalar_one()
    assert (stored.status, stored.cache_hit, stored.qpc_id) == (row.status, True, done.qpc_id)


def test_a_row_and_the_orm_job_give_the_same_answer(
    farm: Farm, session: Session, team: Team
) -> None:
    model = add_model(farm, session, team)
    row, created = jobs.submit(session, team, model.id, OPTIONS)
    session.commit()
    again, attached_created = jobs.submit(session, team, model.id, OPTIONS)
    session.commit()
    orm = session.get(CompileJob, row.id)
    assert orm is not None

    assert created and not attached_created and again.id == row.id
    assert JobOut.of(row, None) == JobOut.of(orm, None)
    assert JobOut.of(again, None, attached=True).attached


def test_submitting_for_another_teams_model_is_not_found(
    farm: Farm, session: Session, team: Team
) -> None:
    model = add_model(farm, session, team)
    other = make_team(session)

    not_found = raises_service_error("not_found", 404)
    not_found(lambda: jobs.submit(session, other, model.id, OPTIONS))
    not_found(lambda: jobs.submit(session, team, uuid.uuid4(), OPTIONS))
    assert session.execute(select(CompileJob.id)).first() is None
    assert session.get(Model, model.id) is not None
