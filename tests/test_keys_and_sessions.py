"""Keys, browser sessions, security headers and the production guard.

- team admins list, create and revoke their team's keys over `/v1/keys` (and operators with
  `qpcfarm admin list-keys` / `revoke-key`); a revoked key is refused within
  `TEAM_CACHE_TTL_S` and its web sessions end at once;
- a signed-in browser holds a random session token, never the key; the cookie is HttpOnly,
  SameSite=Strict, and Secure over HTTPS;
- every answer carries CSP, X-Frame-Options, nosniff and Referrer-Policy;
- `environment=production` refuses default secrets and an open bind without TLS.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.api.deps import TEAM_CACHE_TTL_S
from app.domain.settings import Settings
from tests.api_helpers import LiveServer, live_server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server("sqlite", tmp_path_factory.mktemp("keys")) as running:
        yield running


def admin_key(server: LiveServer) -> str:
    from app.domain.services import teams

    with server.state.session_factory() as session:
        team = teams.create_team(session, f"team-{time.monotonic_ns()}")
        key, _ = teams.create_api_key(session, team, "boss", admin=True)
        session.commit()
    return key


def test_a_team_admin_creates_lists_and_revokes_keys_and_a_revoked_key_stops_working(
    server: LiveServer,
) -> None:
    with server.client(admin_key(server)) as admin:
        made = admin.post("/v1/keys", json={"name": "ci"})
        assert made.status_code == 201, made.text
        key = made.json()["key"]
        with server.client(key) as ci:
            assert ci.get("/v1/models").status_code == 200
            listed = admin.get("/v1/keys").json()
            assert [k["name"] for k in listed["items"]] == ["boss", "ci"]
            assert all("key" not in k for k in listed["items"])

            revoked = admin.post(f"/v1/keys/{made.json()['prefix']}/revoke")
            assert revoked.status_code == 200 and revoked.json()["revoked_at"]
            time.sleep(TEAM_CACHE_TTL_S + 0.1)  # the longest any process may remember it
            refused = ci.get("/v1/models")
            assert (refused.status_code, refused.json()["code"]) == (401, "unauthorized")


def test_only_team_admins_manage_keys_and_only_their_own_teams(server: LiveServer) -> None:
    with server.client(server.new_key()) as member, server.client(admin_key(server)) as admin:
        for answer in (member.get("/v1/keys"), member.post("/v1/keys", json={})):
            assert (answer.status_code, answer.json()["code"]) == (403, "forbidden")
        theirs = admin.post("/v1/keys", json={}).json()
        with server.client(admin_key(server)) as other_admin:
            stranger = other_admin.post(f"/v1/keys/{theirs['id']}/revoke")
            assert (stranger.status_code, stranger.json()["code"]) == (404, "not_found")
        assert admin.post("/v1/keys", json={"bogus": 1}).status_code == 422


def test_every_answer_carries_the_security_headers(server: LiveServer) -> None:
    with server.client() as anonymous:
        for path in ("/sign-in", "/v1/models", "/healthz", "/docs", "/web/static/poll.js"):
            headers = anonymous.get(path).headers
            assert headers["x-frame-options"] == "DENY", path
            assert headers["x-content-type-options"] == "nosniff", path
            assert headers["referrer-policy"] == "no-referrer", path
            assert "frame-ancestors 'none'" in headers["content-security-policy"], path
        page_csp = anonymous.get("/sign-in").headers["content-security-policy"]
        assert "script-src 'self';" in page_csp  # no inline script on the pages
        assert "<script>" not in anonymous.get("/sign-in").text


# ---------------------------------------------------------------------------- web sessions


@pytest.fixture
def site(tmp_path: Path) -> Iterator[Any]:
    from fastapi.testclient import TestClient

    from app.console.serve import create_farm_app

    settings = Settings(
        data_dir=tmp_path, database_url=f"sqlite:///{tmp_path / 'q.db'}", require_auth=True
    )
    app = create_farm_app(settings)
    with TestClient(app, base_url="https://farm.example", follow_redirects=False) as client:
        yield client


def sign_in(client: Any, key: str) -> httpx.Response:
    page = client.get("/sign-in")
    csrf = re.search(r'name="csrf" value="([^"]+)"', page.text)
    assert csrf is not None
    answer: httpx.Response = client.post("/sign-in", data={"api_key": key, "csrf": csrf.group(1)})
    assert answer.status_code == 303, answer.text
    return answer


def key_of(client: Any) -> tuple[str, str]:
    from app.domain.services import teams

    with client.app.state.session_factory() as session:
        team = teams.create_team(session, "web")
        key, row = teams.create_api_key(session, team)
        session.commit()
    return key, str(row.id)


def test_a_browser_session_holds_a_token_not_the_key_and_is_secure_over_https(
    site: Any,
) -> None:
    key, _ = key_of(site)
    cookie = sign_in(site, key).headers["set-cookie"]
    assert cookie.startswith("qpcfarm_session=") and key not in cookie
    assert "secure" in cookie.lower() and "httponly" in cookie.lower()
    assert site.get("/").status_code == 200
    assert site.get("/v1/models").status_code == 200  # the download links' GETs
    assert site.post("/v1/keys", json={}).status_code == 401  # never a write on a cookie
    assert "strict-transport-security" in site.get("/").headers


def test_revoking_a_key_ends_its_browser_sessions_and_sign_out_ends_one(site: Any) -> None:
    from app.domain.services import teams

    key, key_id = key_of(site)
    sign_in(site, key)
    token = site.cookies.get("qpcfarm_session")
    with site.app.state.session_factory() as session:
        teams.revoke_key(session, teams.find_key(session, key_id))
        session.commit()
    assert site.get("/").status_code == 303  # back to sign-in

    site.cookies.clear()
    with site.app.state.session_factory() as session:
        team = teams.get_team_by_name(session, "web")
        assert team is not None
        fresh, _ = teams.create_api_key(session, team)
        session.commit()
    sign_in(site, fresh)
    form = re.search(r'name="csrf" value="([^"]+)"', site.get("/").text)
    assert form is not None
    csrf = form.group(1)  # the session's own token (rotated at sign-in)
    kept = site.cookies.get("qpcfarm_session")
    assert kept != token
    assert site.post("/sign-out", data={"csrf": csrf}).status_code == 303
    site.cookies.clear()
    site.cookies.set("qpcfarm_session", kept)
    assert site.get("/").status_code == 303  # the old token opens nothing


# --------------------------------------------------------------------------------- the CLI


@pytest.fixture
def embedded_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    from app.domain.settings import get_settings

    for name in ("QPCFARM_DATABASE_URL", "QPCFARM_BROKER_URL", "QPCFARM_BLOB_STORE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("QPCFARM_DATA_DIR", str(tmp_path / "data"))
    get_settings.cache_clear()
    yield tmp_path / "data"
    get_settings.cache_clear()


def test_admin_lists_and_revokes_keys(
    embedded_env: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from app.console.cli import main

    assert main(["admin", "create-team", "vision", "--init"]) == 0
    assert main(["admin", "create-key", "--team", "vision", "--name", "ci", "--admin"]) == 0
    key = capsys.readouterr().out.strip()
    assert main(["admin", "list-keys", "--team", "vision"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"vision\t{key[:12]}\t") and "\tadmin\t" in line
    assert key not in line and line.endswith("active  ci")
    assert main(["admin", "revoke-key", key[:12]]) == 0
    assert main(["admin", "list-keys"]) == 0
    assert "\trevoked " in capsys.readouterr().out
    assert main(["admin", "revoke-key", "qpf_nosuchkey"]) == 1


# -------------------------------------------------------------------------- production


def production(**values: Any) -> Settings:
    return Settings(environment="production", **values)


def test_production_refuses_default_secrets_open_binds_without_tls_and_no_auth() -> None:
    from app.console.cli import production_problems

    fit = production(database_url="postgresql+psycopg://farm:s3cr3t-Zq@db/farm")
    assert production_problems(fit, "127.0.0.1", tls=False) == []
    assert production_problems(fit, "0.0.0.0", tls=True) == []
    behind_proxy = production(
        database_url="postgresql+psycopg://farm:s3cr3t-Zq@db/farm", forwarded_allow_ips="10.0.0.2"
    )
    assert production_problems(behind_proxy, "0.0.0.0", tls=False) == []

    compose = production(database_url="postgresql+psycopg://qpcfarm:qpcfarm@postgres/qpcfarm")
    (problem,) = production_problems(compose, "127.0.0.1", tls=False)
    assert "database password" in problem
    (problem,) = production_problems(fit, "0.0.0.0", tls=False)
    assert "TLS" in problem and "QPCFARM_FORWARDED_ALLOW_IPS" in problem
    open_farm = production(database_url=fit.database_url, require_auth=False)
    assert "QPCFARM_REQUIRE_AUTH" in production_problems(open_farm, "127.0.0.1", tls=False)[0]


def test_serve_in_production_with_a_default_secret_exits_before_listening(
    embedded_env: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from app.console.cli import main
    from app.domain.settings import get_settings

    monkeypatch.setenv("QPCFARM_ENVIRONMENT", "production")
    monkeypatch.setenv("QPCFARM_DATABASE_URL", "postgresql+psycopg://qpcfarm:qpcfarm@h/db")
    get_settings.cache_clear()
    assert main(["serve", "--host", "0.0.0.0"]) == 1
    err = capsys.readouterr().err
    assert "refusing to start in production" in err and "default one" in err and "TLS" in err
