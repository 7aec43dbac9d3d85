"""Service configuration, read from `QPCFARM_*` environment variables.

No variable is needed for the embedded default (SQLite and a blob directory under
`./qpcfarm-data`, in-process worker). Setting `QPCFARM_DATABASE_URL` and `QPCFARM_BROKER_URL`
turns the same code into the farm (PostgreSQL, Redis, Celery workers, blobs in the database).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

GiB = 1 << 30


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="QPCFARM_", extra="ignore")

    data_dir: Path = Path("./qpcfarm-data")
    """The embedded mode's home: the SQLite file and the filesystem blob store live here."""
    database_url: str = ""
    """SQLAlchemy URL; empty means `sqlite:///<data_dir>/qpcfarm.db`."""
    broker_url: str | None = None
    """Celery broker (e.g. `redis://host:6379/0`); None runs jobs in an in-process worker."""
    blob_store: Literal["filesystem", "database"] | None = None
    """None picks filesystem for SQLite (one machine) and database otherwise (no shared disk)."""
    max_upload_bytes: int = 8 * GiB
    worker_concurrency: int = 1
    job_time_limit_s: int = 3600
    """Hard limit of one compile; the broker's visibility timeout must be longer."""
    heartbeat_s: float = 5.0
    """How often a running job touches its heartbeat."""
    stale_after_s: float = 60.0
    """A running job whose heartbeat is older than this is presumed dead and re-claimed."""
    requeue_after_s: float = 300.0
    """A job still queued this long after its last enqueue is enqueued again (lost message)."""
    require_auth: bool = True
    environment: Literal["development", "production"] = "development"
    """`production` refuses to start with a default secret, without required keys, or bound to
    an open address with no TLS in front (`app.cli.production_problems`); cookies are then
    always `Secure`."""
    forwarded_allow_ips: str | None = None
    """The TLS-terminating reverse proxy's address(es) (comma-separated, `*` for any): its
    `X-Forwarded-Proto`/`-For` are believed, so the farm knows a request came over HTTPS."""
    cache_scope: Literal["team", "farm"] = "team"
    """Whose QPCs a submit may reuse: the team's own (default), or any team's (`farm`)."""

    @model_validator(mode="after")
    def _fill_defaults(self) -> Settings:
        if not self.database_url:
            self.database_url = f"sqlite:///{self.data_dir / 'qpcfarm.db'}"
        if self.blob_store is None:
            self.blob_store = "filesystem" if self.is_sqlite else "database"
        return self

    @property
    def is_sqlite(self) -> bool:
        return self.database_url.startswith("sqlite")

    @property
    def embedded_worker(self) -> bool:
        """True when jobs run in the API process (no broker configured)."""
        return self.broker_url is None

    # ---------------------------------------------------------------------------------
    # Compile and upload-check limits (issue 26; `app.services.limits`, docs/security.md).
    # Each compile and each upload check runs in a child process with an address-space
    # limit (RLIMIT_AS) and a wall-clock deadline its parent enforces by killing it.
    compile_memory_limit_mib: int | None = None
    """Address-space limit of a compile's process, in MiB; None: 3/4 of the host's memory
    (at least 2 GiB); 0: no limit. A compile over it fails `compile_memory_limit`."""
    compile_time_limit_s: float | None = None
    """Wall-clock limit of one compile; None: `job_time_limit_s` less the margin of Celery's
    soft limit, so this limit (with its coded error) always comes first; 0: no limit."""
    check_memory_limit_mib: int | None = None
    """Address-space limit of an upload checker's process, in MiB (None, 0: as above). An
    upload over it is refused 422 `model_check_limit`."""
    check_time_limit_s: float = 600.0
    """Wall-clock limit of one upload check (importer, ONNX checker, archive extraction);
    0: no limit. An upload over it is refused 422 `model_check_limit`."""
    work_dir: Path | None = None
    """Where workers make each job's private folder (`worker.workdirs`); None: the system's
    temporary folder's `qpcfarm-work`. Folders of killed jobs are removed at the next worker
    start and by the sweep."""


@lru_cache
def get_settings() -> Settings:
    """The process's settings, built on first use (never at import) and then shared."""
    return Settings()
