"""What the wheel holds and how an installed farm finds its parts.

The import names are the folders (app/ worker/ migrations/ compiler_core/), so the wheel lists
every package folder under its own name, and the migrations are package data found through the
package rather than beside a source tree. The last test builds the wheel, installs it with its
service extra in a fresh venv and serves from a folder far from the repository (~40 s on 2
CPUs, pip's cache cold or warm: in the default run, so CI builds what users install).
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import httpx

from tests.conftest import tiny_model_bytes
from tests.service_helpers import free_port, wait_until

ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("app", "worker", "migrations", "compiler_core", "tests", "bench")
BUILD_INPUTS = ("pyproject.toml", "README.md", "app", "worker", "migrations", "compiler_core")


def setuptools_config() -> dict[str, object]:
    with open(ROOT / "pyproject.toml", "rb") as handle:
        return dict(tomllib.load(handle)["tool"]["setuptools"])


def package_folders() -> set[str]:
    """Every package the folders hold, by its import name (the folder's path)."""
    found = set()
    for top in ("app", "worker", "migrations", "compiler_core"):
        for init in (ROOT / top).rglob("__init__.py"):
            found.add(".".join(init.parent.relative_to(ROOT).parts))
    return found


def test_the_wheel_lists_every_package_folder_under_its_import_name() -> None:
    config = setuptools_config()
    assert "package-dir" not in config  # no name mapping: the import names are the folders
    packages = config["packages"]
    assert isinstance(packages, list) and set(packages) == package_folders()


def test_no_source_imports_the_service_by_a_mapped_name() -> None:
    """The old `qpcfarm.app` names are gone: one name per module, so a module is never
    loaded twice (two settings caches, two engines)."""
    mapped = []
    for top in SOURCE_DIRS:
        for path in (ROOT / top).rglob("*.py"):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    found = [(node.lineno, alias.name) for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    found = [(node.lineno, node.module)]
                else:
                    continue
                for line, name in found:
                    if name.split(".")[0] == "qpcfarm":
                        mapped.append(f"{path.relative_to(ROOT)}:{line}: {name}")
    assert not mapped, "\n".join(mapped)


def test_the_migrations_are_found_through_the_package() -> None:
    from app.domain.db.session import alembic_config, migrations_dir

    folder = migrations_dir()
    assert (folder / "alembic.ini").is_file() and (folder / "env.py").is_file()
    assert sorted(p.name for p in (folder / "versions").glob("0*.py"))
    assert alembic_config().get_main_option("script_location") == str(folder)


# ------------------------------------------------------------------------ the real wheel


def run(args: list[str | Path], cwd: Path, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        [str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, f"{args}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def test_a_wheel_installed_in_a_fresh_venv_serves_from_any_folder(tmp_path: Path) -> None:
    # Build from a copy: an in-tree build would leave build/ and *.egg-info in the checkout.
    source = tmp_path / "source"
    source.mkdir()
    for name in BUILD_INPUTS:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, source / name)
    dist = tmp_path / "dist"
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", dist, source], tmp_path)
    (wheel,) = dist.glob("qpcfarm-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"app", "worker", "migrations", "compiler_core"}, tops
    for shipped in (
        "migrations/alembic.ini",
        "migrations/env.py",
        "migrations/script.py.mako",
        "migrations/versions/0001_initial_schema.py",
        "app/web/templates/base.html",
        "app/web/static/web.css",
    ):
        assert shipped in names, shipped

    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", venv], tmp_path)
    bin_dir = venv / "bin"
    run([bin_dir / "pip", "install", "-q", f"{wheel}[service]"], tmp_path)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("QPCFARM_", "PYTHON"))}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "wb") as log_file:
        serve = subprocess.Popen(
            [str(bin_dir / "qpcfarm"), "serve", "--port", str(port), "--log-level", "warning"],
            cwd=elsewhere,
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    try:

        def ready() -> bool:
            assert serve.poll() is None, log.read_text()
            try:
                return httpx.get(f"{base}/readyz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(ready, "the installed farm to answer", timeout=90)
        key = (elsewhere / "qpcfarm-data" / "api-key").read_text().strip()
        headers = {"Authorization": f"Bearer {key}"}
        assert "Sign in" in httpx.get(f"{base}/sign-in").text  # templates shipped
        docs = httpx.get(f"{base}/docs")
        assert docs.status_code == 200 and "/docs/assets/swagger-ui-bundle.js" in docs.text
        asset = httpx.get(f"{base}/docs/assets/swagger-ui-bundle.js")
        assert asset.status_code == 200 and len(asset.content) > 100_000
        model = httpx.post(
            f"{base}/v1/models",
            headers=headers,
            files={"file": ("tiny.onnx", tiny_model_bytes(), "application/octet-stream")},
        ).json()
        job = httpx.post(
            f"{base}/v1/compile-jobs",
            headers=headers,
            json={"model_id": model["id"], "flags": ["-aic-num-cores=2"]},
        ).json()

        def finished() -> dict[str, object] | None:
            seen = httpx.get(f"{base}/v1/compile-jobs/{job['id']}", headers=headers).json()
            return seen if seen["status"] in ("succeeded", "failed") else None

        done = wait_until(finished, "the compile", timeout=120)
        assert done["status"] == "succeeded", done
        keys = run([bin_dir / "qpcfarm", "admin", "list-keys"], elsewhere, env)
        assert "local" in keys
    finally:
        os.killpg(serve.pid, 9)
        serve.wait(timeout=30)
