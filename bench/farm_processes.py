"""Starting and stopping a farm of real processes for the service benchmarks (service.py,
sweep.py): the `qpcfarm` command line, a scratch PostgreSQL database, a team and its key."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


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
