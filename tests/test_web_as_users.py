"""The web pages as a new user meets them, over plain HTTP (the browser's view of widths is in
tests/test_web.py): what a submit is announced as, a sweep's compiles labelled and filtered
in the jobs list, the device the estimates are for, a sweep's progress bar and base flags,
where the sign-in page says the key is, and a page (not JSON) for a browser's 404.

The app runs in process (TestClient) in the embedded mode on tmp_path; jobs are held in the
queue (never run) unless a test runs them, so what a page says is decided by the test.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import tiny_model, tiny_model_bytes


class HeldQueue:
    """Keeps job ids and runs nothing: a job stays queued until the test says otherwise."""

    def __init__(self) -> None:
        self.held: list[tuple[uuid.UUID, str]] = []

    def enqueue(self, job_id: uuid.UUID, kind: str = "compile") -> None:
        self.held.append((job_id, kind))

    def ping(self) -> bool:
        return True

    def close(self) -> None: ...


@dataclass
class Site:
    client: Any
    app: Any
    key: str
    queue: HeldQueue


@pytest.fixture
def site(tmp_path: Path) -> Iterator[Site]:
    from fastapi.testclient import TestClient

    from app.domain.services import teams
    from app.domain.settings import Settings
    from app.main import create_app

    settings = Settings(
        data_dir=tmp_path,
        database_url=f"sqlite:///{tmp_path / 'qpcfarm.db'}",
        broker_url=None,
        blob_store="filesystem",
        require_auth=True,
    )
    queue = HeldQueue()
    app = create_app(settings, queue=queue)
    with TestClient(app, base_url="http://localhost", follow_redirects=False) as client:
        with app.state.session_factory() as session:
            team = teams.create_team(session, "users")
            key, _ = teams.create_api_key(session, team)
            session.commit()
        yield Site(client, app, key, queue)


def sign_in(site: Site) -> str:
    """Signs in and returns the form token of the signed-in session (it changes at sign-in)."""
    page = site.client.get("/sign-in")
    found = re.search(r'name="csrf" value="([^"]+)"', page.text)
    assert found is not None
    answer = site.client.post("/sign-in", data={"api_key": site.key, "csrf": found.group(1)})
    assert answer.status_code == 303
    signed_in = re.search(r'name="csrf" value="([^"]+)"', site.client.get("/").text)
    assert signed_in is not None
    return signed_in.group(1)


def upload(site: Site, csrf: str, body: bytes, **form: str) -> Any:
    files = {"model": ("m.onnx", body, "application/octet-stream")}
    return site.client.post("/", data={"csrf": csrf, "flags": "", **form}, files=files)


def notice(html: str) -> str:
    found = re.search(r'<div class="notice" id="notice"[^>]*>(.*?)</div>', html, re.S)
    assert found is not None, "no notice"
    return " ".join(re.sub(r"<[^>]+>", "", found.group(1)).split())


def run_job_now(site: Site, job_id: str) -> None:
    """Run a held job in this thread with the worker's own code."""
    from worker.runner import process_job

    state = site.app.state
    status = process_job(
        uuid.UUID(job_id), session_factory=state.session_factory, store=state.store,
        worker_name="test",
    )  # fmt: skip
    assert status is not None and status.value == "succeeded"


def api(site: Site) -> dict[str, str]:
    return {"Authorization": f"Bearer {site.key}"}


class Tree(HTMLParser):
    """Each element's tag and the tags of its ancestors, by id."""

    VOID = {"br", "img", "input", "meta", "link", "hr", "col", "source", "wbr"}

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.ancestors: dict[str, list[str]] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        ident = dict(attrs).get("id")
        if ident:
            self.ancestors[ident] = list(self.stack)
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag: str) -> None:
        if tag in self.stack:
            while self.stack.pop() != tag:
                pass


# ------------------------------------------------------------------------- the notice


