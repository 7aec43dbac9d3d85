"""The web pages over plain HTTP (no browser): sign-in cookie, CSRF, ownership, errors.

The app runs in process (TestClient) in the embedded mode on tmp_path, with its real
in-process worker.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.api_helpers import form_csrf
from tests.conftest import tiny_model_bytes

WAIT_S = 60.0
QPC_MAGIC = 0x00A1CD7C


@dataclass
class Site:
    client: Any
    app: Any
    key: str
    other_key: str


def new_key(app: Any, team_name: str) -> str:
    from app.domain.services import teams

    with app.state.session_factory() as session:
        team = teams.create_team(session, team_name)
        key, _ = teams.create_api_key(session, team)
        session.commit()
    return key


@pytest.fixture
def site(tmp_path: Path) -> Iterator[Site]:
    from fastapi.testclient import TestClient

    from app.console.serve import create_farm_app
    from app.domain.settings import Settings

    settings = Settings(
        data_dir=tmp_path,
        database_url=f"sqlite:///{tmp_path / 'qpcfarm.db'}",
        broker_url=None,
        blob_store="filesystem",
        require_auth=True,
    )
    app = create_farm_app(settings)
    with TestClient(app, base_url="http://localhost", follow_redirects=False) as client:
        yield Site(client, app, new_key(app, "alpha"), new_key(app, "beta"))


def csrf_of(client: Any) -> str:
    """The CSRF token the sign-in page hands out (as a cookie and in its form)."""
    token = form_csrf(client, "/sign-in")
    if client.cookies.get("qpcfarm_session") is None:  # signed in, it is the session's
        assert client.cookies.get("qpcfarm_csrf") == token
    return token


def signed_in(site: Site, key: str | None = None) -> str:
    client = site.client
    client.cookies.clear()
    csrf = csrf_of(client)
    answer = client.post("/sign-in", data={"api_key": key or site.key, "csrf": csrf})
    assert answer.status_code == 303
    return form_csrf(client, "/")


def submit(site: Site, csrf: str, body: bytes, name: str = "m.onnx", **form: str) -> Any:
    data = {"csrf": csrf, "flags": "", **form}
    files = {"model": (name, body, "application/octet-stream")}
    return site.client.post("/", data=data, files=files)


def error_of(html: str) -> tuple[str, str]:
    code = re.search(r'<strong class="code">([^<]*)</strong>', html)
    message = re.search(r'<span class="message">([^<]*)</span>', html)
    assert code is not None and message is not None, "no error shown"
    return code.group(1), message.group(1)


def wait_done(site: Site, job_id: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while site.client.get(f"/jobs/{job_id}/live").headers.get("X-Poll-Done") != "1":
        assert time.monotonic() < deadline, "the job never finished"
        time.sleep(0.05)


def job_count(site: Site) -> int:
    from sqlalchemy import func, select

    from app.domain.db.models import CompileJob, Model

    with site.app.state.session_factory() as session:
        jobs = session.execute(select(func.count()).select_from(CompileJob)).scalar_one()
        models = session.execute(select(func.count()).select_from(Model)).scalar_one()
    return int(jobs) + int(models)


# -------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("path", ["/", "/jobs/" + str(uuid.uuid4()), "/jobs/not-a-uuid"])
def test_pages_without_the_cookie_redirect_to_sign_in_with_the_way_back(
    site: Site, path: str
) -> None:
    answer = site.client.get(path)
    assert answer.status_code == 303
    assert answer.headers["location"] == "/sign-in?next=" + path


def test_live_fragments_without_the_cookie_answer_401(site: Site) -> None:
    assert site.client.get("/jobs/rows").status_code == 401
    assert site.client.get(f"/jobs/{uuid.uuid4()}/live").status_code == 401


def test_sign_in_opens_a_server_side_session_in_an_httponly_samesite_strict_cookie(
    site: Site,
) -> None:
    csrf = csrf_of(site.client)
    answer = site.client.post(
        "/sign-in", data={"api_key": site.key, "csrf": csrf, "next": "/jobs/x"}
    )
    assert answer.status_code == 303 and answer.headers["location"] == "/jobs/x"
    cookie = answer.headers["set-cookie"]
    assert "qpcfarm_session=" in cookie and site.key not in cookie  # the key stays out
    lowered = cookie.lower()
    assert "httponly" in lowered and "samesite=strict" in lowered and "path=/" in lowered
    assert "max-age=43200" in lowered and "secure" not in lowered  # plain http here


def test_sign_in_with_a_wrong_key_says_so_and_sets_no_cookie(site: Site) -> None:
    csrf = csrf_of(site.client)
    answer = site.client.post("/sign-in", data={"api_key": "qpf_nope", "csrf": csrf})
    assert answer.status_code == 401
    assert error_of(answer.text)[0] == "unauthorized"
    assert "qpcfarm_session" not in answer.headers.get("set-cookie", "")


def test_sign_in_never_sends_the_browser_to_another_site(site: Site) -> None:
    for target in ("https://evil.example/", "//evil.example/x", "/\\evil.example"):
        csrf = csrf_of(site.client)
        answer = site.client.post(
            "/sign-in", data={"api_key": site.key, "csrf": csrf, "next": target}
        )
        assert answer.headers["location"] == "/"


def test_forms_without_the_csrf_token_are_refused_and_change_nothing(site: Site) -> None:
    csrf_of(site.client)
    refused = site.client.post("/sign-in", data={"api_key": site.key, "csrf": "forged" * 5})
    assert refused.status_code == 403 and error_of(refused.text)[0] == "csrf_failed"

    signed_in(site)
    answer = submit(site, "wrong-token-wrong-token", tiny_model_bytes())
    assert answer.status_code == 403
    assert error_of(answer.text)[0] == "csrf_failed"
    assert job_count(site) == 0


def test_a_bad_flag_is_shown_with_its_code_and_stores_nothing(site: Site) -> None:
    csrf = signed_in(site)
    answer = submit(site, csrf, tiny_model_bytes(), flags="-aic-num-cores=99")
    assert answer.status_code == 422
    code, message = error_of(answer.text)
    assert code == "invalid_option" and "-aic-num-cores" in message
    assert job_count(site) == 0


def test_an_upload_without_a_file_asks_for_one(site: Site) -> None:
    csrf = signed_in(site)
    answer = submit(site, csrf, b"", name="")
    assert answer.status_code == 422
    assert error_of(answer.text)[0] == "no_file"


def test_the_common_fields_become_compile_flags(site: Site) -> None:
    csrf = signed_in(site)
    answer = submit(
        site, csrf, tiny_model_bytes(0.21), cores="2", fp16="1", device="aic100-standard"
    )
    assert answer.status_code == 303
    job_id = answer.headers["location"].split("submitted=")[1]
    page = site.client.get(f"/jobs/{job_id}").text
    flags = re.search(r'<dt>Flags</dt><dd class="flags" id="job-flags">(.*?)</dd>', page)
    assert flags is not None
    assert set(re.findall(r'<code class="flag">([^<]*)</code>', flags.group(1))) == {
        "-aic-device=aic100-standard",
        "-aic-num-cores=2",
        "-convert-to-fp16",
    }


def test_another_teams_job_is_not_found(site: Site) -> None:
    csrf = signed_in(site)
    job_id = submit(site, csrf, tiny_model_bytes()).headers["location"].split("=")[1]
    signed_in(site, site.other_key)
    assert site.client.get(f"/jobs/{job_id}").status_code == 404
    assert site.client.get(f"/jobs/{job_id}/live").status_code == 404
    assert job_id not in site.client.get("/jobs/rows").text
    csrf = form_csrf(site.client, "/")
    validate = site.client.post(f"/jobs/{job_id}/validate", data={"csrf": csrf})
    assert validate.status_code == 404


def test_the_download_link_takes_the_cookie_on_get_but_the_api_wont_change_state_on_it(
    site: Site,
) -> None:
    csrf = signed_in(site)
    job_id = submit(site, csrf, tiny_model_bytes(0.3)).headers["location"].split("=")[1]
    wait_done(site, job_id)
    page = site.client.get(f"/jobs/{job_id}").text
    href = re.search(r'id="download" href="([^"]+)"', page)
    assert href is not None
    download = site.client.get(href.group(1))
    assert download.status_code == 200
    assert int.from_bytes(download.content[:4], "little") == QPC_MAGIC

    qpc_id = href.group(1).split("/")[3]
    post = site.client.post(f"/v1/qpcs/{qpc_id}/validate", json={"device": "aic100-standard"})
    assert post.status_code == 401
    site.client.cookies.clear()
    assert site.client.get(href.group(1)).status_code == 401


def test_validation_shows_one_line_per_check_and_an_unknown_device_is_an_error(
    site: Site,
) -> None:
    csrf = signed_in(site)
    job_id = submit(site, csrf, tiny_model_bytes(0.4)).headers["location"].split("=")[1]
    wait_done(site, job_id)
    answer = site.client.post(f"/jobs/{job_id}/validate", data={"csrf": csrf, "device": "aic080"})
    assert answer.status_code == 303
    page = site.client.get(answer.headers["location"]).text
    lines = re.findall(r'<li class="check (pass|fail)" data-check="([^"]+)"', page)
    assert ("pass", "container") in lines and ("pass", "device-cores") in lines

    bad = site.client.post(f"/jobs/{job_id}/validate", data={"csrf": csrf, "device": "tpu9"})
    assert bad.status_code == 422
    assert error_of(bad.text)[0] == "unknown_device"


def test_a_queued_job_can_be_cancelled_from_its_page(tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from app.domain.settings import Settings
    from app.main import create_app

    class HeldQueue:  # never runs anything: the job stays queued
        def enqueue(self, job_id: uuid.UUID, kind: str = "compile") -> None: ...

        def ping(self) -> bool:
            return True

        def close(self) -> None: ...

    settings = Settings(
        data_dir=tmp_path,
        database_url=f"sqlite:///{tmp_path / 'qpcfarm.db'}",
        broker_url=None,
        blob_store="filesystem",
    )
    app = create_app(settings, queue=HeldQueue())
    with TestClient(app, base_url="http://localhost", follow_redirects=False) as client:
        site = Site(client, app, new_key(app, "gamma"), "")
        csrf = signed_in(site)
        job_id = submit(site, csrf, tiny_model_bytes()).headers["location"].split("=")[1]
        assert 'data-status="queued"' in client.get("/jobs/rows").text
        answer = client.post(f"/jobs/{job_id}/cancel", data={"csrf": csrf})
        assert answer.status_code == 303
        assert 'id="job-status">cancelled<' in client.get(f"/jobs/{job_id}").text
        again = client.post(f"/jobs/{job_id}/cancel", data={"csrf": csrf})
        assert again.status_code == 409 and error_of(again.text)[0] == "not_cancellable"


def test_sign_out_forgets_the_key(site: Site) -> None:
    csrf = signed_in(site)
    assert site.client.get("/").status_code == 200
    answer = site.client.post("/sign-out", data={"csrf": csrf})
    assert answer.status_code == 303 and answer.headers["location"] == "/sign-in"
    assert site.client.get("/").status_code == 303


def test_metrics_flatten_to_rows_and_record_lists_to_tables() -> None:
    from app.web.views import split_metrics

    shown = split_metrics(
        {
            "num_cores": 2,
            "memory_traffic": {"total": {"ddr_read_bytes": 1234567}},
            "per_core": [{"core": "c00", "busy": 1.5}, {"core": "c01", "busy": 2}],
            "estimated": True,
        }
    )
    assert [(r.name, r.value) for r in shown.rows] == [
        ("num_cores", "2"),
        ("memory_traffic.total.ddr_read_bytes", "1.18 MiB"),
        ("estimated", "true"),
    ]
    (table,) = shown.tables
    assert table.name == "per_core" and table.columns == ["Core", "Busy"]
    assert table.rows == [["c00", "1.5"], ["c01", "2"]]


def test_metrics_are_grouped_with_units_and_names_a_person_reads() -> None:
    from app.web.views import split_metrics

    shown = split_metrics(
        {
            "estimated_latency_us": 4.4491,
            "hmx_utilization_percent": 3.25,
            "vtcm_max_used": 158080,
            "estimated_cycles": 4243,
            "memory_traffic": {"total": {"noc_bytes": 512}},
            "a_new_figure": 7,
            "specializations": {"prefill": {"estimated_latency_us": 1.0}},
        }
    )
    groups = {g.title: [(r.label, r.value, r.exact) for r in g.rows] for g in shown.groups}
    assert groups == {
        "Latency and throughput": [
            ("Estimated latency", "4.449 µs", ""),
            ("Estimated cycles", "4,243", ""),
        ],
        "Compute": [("HMX utilization", "3.2 %", "")],
        "DDR traffic": [("NoC", "512 B", "")],
        "Memory": [("VTCM max used", "154.38 KiB", "158,080 bytes")],
        "Other": [("A new figure", "7", "")],
    }


def test_pass_times_are_a_tree_whose_total_counts_the_stages() -> None:
    from app.web.views import pass_times

    times = {"import": 0.5, "graph-passes": 0.25, "graph-passes/fold": 0.2, "lower": 0.25}
    tree = pass_times(times)
    assert [(r.name, r.depth) for r in tree.rows] == [
        ("import", 0),
        ("graph-passes", 0),
        ("fold", 1),
        ("lower", 0),
    ]
    assert tree.total_ms == "1,000.000" and tree.rows[2].share == "20.0"


@pytest.mark.parametrize(
    ("status", "stage", "shown"),
    [
        ("queued", None, "waiting for a worker"),
        ("running", "graph-passes", "optimising the graph"),
        ("failed", "claimed", "failed while starting"),
        ("failed", "import", "failed while importing the model"),
        ("succeeded", "done", "done"),
        ("cancelled", "lower", "cancelled while lowering to kernels"),
    ],
)
def test_stages_are_shown_in_words(status: str, stage: str | None, shown: str) -> None:
    from app.domain.stages import describe_stage

    assert describe_stage(status, stage) == shown


def test_the_api_docs_and_their_assets_are_served_by_the_farm(site: Site) -> None:
    for path in ("/docs", "/redoc"):
        page = site.client.get(path)
        assert page.status_code == 200
        csp = page.headers["content-security-policy"]
        scripts = csp.split("script-src")[1].split(";")[0]
        assert "http" not in csp and scripts.strip() == "'self'"
        sources = re.findall(r'(?:src|href)="([^"]+)"', page.text)
        assert sources and all(s.startswith(("/docs/assets/", "/web/static/")) for s in sources)
        assert "<script>" not in page.text
    for name in ("swagger-ui-bundle.js", "swagger-ui.css", "redoc.standalone.js"):
        asset = site.client.get(f"/docs/assets/{name}")
        assert asset.status_code == 200 and len(asset.content) > 100_000, name
    assert site.client.get("/docs/assets/core.py").status_code == 404


def test_a_recompile_refused_by_the_queue_quota_says_when_to_retry_as_the_api_does(
    site: Site,
) -> None:
    from sqlalchemy import update

    from app.domain.db.models import Team

    csrf = signed_in(site)
    answer = submit(site, csrf, tiny_model_bytes())
    assert answer.status_code == 303
    job_id = answer.headers["location"].split("submitted=")[1].split("&")[0]
    wait_done(site, job_id)
    with site.app.state.session_factory() as session:
        session.execute(update(Team).where(Team.name == "alpha").values(max_queued_jobs=0))
        session.commit()
    before = job_count(site)
    refused = site.client.post(
        f"/jobs/{job_id}/recompile-for-profile", data={"csrf": csrf}, follow_redirects=False
    )
    assert refused.status_code == 429
    assert refused.headers["Retry-After"] == "30"
    assert error_of(refused.text)[0] == "queue_quota"
    assert job_count(site) == before


def test_a_quota_refusal_is_shown_as_the_api_says_it_and_the_team_page_shows_usage(
    site: Site,
) -> None:
    from sqlalchemy import update

    from app.domain.db.models import Team

    with site.app.state.session_factory() as session:
        session.execute(
            update(Team).where(Team.name == "alpha").values(max_stored_bytes=10, max_queued_jobs=4)
        )
        session.commit()
    csrf = signed_in(site)
    answer = submit(site, csrf, tiny_model_bytes())
    assert answer.status_code == 413
    code, message = error_of(answer.text)
    assert code == "storage_quota"
    assert "limit is 10" in message
    assert job_count(site) == 0
    page = site.client.get("/team")
    assert page.status_code == 200
    assert re.search(r'id="usage-stored"><td>[^<]*</td><td>0</td><td>10</td>', page.text)
    assert re.search(r'id="usage-queued"><td>[^<]*</td><td>0</td><td>4</td>', page.text)
    assert "no limit" in page.text  # running jobs
