"""The web pages, driven in headless Chromium: what a person does by hand works in a browser.

The real app runs under uvicorn on a free port (embedded mode: SQLite and the filesystem store
in tmp_path); jobs are run by the in-process worker of `worker.queues.queue_from_settings`, behind
a gate the test opens, so the page is seen showing a job queued and then, without a reload,
succeeded. Needs Debian's chromium and chromium-driver (`.ci/run` installs them).
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
import uuid
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import tiny_model

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
QPC_MAGIC = 0x00A1CD7C
REDOC_LOGO = "https://cdn.redoc.ly/redoc/logo-mini.svg"
SCREENSHOTS_ENV = "QPCFARM_SCREENSHOT_DIR"
"""Set to docs/images to refresh the README's pictures (the tests take them either way)."""
WAIT_S = 60.0  # generous: CI machines are shared and slow at times
"""How long a wait for the page may take before the test fails rather than hangs."""

pytestmark = pytest.mark.skipif(
    not (CHROMIUM.exists() and CHROMEDRIVER.exists()),
    reason="headless browser tests need /usr/bin/chromium and /usr/bin/chromedriver "
    "(apt-get install chromium chromium-driver)",
)


class GatedQueue:
    """A JobQueue that holds job ids until `open()`, then hands them to the real queue."""

    def __init__(self) -> None:
        self.inner: Any = None
        self._held: list[tuple[uuid.UUID, str]] = []
        self._open = False
        self._lock = threading.Lock()

    def enqueue(self, job_id: uuid.UUID, kind: str = "compile") -> None:
        with self._lock:
            if not self._open:
                self._held.append((job_id, kind))
                return
        self.inner.enqueue(job_id, kind)

    def open(self) -> None:
        with self._lock:
            self._open, held, self._held = True, self._held, []
        for job_id, kind in held:
            self.inner.enqueue(job_id, kind)

    def ping(self) -> bool:
        return True

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()


@dataclass
class Server:
    url: str
    key: str
    gate: GatedQueue
    app: Any
    workdir: Path
    extras: dict[str, Any] = field(default_factory=dict)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    import uvicorn

    from app.domain.services import teams
    from app.domain.settings import Settings
    from app.main import create_app
    from worker.queues import queue_from_settings

    data = tmp_path_factory.mktemp("web-data")
    settings = Settings(
        data_dir=data,
        database_url=f"sqlite:///{data / 'qpcfarm.db'}",
        broker_url=None,
        blob_store="filesystem",
        require_auth=True,
    )
    gate = GatedQueue()
    app = create_app(settings, queue=gate)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", lifespan="on")
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + WAIT_S
    while not uv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    # The real in-process worker, on the app's own database and store (ready once started).
    gate.inner = queue_from_settings(settings, app.state.session_factory, app.state.store)
    with app.state.session_factory() as session:
        team = teams.create_team(session, "web-team")
        key, _ = teams.create_api_key(session, team)
        session.commit()
    try:
        yield Server(f"http://127.0.0.1:{port}", key, gate, app, data)
    finally:
        uv.should_exit = True
        thread.join(WAIT_S)
        gate.close()
        sock.close()


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
        "--window-size=1280,1500",
    ):
        options.add_argument(arg)
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # CSP reports, errors
    options.add_experimental_option(
        "prefs",
        {"download.default_directory": str(downloads), "download.prompt_for_download": False},
    )
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    driver.downloads = downloads  # type: ignore[attr-defined]
    try:
        yield driver
    finally:
        driver.quit()


# ------------------------------------------------------------------------------ helpers


def wait_for(driver: Any, condition: Any, message: str) -> Any:
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(
        driver, WAIT_S, poll_frequency=0.1, ignored_exceptions=(StaleElementReferenceException,)
    ).until(condition, message)


def _find(driver: Any, selector: str) -> Any:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec

    return wait_for(
        driver, ec.presence_of_element_located((By.CSS_SELECTOR, selector)), f"no {selector}"
    )