def test_a_new_upload_is_announced_as_new_even_once_a_worker_runs_it(site: Site) -> None:
    from worker import compile_jobs

    csrf = sign_in(site)
    answer = upload(site, csrf, tiny_model_bytes(0.31))
    assert answer.status_code == 303 and "attached" not in answer.headers["location"]
    job_id = answer.headers["location"].split("submitted=")[1]
    # A worker claimed it before the browser followed the redirect: the job is running.
    with site.app.state.session_factory() as session:
        assert compile_jobs.claim(session, uuid.UUID(job_id), "w") is not None
        session.commit()
    said = notice(site.client.get(answer.headers["location"]).text)
    assert "already on its way" not in said and "identical" not in said
    assert said.startswith("m.onnx was submitted as job") and "starting" in said


def test_an_upload_identical_to_a_job_in_flight_says_it_joined_that_job(site: Site) -> None:
    csrf = sign_in(site)
    first = upload(site, csrf, tiny_model_bytes(0.32)).headers["location"]
    second = upload(site, csrf, tiny_model_bytes(0.32)).headers["location"]
    job_id = first.split("submitted=")[1]
    assert second == f"/?submitted={job_id}&attached=1"
    said = notice(site.client.get(second).text)
    assert "already on its way" in said and job_id[:8] in said
    assert "queued as" in notice(site.client.get(first).text)


# ------------------------------------------------------------- sweeps in the jobs list


def start_sweep(site: Site) -> tuple[str, list[str]]:
    """A brute sweep over the batch size and cores (4 compiles), base flag -convert-to-fp16;
    (sweep id, its job ids)."""
    model = site.client.post(
        "/v1/models",
        headers=api(site),
        files={"file": ("s.onnx", tiny_model(scale=0.44, batch="N").SerializeToString())},
    )
    assert model.status_code == 201, model.text
    body = {
        "model_id": model.json()["id"],
        "space": {"parameters": {"batchsize": [1, 2], "cores": [1, 2]}},
        "base_flags": ["-convert-to-fp16"],
    }
    created = site.client.post("/v1/sweeps", headers=api(site), json=body)
    assert created.status_code == 201, created.text
    sweep = created.json()
    return sweep["id"], [r["job_id"] for r in sweep["results"] if r["job_id"]]


def row_ids(html: str) -> set[str]:
    return set(re.findall(r'<tr id="job-([0-9a-f-]+)" class="job-row"', html))


def test_the_jobs_list_shows_own_compiles_by_default_and_a_sweeps_labelled_on_request(
    site: Site,
) -> None:
    csrf = sign_in(site)
    own = upload(site, csrf, tiny_model_bytes(0.33)).headers["location"].split("submitted=")[1]
    sweep_id, sweep_jobs = start_sweep(site)
    assert len(sweep_jobs) == 4

    page = site.client.get("/").text
    assert row_ids(page) == {own}
    assert "Your compiles (1)" in page and "Sweeps&#39; compiles (4)" in page and "All (5)" in page
    shown = site.client.get("/?show=sweep").text
    assert row_ids(shown) == set(sweep_jobs)
    labels = re.findall(r'<a class="badge sweep" href="/sweeps/([0-9a-f-]+)"', shown)
    assert labels == [sweep_id] * 4
    assert row_ids(site.client.get("/?show=all").text) == {own, *sweep_jobs}
    # The live rows keep the filter the page was opened with.
    assert 'data-poll-url="/jobs/rows?show=sweep"' in shown
    assert row_ids(site.client.get("/jobs/rows?show=sweep").text) == set(sweep_jobs)
    assert row_ids(site.client.get("/jobs/rows").text) == {own}


def test_flags_are_listed_one_element_each_so_a_line_breaks_only_between_flags(
    site: Site,
) -> None:
    csrf = sign_in(site)
    upload(site, csrf, tiny_model_bytes(0.34), flags="-aic-num-cores=2 -convert-to-fp16")
    page = site.client.get("/").text
    cell = re.search(r'<td class="flags">(.*?)</td>', page, re.S)
    assert cell is not None
    assert re.findall(r'<code class="flag">([^<]*)</code>', cell.group(1)) == [
        "-aic-num-cores=2",
        "-convert-to-fp16",
    ]
    css = site.client.get("/web/static/web.css").text
    assert re.search(r"code\.flag \{[^}]*white-space: nowrap", css)


