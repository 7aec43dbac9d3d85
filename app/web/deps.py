"""Who is asking and what they may see, for the pages: FastAPI dependencies, written once.

A page needs a signed-in browser (`PageTeam`: else a redirect to the sign-in page, back here
after) and, at `/jobs/{id}`, `/profiles/{id}`, `/sweeps/{id}`, the team's own job, profile or
sweep (`PageJob`, `PageProfile`, `PageSweep`: a malformed id, a missing one or another team's
is the same 404 page). The polled fragments (`.../live`, `/jobs/rows`) answer a bare 401 or
404 instead (`Fragment...`), which the poller stops on. The dependencies raise; the answers
are made by the handlers `app.web.errors` installs.
"""

from __future__ import annotations

import uuid
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session

from app.api.deps import SessionDep, SettingsDep
from app.domain.db.models import CompileJob, ProfileJob, Sweep, Team
from app.domain.services import jobs, profiles, sweeps
from app.domain.services.errors import ServiceError
from app.web import auth


class SignInRequired(Exception):
    """No signed-in browser: a page redirects to the sign-in page, a fragment answers 401."""

    def __init__(self, fragment: bool) -> None:
        super().__init__("sign in")
        self.fragment = fragment


class PageNotFound(Exception):
    """Not the team's (or no such) `what`: a page shows the 404 page, a fragment answers 404."""

    def __init__(self, team: Team, what: str, ident: str, fragment: bool) -> None:
        super().__init__(f"{what} {ident} not found")
        self.team, self.what, self.ident, self.fragment = team, what, ident, fragment


def parse_uuid(text: str) -> uuid.UUID | None:
    try:
        return uuid.UUID(text)
    except ValueError:
        return None


def find_job(session: Session, team: Team, job_id: str) -> CompileJob | None:
    """The team's job of that id; None for a malformed id, a missing or another team's job."""
    ident = parse_uuid(job_id)
    if ident is None:
        return None
    try:
        return jobs.get_job(session, team, ident)
    except ServiceError:
        return None


def find_profile(session: Session, team: Team, profile_id: str) -> ProfileJob | None:
    ident = parse_uuid(profile_id)
    if ident is None:
        return None
    try:
        return profiles.get_profile(session, team, ident)
    except ServiceError:
        return None


def find_sweep(session: Session, team: Team, sweep_id: str) -> Sweep | None:
    ident = parse_uuid(sweep_id)
    if ident is None:
        return None
    try:
        return sweeps.get_sweep(session, team, ident)
    except ServiceError:
        return None


def page_team(request: Request, session: SessionDep, settings: SettingsDep) -> Team:
    team = auth.web_team(request, session, settings)
    if team is None:
        raise SignInRequired(fragment=False)
    return team


def fragment_team(request: Request, session: SessionDep, settings: SettingsDep) -> Team:
    team = auth.web_team(request, session, settings)
    if team is None:
        raise SignInRequired(fragment=True)
    return team


PageTeam = Annotated[Team, Depends(page_team)]
FragmentTeam = Annotated[Team, Depends(fragment_team)]


def page_job(job_id: str, team: PageTeam, session: SessionDep) -> CompileJob:
    job = find_job(session, team, job_id)
    if job is None:
        raise PageNotFound(team, "job", job_id, fragment=False)
    return job


def fragment_job(job_id: str, team: FragmentTeam, session: SessionDep) -> CompileJob:
    job = find_job(session, team, job_id)
    if job is None:
        raise PageNotFound(team, "job", job_id, fragment=True)
    return job


def page_profile(profile_id: str, team: PageTeam, session: SessionDep) -> ProfileJob:
    profile = find_profile(session, team, profile_id)
    if profile is None:
        raise PageNotFound(team, "profile", profile_id, fragment=False)
    return profile


def fragment_profile(profile_id: str, team: FragmentTeam, session: SessionDep) -> ProfileJob:
    profile = find_profile(session, team, profile_id)
    if profile is None:
        raise PageNotFound(team, "profile", profile_id, fragment=True)
    return profile


def page_sweep(sweep_id: str, team: PageTeam, session: SessionDep) -> Sweep:
    sweep = find_sweep(session, team, sweep_id)
    if sweep is None:
        raise PageNotFound(team, "sweep", sweep_id, fragment=False)
    return sweep


def fragment_sweep(sweep_id: str, team: FragmentTeam, session: SessionDep) -> Sweep:
    sweep = find_sweep(session, team, sweep_id)
    if sweep is None:
        raise PageNotFound(team, "sweep", sweep_id, fragment=True)
    return sweep


PageJob = Annotated[CompileJob, Depends(page_job)]
FragmentJob = Annotated[CompileJob, Depends(fragment_job)]
PageProfile = Annotated[ProfileJob, Depends(page_profile)]
FragmentProfile = Annotated[ProfileJob, Depends(fragment_profile)]
PageSweep = Annotated[Sweep, Depends(page_sweep)]
FragmentSweep = Annotated[Sweep, Depends(fragment_sweep)]