class Live:
    """An element found by selector each time it is used.

    The job list and the job page re-render while a job runs, so an element found a moment
    ago may be gone; every use re-finds it (waiting for it) and retries if it goes stale.
    """

    def __init__(self, driver: Any, selector: str) -> None:
        self.driver = driver
        self.selector = selector

    def _do(self, use: Any) -> Any:
        from selenium.common.exceptions import StaleElementReferenceException

        for _ in range(200):
            try:
                return use(_find(self.driver, self.selector))
            except StaleElementReferenceException:
                time.sleep(0.05)
        raise AssertionError(f"{self.selector} kept being replaced")

    @property
    def text(self) -> str:
        return str(self._do(lambda e: e.text))

    def get_attribute(self, name: str) -> Any:
        return self._do(lambda e: e.get_attribute(name))

    def click(self) -> None:
        self._do(lambda e: e.click())

    def send_keys(self, *keys: Any) -> None:
        self._do(lambda e: e.send_keys(*keys))

    def find_element(self, *how: Any) -> Any:
        return self._do(lambda e: e.find_element(*how))

    def clear(self) -> None:
        self._do(lambda e: e.clear())

    def element(self) -> Any:
        return _find(self.driver, self.selector)


def css(driver: Any, selector: str) -> Live:
    """The element, waiting for it: after a click the next page may still be loading."""
    return Live(driver, selector)


def css_all(driver: Any, selector: str) -> list[Any]:
    from selenium.webdriver.common.by import By

    return list(driver.find_elements(By.CSS_SELECTOR, selector))


def sign_in(driver: Any, server: Server, path: str = "/") -> None:
    driver.get(server.url + path)
    assert "/sign-in" in driver.current_url
    css(driver, "#api_key").send_keys(server.key)
    css(driver, "#sign-in").click()
    wait_for(driver, lambda d: "/sign-in" not in d.current_url, "sign-in did not leave the form")


def upload(driver: Any, model_path: Path, flags: str = "") -> None:
    css(driver, "#model").send_keys(str(model_path))
    if flags:
        css(driver, "#flags").send_keys(flags)
    css(driver, "#submit").click()


def job_id_from_url(url: str) -> str:
    return url.split("submitted=")[1].split("&")[0]