# ---------------------------------------------------------------------------- the device


def test_the_form_and_the_job_page_name_the_device_the_estimates_are_for(site: Site) -> None:
    csrf = sign_in(site)
    form = site.client.get("/").text
    assert '<option value="">AIC100 Pro (aic100-pro): the default</option>' in form
    assert "estimates" in re.sub(r"\s+", " ", form.split('id="device-hint"')[1][:300])

    default = upload(site, csrf, tiny_model_bytes(0.35)).headers["location"].split("=")[1]
    chosen = upload(site, csrf, tiny_model_bytes(0.36), device="aic100-standard")
    chosen_id = chosen.headers["location"].split("=")[1]
    run_job_now(site, default)
    page = site.client.get(f"/jobs/{default}").text
    device = re.search(r'<dd id="job-device" data-device="([^"]+)">(.*?)</dd>', page, re.S)
    assert device is not None and device.group(1) == "aic100-pro"
    words = " ".join(re.sub(r"<[^>]+>", "", device.group(2)).split())
    assert words.startswith("AIC100 Pro (aic100-pro)") and "the default" in words
    assert "estimates below are for this device" in words
    assert "(estimated for AIC100 Pro (aic100-pro))" in page
    other = site.client.get(f"/jobs/{chosen_id}").text
    assert 'data-device="aic100-standard"' in other and "the default" not in other


# ------------------------------------------------------------------------- the metrics


def test_list_metrics_become_a_count_that_opens_into_a_list() -> None:
    from app.web.views import split_metrics

    nodes = [f"/layer{i}/conv_{i}" for i in range(300)]
    shown = split_metrics({"precision": {"fp16": {"kernels": 57, "nodes": nodes}, "fp32": {}}})
    rows = {r.name: r for r in shown.rows}
    listed = rows["precision.fp16.nodes"]
    assert listed.value == "300 nodes" and listed.label == "fp16 nodes"
    assert list(listed.items) == nodes
    assert rows["precision.fp16.kernels"].label == "fp16 kernels"
    assert split_metrics({"some_list": []}).rows[0].value == "none"


# ------------------------------------------------------------------------------ sweeps


def test_the_sweep_page_shows_a_progress_bar_outside_a_paragraph_and_the_real_base_flags(
    site: Site,
) -> None:
    sign_in(site)
    sweep_id, sweep_jobs = start_sweep(site)
    for job_id in sweep_jobs[:2]:
        run_job_now(site, job_id)
    page = site.client.get(f"/sweeps/{sweep_id}").text
    tree = Tree()
    tree.feed(page)
    assert "p" not in tree.ancestors["sweep-bar"] and "span" not in tree.ancestors["sweep-bar"]
    bar = re.search(r'id="sweep-bar"[^>]*><div style="width: (\d+)%"', page)
    assert bar is not None and bar.group(1) == "50"  # 2 of 4 compiles done
    flags = re.search(r'<span id="sweep-base-flags">(.*?)</span>', page, re.S)
    assert flags is not None
    assert re.findall(r'<code class="flag">([^<]*)</code>', flags.group(1)) == [
        "-convert-to-fp16"
    ]  # not the first group's -batchsize=1
    view = site.client.get(f"/v1/sweeps/{sweep_id}", headers=api(site)).json()
    assert view["base_flags"] == ["-convert-to-fp16"]


# ----------------------------------------------------------------------------- sign in


def test_the_embedded_sign_in_page_points_to_the_saved_key_file(site: Site) -> None:
    page = site.client.get("/sign-in").text
    hint = re.search(r'<p id="key-hint">(.*?)</p>', page, re.S)
    assert hint is not None
    key_file = str(site.app.state.settings.data_dir / "api-key")
    assert f"<code>{key_file}</code>" in hint.group(1)


