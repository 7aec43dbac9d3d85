"""Starting and stopping a farm of real processes for the service benchmarks (service.py,
sweep.py, fairness.py): the `qpcfarm` command line, a scratch PostgreSQL database, a team and
its key, each process's log, and the wait for the API to answer."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
START_ATTEMPTS = 900  # x 0.1 s


def qpcfarm(*args: str) -> list[str]:
    """The `qpcfarm` command of this interpreter (the checkout's code, installed or not)."""
    return [sys.executable, "-m", "app.console.cli", *args]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def farm_env(data_dir: Path, extra: dict[str, str]) -> dict[str, str]:
    """This process's environment without its QPCFARM_ settings, plus the farm's own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("QPCFARM_")}
    env["QPCFARM_DATA_DIR"] = str(data_dir)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def admin_sql(url: str, statement: str) -> None:
    """One statement outside a transaction (CREATE/DROP DATABASE)."""
    from sqlalchemy import create_engine, text

    engine = create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.execute(text(statement))
    finally:
        engine.dispose()


def sibling_database_url(url: str, database: str) -> str:
    """`url` pointing at another database of the same server."""
    return url.rsplit("/", 1)[0] + "/" + database


def bench_team_key(env: dict[str, str]) -> str:
    """Migrate the farm's fresh database, create the team `bench` and return a key of it."""
    subprocess.run(qpcfarm("db", "upgrade", "--init"), env=env, check=True, capture_output=True)
    subprocess.run(
        qpcfarm("admin", "create-team", "bench"), env=env, check=True, capture_output=True
    )
    made = subprocess.run(
        qpcfarm("admin", "create-key", "--team", "bench"),
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    return made.stdout.strip().splitlines()[-1]


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL after 30 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def spawn(
    procs: list[subprocess.Popen[bytes]],
    logs: list[Path],
    work: Path,
    name: str,
    cmd: list[str],
    env: dict[str, str],
) -> None:
    """Start `cmd` in `work` with its output in `<name>.log` (kept in `logs` for `log_tail`)."""
    log = work / f"{name}.log"
    with open(log, "wb") as handle:
        procs.append(
            subprocess.Popen(cmd, cwd=work, env=env, stdout=handle, stderr=subprocess.STDOUT)
        )
    logs.append(log)


def log_tail(logs: list[Path]) -> str:
    """The end of each process's log, for an error message."""
    return "\n".join(p.read_text(errors="replace")[-1500:] for p in logs if p.exists())


def wait_healthy(url: str, procs: list[subprocess.Popen[bytes]], logs: list[Path]) -> None:
    """Until the API at `url` answers /healthz; raises with the logs if a process exits
    first or it never answers."""
    for _ in range(START_ATTEMPTS):
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"the farm exited during start-up:\n{log_tail(logs)}")
        try:
            if httpx.get(f"{url}/healthz", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"the farm did not answer /healthz:\n{log_tail(logs)}")