def screenshot(browser: Any, tmp_path: Path, name: str) -> Path:
    """The whole page as a PNG: in $QPCFARM_SCREENSHOT_DIR when set (docs/images for the
    README), else in tmp_path, to look at."""
    folder = Path(os.environ.get(SCREENSHOTS_ENV) or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    height = browser.execute_script("return document.documentElement.scrollHeight;")
    browser.set_window_size(1280, max(900, min(int(height) + 40, 4000)))
    browser.execute_script("window.scrollTo(0, 0);")
    path = folder / name
    browser.save_screenshot(str(path))
    assert path.stat().st_size > 10_000
    return path


def numbers(text: str) -> float:
    return float(text.replace(",", "").split()[0])


def y_of(driver: Any, selector: str) -> float:
    return float(
        driver.execute_script(
            "return document.querySelector(arguments[0]).getBoundingClientRect().top;", selector
        )
    )


WIDE_TABLES_JS = """
const page = window.innerWidth;
const wide = [];
for (const table of document.querySelectorAll("table")) {
    const box = table.getBoundingClientRect();
    const holder = table.parentElement;
    if (box.right > page + 0.5 || table.scrollWidth > holder.clientWidth + 0.5) {
        wide.push((table.id || table.className) + ": " + Math.round(box.width) + " px in "
                  + holder.clientWidth + " px");
    }
}
if (document.documentElement.scrollWidth > page) {
    wide.push("the page: " + document.documentElement.scrollWidth + " px in " + page + " px");
}
return wide;
"""
"""Every table that is wider than the page or than the box it sits in (and so scrolls)."""


def assert_fits(driver: Any) -> None:
    """No table is wider than the page, or than its card: nothing scrolls sideways."""
    wide = driver.execute_script(WIDE_TABLES_JS)
    assert wide == [], wide


def broken_flags(driver: Any) -> list[str]:
    """The flags drawn over more than one line (a line may break between flags only)."""
    return list(
        driver.execute_script(
            "return [...document.querySelectorAll('code.flag')]"
            ".filter(e => e.getClientRects().length > 1).map(e => e.textContent);"
        )
    )


# -------------------------------------------------------------------------------- tests


def test_a_page_without_the_cookie_redirects_to_sign_in_and_back(
    server: Server, browser: Any
) -> None:
    browser.get(server.url + "/")
    assert browser.current_url.startswith(server.url + "/sign-in")
    css(browser, "#api_key").send_keys("qpf_not-a-key")
    css(browser, "#sign-in").click()
    assert "unauthorized" in css(browser, "#error").text
    assert browser.get_cookie("qpcfarm_session") is None

    sign_in(browser, server, "/")
    assert browser.current_url == server.url + "/"
    cookie = browser.get_cookie("qpcfarm_session")
    assert cookie is not None and cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    assert "web-team" in css(browser, "header").text

    css(browser, "#sign-out").click()
    wait_for(browser, lambda d: "/sign-in" in d.current_url, "sign-out did not go to sign-in")
    browser.get(server.url + "/")
    assert "/sign-in" in browser.current_url


def test_upload_compile_watch_live_open_report_download_and_validate(
    server: Server, browser: Any, tmp_path: Path
) -> None:
    import onnx

    model_path = tmp_path / "tiny.onnx"
    onnx.save(tiny_model(scale=0.37), str(model_path))
    sign_in(browser, server)
    # An unused symbol makes an import warning, to be shown apart from the perf warnings.
    upload(browser, model_path, "-aic-num-cores=2 -onnx-define-symbol=seq,3")

    wait_for(browser, lambda d: "submitted=" in d.current_url, "the upload was not accepted")
    job_id = job_id_from_url(browser.current_url)
    row = f"#job-{job_id}"
    assert css(browser, row).get_attribute("data-status") == "queued"
    assert "tiny.onnx" in css(browser, row).text
    # Said what happened, with the way to the new job; the row shows its flags, in words.
    assert "tiny.onnx is queued as job" in css(browser, "#notice").text
    assert css(browser, "#notice-job").get_attribute("href").endswith(f"/jobs/{job_id}")
    assert "-aic-num-cores=2" in css(browser, f"{row} td.flags").text
    assert css(browser, f"{row} td.stage").text == "waiting for a worker"
    # A marker that a reload would wipe: the status must change under it.
    browser.execute_script("window.__sameDocument = true;")
    server.gate.open()
    wait_for(
        browser,
        lambda d: css(d, row).get_attribute("data-status") in ("succeeded", "failed"),
        "the job list never showed the job finished",
    )
    assert css(browser, f"{row} .badge").text == "succeeded"
    assert css(browser, f"{row} td.stage").text == "done"
    assert browser.execute_script("return window.__sameDocument === true;")

    css(browser, f"{row} a.job-link").click()
    wait_for(browser, lambda d: f"/jobs/{job_id}" in d.current_url, "job page did not open")
    assert css(browser, "#job-status").text == "succeeded"
    assert "-aic-num-cores=2" in css(browser, "dl.facts").text
    metrics = {
        r.get_attribute("data-metric"): r.find_element("css selector", "td").text
        for r in css_all(browser, "#metrics tr.metric")
    }
    assert metrics["num_cores"] == "2"
    assert int(metrics["estimated_cycles"].replace(",", "")) > 0
    assert "c01" in css(browser, "#metric-tables").text  # per-core figures of both cores
    # Metrics in groups, with units and readable names.
    groups = [e.text for e in css_all(browser, "#metrics tr.group th")]
    assert groups[:2] == ["Device", "Latency and throughput"] and "Memory" in groups
    assert metrics["estimated_latency_us"].endswith(" µs")
    assert re.fullmatch(r"[\d.,]+ (B|KiB|MiB)", metrics["final_constants_size"])
    assert css(browser, "tr[data-metric='estimated_latency_us'] th").text == "Estimated latency"
    # Pass times: the passes under their stage, a total of the stages alone.
    stages = [
        numbers(r.find_element("css selector", "td").text)
        for r in css_all(browser, "#pass-times tr.depth-0")
    ]
    passes = css_all(browser, "#pass-times tr.depth-1")
    assert [r.get_attribute("data-pass") for r in passes][:1] == ["canonicalize"]
    total = numbers(css(browser, "#pass-total td").text)
    assert total == pytest.approx(sum(stages), abs=0.01 * len(stages))
    # Import warnings apart from perf warnings.
    assert "seq" in css(browser, "#warnings-import li[data-code='import']").text
    assert "seq" not in css(browser, "#warnings-perf").text
    assert css_all(browser, "#warnings-perf li[data-code='fp32_compute']")

    # The link downloads the QPC with the browser's own (HttpOnly) cookie.
    href = css(browser, "#download").get_attribute("href")
    fetched = browser.execute_async_script(
        """
        const done = arguments[arguments.length - 1];
        fetch(arguments[0]).then(async r => {
            const bytes = new Uint8Array(await r.arrayBuffer());
            done({status: r.status, size: bytes.length, head: Array.from(bytes.slice(0, 4))});
        }).catch(e => done({status: -1, error: String(e)}));
        """,
        href,
    )
    assert fetched["status"] == 200
    assert int.from_bytes(bytes(fetched["head"]), "little") == QPC_MAGIC
    css(browser, "#download").click()
    saved = browser.downloads / "programqpc.bin"
    wait_for(browser, lambda d: saved.exists() and saved.stat().st_size > 0, "no download")
    wait_for(
        browser,
        lambda d: saved.stat().st_size == fetched["size"],
        "the download did not complete",
    )
    assert int.from_bytes(saved.read_bytes()[:4], "little") == QPC_MAGIC

    from selenium.webdriver.support.ui import Select

    Select(css(browser, "#validate-device").element()).select_by_value("aic100-standard")
    css(browser, "#validate").click()
    wait_for(browser, lambda d: "validation=" in d.current_url, "validation did not run")
    assert browser.current_url.endswith("#validation")
    assert "aic100-standard" in css(browser, "#validation h2").text
    assert y_of(browser, "#validation") < y_of(browser, "#job-body")  # on top, not under it
    checks = css_all(browser, "#validation li.check")
    assert checks, "no check lines shown"
    names = {c.get_attribute("data-check") for c in checks}
    assert {"container", "checksums"} <= names
    assert all("PASS" in c.text for c in checks)

    browser.get(f"{server.url}/jobs/{job_id}")  # the page as a visitor first sees it
    css(browser, "#metrics")
    assert_fits(browser)


def test_a_bad_upload_shows_its_error_on_the_page(
    server: Server, browser: Any, tmp_path: Path
) -> None:
    text_file = tmp_path / "notes.txt"
    text_file.write_text("these are not the weights you are looking for\n")
    sign_in(browser, server)
    upload(browser, text_file, "-aic-num-cores=2")
    error = css(browser, "#error")
    assert css(browser, "#error .code").text == "invalid_model"
    assert "not an ONNX model" in error.text
    # The form keeps what was typed, so the user only fixes the file.
    assert css(browser, "#flags").get_attribute("value") == "-aic-num-cores=2"


def test_a_bad_flag_is_named_on_the_page(server: Server, browser: Any, tmp_path: Path) -> None:
    import onnx

    model_path = tmp_path / "tiny.onnx"
    onnx.save(tiny_model(scale=0.5), str(model_path))
    sign_in(browser, server)
    upload(browser, model_path, "-aic-num-corez=2")
    assert css(browser, "#error .code").text == "unknown_option"
    assert "-aic-num-corez" in css(browser, "#error").text


def test_profiling_a_jobs_qpc_shows_the_per_operator_chart_and_the_timeline(
    server: Server, browser: Any, tmp_path: Path
) -> None:
    import onnx

    model_path = tmp_path / "tiny.onnx"
    onnx.save(tiny_model(scale=0.61), str(model_path))
    sign_in(browser, server)
    upload(browser, model_path, "-aic-num-cores=2 -stats-level=70")
    wait_for(browser, lambda d: "submitted=" in d.current_url, "the upload was not accepted")
    job_id = job_id_from_url(browser.current_url)
    server.gate.open()
    browser.get(f"{server.url}/jobs/{job_id}")
    wait_for(browser, lambda d: css(d, "#job-status").text == "succeeded", "the compile")

    iterations = css(browser, "#profile-iterations")
    iterations.clear()
    iterations.send_keys("2")
    css(browser, "#profile").click()
    wait_for(browser, lambda d: "/profiles/" in d.current_url, "the profile page did not open")
    wait_for(
        browser,
        lambda d: css(d, "#profile-status").text in ("succeeded", "failed"),
        "the profile never finished on the page",
    )
    assert css(browser, "#profile-status").text == "succeeded"

    # The chart: one bar per operator (the tiny model fuses into one kernel of its 3 nodes).
    bars = css_all(browser, "#op-chart tr.op-row")
    assert [b.get_attribute("data-op") for b in bars] == ["MatMul_0"]
    assert "MatMul+Add+Relu" in bars[0].text
    assert "%" in bars[0].find_element("css selector", ".pct").text
    # The timeline: lanes of both cores, spans drawn as SVG rectangles with their names.
    labels = {e.text for e in css_all(browser, "#timeline text.lane-label")}
    assert {"c00 ops", "c01 ops", "c00 hmx", "c01 dma"} <= labels
    spans = css_all(browser, "#timeline rect.span-op")
    assert len(spans) == 2  # the kernel on each core, first inference only
    assert all(float(s.get_attribute("width")) > 0 for s in spans)
    assert "MatMul_0" in spans[0].find_element("css selector", "title").get_attribute("textContent")
    for link in ("#download-summary", "#download-csv", "#download-trace"):
        assert "/v1/profiles/" in css(browser, link).get_attribute("href")
    # The legend names every colour the timeline draws.
    drawn = {
        cls.removeprefix("span-")
        for s in css_all(browser, "#timeline rect.span")
        for cls in s.get_attribute("class").split()
        if cls.startswith("span-")
    }
    keys = css_all(browser, "#timeline-legend [data-kind]")
    legend = {e.get_attribute("data-kind") for e in keys}
    assert legend == drawn and {"op", "hmx"} <= legend
    assert "HMX thread" in css(browser, "#timeline-legend").text
    screenshot(browser, tmp_path, "profile-page.png")

    css(browser, "#job-link").click()
    wait_for(browser, lambda d: f"/jobs/{job_id}" in d.current_url, "back to the job")
    assert "succeeded" in css(browser, "#profiles").text


@pytest.mark.parametrize(
    ("path", "rendered"),
    [("/docs", "#swagger-ui .opblock"), ("/redoc", "[data-section-id^='tag/'], .api-content")],
)
def test_the_api_docs_render_from_the_farm_alone(
    server: Server, browser: Any, path: str, rendered: str
) -> None:
    """Swagger UI and ReDoc come from the farm (a closed network has them too), under a
    policy that allows no other origin and no inline script. The one thing either viewer
    reaches for outside is ReDoc's vendor logo: the policy refuses it and ReDoc drops it."""
    browser.get(server.url + path)
    wait_for(browser, lambda d: css_all(d, rendered), f"{path} rendered no operation")
    assert "compile-jobs" in browser.find_element("css selector", "body").text
    resources = browser.execute_script(
        "return performance.getEntriesByType('resource').map(e => e.name);"
    )
    outside = {r for r in resources if not r.startswith(server.url + "/")}
    assert outside <= {REDOC_LOGO}, outside
    refused = [e["message"] for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert all(REDOC_LOGO in m and "Content Security Policy" in m for m in refused), refused
    assert not css_all(browser, "img[alt='redocly logo']")


def test_below_stats_level_70_profile_is_disabled_with_why_and_recompile_makes_it_possible(
    server: Server, browser: Any, tmp_path: Path
) -> None:
    import onnx

    server.gate.open()
    model_path = tmp_path / "tiny.onnx"
    onnx.save(tiny_model(scale=0.83), str(model_path))
    sign_in(browser, server)
    upload(browser, model_path, "-aic-num-cores=2")
    wait_for(browser, lambda d: "submitted=" in d.current_url, "the upload was not accepted")
    css(browser, "#notice-job").click()
    wait_for(browser, lambda d: css(d, "#job-status").text == "succeeded", "the compile")

    assert css(browser, "#profile").get_attribute("disabled") is not None
    assert "-stats-level=70" in css(browser, "#profile-why").text
    css(browser, "#recompile").click()
    wait_for(browser, lambda d: "recompiled_from=" in d.current_url, "no new job")
    assert "-stats-level=70" in css(browser, "#notice").text
    wait_for(browser, lambda d: css(d, "#job-status").text == "succeeded", "the recompile")
    assert "-stats-level=70" in css(browser, "dl.facts").text
    assert css(browser, "#profile").get_attribute("disabled") is None
    assert css(browser, "#profile-iterations").get_attribute("value") == "1"


def test_a_failed_job_says_where_it_stopped_and_specializations_are_listed(
    server: Server, browser: Any, tmp_path: Path
) -> None:
    import onnx
    from onnx import TensorProto, helper

    server.gate.open()
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"], name="act")],
        "symbolic",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", 8])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    model_path = tmp_path / "symbolic.onnx"
    onnx.save(model, str(model_path))
    sign_in(browser, server)

    upload(browser, model_path)  # nothing binds batch and seq: the import refuses
    wait_for(browser, lambda d: "submitted=" in d.current_url, "the upload was not accepted")
    css(browser, "#notice-job").click()
    wait_for(browser, lambda d: css(d, "#job-status").text == "failed", "the failure")
    assert css(browser, "#job-stage").text == "failed while importing the model"
    assert css(browser, "#job-error .code").text == "dynamic_shape"

    specs = {
        "specializations": [
            {"name": "prefill", "symbols": {"batch": 1, "seq": 16}},
            {"name": "decode", "symbols": {"batch": 1, "seq": 1}},
        ]
    }
    archive = tmp_path / "llm.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.write(model_path, "symbolic.onnx")
        zf.writestr("specs.json", json.dumps(specs))
    browser.get(server.url + "/")
    upload(browser, archive, "-network-specialization-config=specs.json")
    wait_for(browser, lambda d: "submitted=" in d.current_url, "the upload was not accepted")
    css(browser, "#notice-job").click()
    wait_for(browser, lambda d: css(d, "#job-status").text == "succeeded", "the compile")
    rows = {
        r.get_attribute("data-program"): r.text for r in css_all(browser, "#programs tr.program")
    }
    assert set(rows) == {"prefill", "decode"}
    assert "seq=16" in rows["prefill"] and "x: float32[1x16x8]" in rows["prefill"]
    assert "seq=1" in rows["decode"] and "µs" in rows["decode"]


def test_a_sweep_page_follows_the_sweep_live_sorts_its_table_and_links_points_to_jobs(
    server: Server, browser: Any
) -> None:
    import httpx

    space = {
        "parameters": {"cores": [1, 2], "instances": [1, 2], "batchsize": [1, 2]},
        "constraints": ["cores * instances <= 2"],
    }
    with httpx.Client(
        base_url=server.url, headers={"Authorization": f"Bearer {server.key}"}, timeout=60
    ) as api:
        model = api.post(
            "/v1/models",
            files={"file": ("tiny.onnx", tiny_model(scale=0.61, batch="N").SerializeToString())},
        )
        assert model.status_code == 201, model.text
        body = {"model_id": model.json()["id"], "space": space, "base_flags": ["-convert-to-fp16"]}
        created = api.post("/v1/sweeps", json=body)
        assert created.status_code == 201, created.text
        sweep_id = created.json()["id"]

        sign_in(browser, server, f"/sweeps/{sweep_id}")
        wait_for(browser, lambda d: f"/sweeps/{sweep_id}" in d.current_url, "not on the sweep")
        browser.execute_script("window.qpcfarmStayed = true;")  # gone if the page reloads
        server.gate.open()
        wait_for(browser, lambda d: css(d, "#sweep-status").text == "succeeded", "the sweep")
        assert browser.execute_script("return window.qpcfarmStayed === true;"), "page reloaded"
        sweep = api.get(f"/v1/sweeps/{sweep_id}").json()

    scored = [r for r in sweep["results"] if r["latency_us"] is not None]
    assert len(scored) == 6  # 1 or 2 cores x 1 or 2 instances (<= 2 in all) x batch 1 or 2
    points = css_all(browser, "#sweep-chart a.point")
    assert len(points) == len(scored)
    best = css_all(browser, "#sweep-chart a.point.best")
    assert len(best) == 1 and best[0].get_attribute("data-index") == str(sweep["best"]["index"])
    assert "best" in css(browser, "#sweep-results tr.result.best").text

    def latencies() -> list[float]:
        cells = css_all(browser, "#sweep-results td.latency")
        return [numbers(c.text) for c in cells if c.text != "-"]

    css(browser, "#sweep-results a.sort[data-sort='latency']").click()
    wait_for(browser, lambda d: "sort=latency" in d.current_url, "no sort by latency")
    assert latencies() == sorted(r["latency_us"] for r in scored)
    css(browser, "#sweep-results a.sort[data-sort='latency']").click()
    wait_for(browser, lambda d: "desc=1" in d.current_url, "no descending sort")
    assert latencies() == sorted((r["latency_us"] for r in scored), reverse=True)

    bar = browser.execute_script(
        "const b = document.querySelector('#sweep-bar');"
        "return [b.getBoundingClientRect().width,"
        "        b.firstElementChild.getBoundingClientRect().width];"
    )
    assert bar[0] > 0 and bar[1] == pytest.approx(bar[0], abs=1)  # done: a full bar
    assert css(browser, "#sweep-base-flags").text == "-convert-to-fp16"
    assert_fits(browser)

    css(browser, "#sweep-chart a.point.best circle").click()
    wait_for(browser, lambda d: "/jobs/" in d.current_url, "the best point did not open its job")
    assert sweep["best"]["job_id"] in browser.current_url
    assert css(browser, "#job-status").text == "succeeded"


def test_a_resnet_class_job_page_fits_the_page_with_its_node_lists_folded(
    server: Server, browser: Any, tmp_path: Path
) -> None:
    """A model of real size (a ResNet-50-shaped network, narrower and on a smaller image to
    compile quickly: 53 convolutions, 175 nodes): its per-precision node lists are long, and
    every table of the job page still fits the page; the device is named with the estimates."""
    import onnx

    from tests.codegen_models import bench_models

    models, _ = bench_models()
    spec = models.ResNetSpec(blocks=(3, 4, 6, 3), width=16, image=64)
    model_path = tmp_path / "resnet50-shaped.onnx"
    onnx.save(models.resnet(spec), str(model_path))
    server.gate.open()
    sign_in(browser, server)
    upload(browser, model_path, "-aic-num-cores=14 -convert-to-fp16 -stats-level=70")
    wait_for(browser, lambda d: "submitted=" in d.current_url, "the upload was not accepted")
    assert "already on its way" not in css(browser, "#notice").text
    css(browser, "#notice-job").click()
    wait_for(browser, lambda d: css(d, "#job-status").text == "succeeded", "the compile")
    browser.get(browser.current_url)  # the page as a visitor first sees it

    assert_fits(browser)
    assert broken_flags(browser) == []
    assert css(browser, "#job-device").text.startswith("AIC100 Pro (aic100-pro)")
    assert "AIC100 Pro (aic100-pro)" in css(browser, "#metrics-device").text
    nodes = css(browser, "tr[data-metric='precision.fp16.nodes']")
    assert css(browser, "tr[data-metric='precision.fp16.nodes'] th").text == "fp16 nodes"
    summary = nodes.find_element("css selector", "summary")
    count = int(summary.text.split()[0])
    assert count > 150 and summary.text.endswith(" nodes")
    details = nodes.find_element("css selector", "details")
    assert details.get_attribute("open") is None  # folded: the table stays short
    # No label is squeezed into a column of a few characters.
    narrowest = browser.execute_script(
        "return Math.min(...[...document.querySelectorAll('#metrics tr.metric th')]"
        ".map(e => e.getBoundingClientRect().width));"
    )
    assert narrowest >= 100, narrowest

    summary.click()
    items = css_all(browser, "tr[data-metric='precision.fp16.nodes'] ul.items li")
    assert len(items) == count and items[0].is_displayed()
    assert_fits(browser)  # opened, the list wraps inside its cell
    screenshot(browser, tmp_path, "job-page.png")

    browser.get(server.url + "/?show=all")
    css(browser, "#job-rows")
    assert_fits(browser)
    assert broken_flags(browser) == []
    browser.save_screenshot(str(tmp_path / "jobs-list.png"))  # to look at, when it fails

    browser.back()
    css(browser, "#profile").click()  # the profile page of a real model fits too
    wait_for(browser, lambda d: "/profiles/" in d.current_url, "the profile page did not open")
    wait_for(
        browser,
        lambda d: css(d, "#profile-status").text in ("succeeded", "failed"),
        "the profile never finished on the page",
    )
    assert css(browser, "#profile-status").text == "succeeded"
    assert len(css_all(browser, "#op-chart tr.op-row")) > 20
    assert_fits(browser)