def test_the_key_hint_names_the_relative_data_folder_and_none_on_a_farm() -> None:
    from app.domain.settings import Settings
    from app.web.views import key_hint

    assert key_hint(Settings(data_dir=Path("./qpcfarm-data"), broker_url=None)) == (
        "./qpcfarm-data/api-key"
    )
    farm = Settings(
        database_url="postgresql+psycopg://farm@db/farm", broker_url="redis://broker:6379/0"
    )
    assert key_hint(farm) == ""


# --------------------------------------------------------------------------------- 404


def test_a_browser_gets_a_page_for_an_unknown_address_and_api_clients_keep_json(
    site: Site,
) -> None:
    browser = {"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"}
    page = site.client.get("/no/such/page", headers=browser)
    assert page.status_code == 404 and page.headers["content-type"].startswith("text/html")
    assert '<strong class="code">not_found</strong>' in page.text
    assert "/no/such/page" in page.text and 'href="/"' in page.text

    plain = site.client.get("/no/such/page")
    assert plain.status_code == 404 and plain.json()["code"] == "not_found"
    for path in ("/v1/nothing-here", "/v1"):
        answer = site.client.get(path, headers=browser)
        assert answer.status_code == 404 and answer.json()["code"] == "not_found", path


# ------------------------------------------------------------------------- framework models


def _torchscript_linear() -> bytes:
    """A saved TorchScript `Linear(4, 3)` (its input's shape is not in the file); skips
    without the torch extra."""
    import importlib.util
    import io
    import warnings

    if not all(importlib.util.find_spec(m) for m in ("torch", "onnxscript")):
        pytest.skip("torch and onnxscript not installed: pip install 'qpcfarm[torch]'")
    import torch

    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit is deprecated, and still a format users have
        torch.jit.save(torch.jit.script(torch.nn.Linear(4, 3).eval()), buffer)
    return buffer.getvalue()


def test_the_forms_input_shapes_convert_a_torchscript_upload_and_one_that_fails_is_refused(
    site: Site,
) -> None:
    """The form's `-input-shapes` go with its upload: a TorchScript module that loads but
    does not convert with them is refused on the page (422), with no model and no job."""
    csrf = sign_in(site)
    page = upload(site, csrf, _torchscript_linear(), flags="-input-shapes=input:1x5")
    assert page.status_code == 422, page.text
    assert "torch.onnx.export cannot convert" in page.text
    assert site.client.get("/v1/models", headers=api(site)).json()["count"] == 0
    assert site.queue.held == []


def test_a_torchscript_upload_without_shapes_fails_its_compile_naming_both_ways_to_give_them(
    site: Site,
) -> None:
    """Uploaded on the form without -input-shapes, a TorchScript module is only loaded; its
    compile fails, and the job's page names the compile's -input-shapes and the upload's
    input_shapes. With them on the form, the model records them and the job's page shows
    the shapes its compile used and where they came from."""
    from worker.runner import process_job

    csrf = sign_in(site)
    page = upload(site, csrf, _torchscript_linear())
    assert page.status_code == 303, page.text
    (job_id, _kind), *_ = site.queue.held
    state = site.app.state
    status = process_job(
        job_id, session_factory=state.session_factory, store=state.store, worker_name="test"
    )
    assert status is not None and status.value == "failed"
    shown = site.client.get(f"/jobs/{job_id}").text
    error = re.search(r'<div class="error" id="job-error">(.*?)</div>', shown, re.S)
    assert error is not None, shown
    assert "input_shape_required" in error.group(1)
    assert "-input-shapes" in error.group(1) and "the upload&#39;s input_shapes" in error.group(1)

    page = upload(site, csrf, _torchscript_linear(), flags="-input-shapes=input:2x4")
    assert page.status_code == 303, page.text
    job = page.headers["location"].split("submitted=")[1].split("&")[0]
    shapes = re.search(
        r'<dd id="job-input-shapes">(.*?)</dd>', site.client.get(f"/jobs/{job}").text
    )
    assert shapes is not None
    assert "<code>input:2x4</code>" in shapes.group(
        1
    ) and "recorded with the upload" in shapes.group(1)
