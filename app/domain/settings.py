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

from app.domain import timing

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
LOCAL_KEY_FILE = "api-key"
"""Where in `data_dir` the embedded mode's first start saves team `local`'s key."""


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
    job_time_limit_s: int = timing.JOB_TIME_LIMIT_S
    """Hard limit of one compile; the broker's visibility timeout must be longer."""
    heartbeat_s: float = timing.HEARTBEAT_S
    """How often a running job touches its heartbeat."""
    stale_after_s: float = timing.STALE_AFTER_S
    """A running job whose heartbeat is older than this is presumed dead and re-claimed."""
    requeue_after_s: float = timing.REQUEUE_AFTER_S
    """A job still queued this long after its last enqueue is enqueued again (lost message)."""
    require_auth: bool = True
    environment: Literal["development", "production"] = "development"
    """`production` refuses to start with a default secret, without required keys, or bound to
    an open address with no TLS in front (`app.console.cli.production_problems`); cookies are then
    always `Secure`."""
    forwarded_allow_ips: str | None = None
    """The TLS-terminating reverse proxy's address(es) (comma-separated, `*` for any): its
    `X-Forwarded-Proto`/`-For` are believed, so the farm knows a request came over HTTPS."""
    qaic_sdk: Path = Path("/opt/qti-aic")
    """The vendor SDK's home: a worker whose `exec/qaic-compile` exists there offers the
    `qaic` backend (`app.domain.compilers`)."""
    qaic_devices: str = "/dev/accel/accel*"
    """Where the host's Cloud AI cards appear (the Linux `accel/qaic` driver's device nodes, a
    glob): a profile of a QPC the vendor compiler made runs on the first one there."""
    qaic_version: str | None = None
    """The SDK's version as workers advertise it; None reads it from the SDK's `versions/`
    files (`app.domain.compilers.sdk_version`)."""
    cache_scope: Literal["team", "farm"] = "team"
    """Whose QPCs a submit may reuse: the team's own (default), or any team's (`farm`)."""

    # ---- Request and upload limits (docs/security.md): what one request may cost. --------
    max_json_body_bytes: int = 2 * MiB
    """Largest JSON (or other non-upload) request body; more is 413 `body_too_large`, refused
    from the Content-Length before a byte is read, or as soon as a streamed body passes it."""
    max_form_body_bytes: int = 64 * KiB
    """Largest web form body without a file (sign-in, the job page's buttons)."""
    body_read_timeout_s: float = 60.0
    """A request body that sends nothing for this long is dropped with 408 `body_timeout`
    (what it had sent of an upload is removed)."""
    max_uploads_per_key: int = 8
    """Uploads one API key (or one browser session) may have in flight; more is 429
    `too_many_uploads` with `Retry-After`, answered before the body is read."""
    archive_max_unpacked_bytes: int = 16 * GiB
    """What an archive may unpack to in total (also never more than the upload limit at
    upload); more is 413 `archive_too_large`, refused before the byte past it is written."""
    archive_max_ratio: float = 100.0
    """How many times its own size an archive may unpack to (beyond its first MiB); more is
    413 `archive_ratio` (a zip bomb)."""
    max_profile_inputs_bytes: int = 256 * MiB
    """What the arrays of a profile's uploaded `.npz` may declare in total (checked from the
    `.npy` headers; the arrays are never unpacked in the API)."""
    max_sweep_combinations: int = 1024
    """Combinations one sweep request may hold; more is 422 `sweep_too_large`."""
    max_team_sweep_compiles: int = 64
    """Compiles a team's sweeps may have queued or running at once; the sweeps submit the
    rest as those finish (`services.sweeps.sweep_compile_allowance`, the quota hook)."""
    retention_days: float | None = None
    """Unreferenced models and QPCs older than this many days are collected (`qpcfarm admin
    gc`, and every `gc_interval_s` in the reaper); a team's own `retention_days` overrides
    it. None: nothing is collected unless the team sets a period."""
    gc_interval_s: float = 3600.0
    """How often a reaper runs the collector (0: only `qpcfarm admin gc`)."""
    quota_retry_after_s: int = 30
    """The `Retry-After` of a 429 for a full queue quota: about one compile's time."""
    model_cache_bytes: int = 20 * GiB
    """A worker keeps models it read from the database blob store on its local disk, by
    sha256, up to this many bytes (`worker.model_cache`; 0: off)."""
    fair_share_window_s: float = timing.FAIR_SHARE_WINDOW_S
    """Fair share: a team's recent worker time is what its compiles used in this window."""

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
    def local_key_file(self) -> Path:
        """The embedded mode's saved key (`qpcfarm serve` writes it on its first start)."""
        return self.data_dir / LOCAL_KEY_FILE

    @property
    def embedded_worker(self) -> bool:
        """True when jobs run in the API process (no broker configured)."""
        return self.broker_url is None

    # ---------------------------------------------------------------------------------
    # Compile and upload-check limits (issue 26; `app.domain.services.limits`, docs/security.md).
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
