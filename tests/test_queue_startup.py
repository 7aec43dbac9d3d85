"""The farm's job queue loads its broker transport when it is built, not in the first
submit's request, and building it does not connect (behavioural checks on sys.modules in
a fresh interpreter, with a broker address nothing listens on)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRANSPORT = ["kombu.transport.redis", "redis.client"]


def _modules_around_queue_build() -> dict[str, dict[str, bool]]:
    script = (
        "import json, sys\n"
        "from app.domain.settings import get_settings\n"
        "from worker.queues import CeleryQueue\n"
        f"names = {TRANSPORT!r}\n"
        "before = {n: n in sys.modules for n in names}\n"
        "queue = CeleryQueue(get_settings())\n"
        "after = {n: n in sys.modules for n in names}\n"
        "print(json.dumps({'before': before, 'after': after}))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("QPCFARM_")}
    env["QPCFARM_BROKER_URL"] = "redis://127.0.0.1:1/0"  # port 1: a connect would fail
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_building_the_celery_queue_loads_the_broker_transport_without_connecting() -> None:
    seen = _modules_around_queue_build()

    assert seen["before"] == {name: False for name in TRANSPORT}
    assert seen["after"] == {name: True for name in TRANSPORT}
