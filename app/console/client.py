"""A small synchronous client of the qpcfarm HTTP API (`/v1`), used by `qpcfarm submit`.

Uploads and downloads stream: an upload is sent from the file in 1 MiB pieces (as the raw
body by default; httpx's own multipart encoder would read 64 KiB at a time), and a download
goes to a temporary file that is hashed as it is written and renamed into place only when its
sha256 matches the server's ETag. Every failure is a
`FarmError` whose message is one line fit to print: the API's `{"code", "message"}`, or what
went wrong with the connection.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO

import httpx

from compiler_core.errors import CompileError

CHUNK = 1 << 20
PROG = "qpcfarm"
USER_AGENT = "qpcfarm-client"


class FarmError(CompileError):
    """A failure talking to the farm; `code` is the API's code (or a client-side one)."""


def api_error(response: httpx.Response) -> FarmError:
    """The API's JSON error (`{"code", "message"}`) as a FarmError, whatever shape it has;
    its message says the API's code, as the web pages do, and the HTTP status:
    `compiler_unavailable: no worker has ... (HTTP 409)`."""
    code, message = "", ""
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, Mapping):
        nested = body.get("error")
        inner: Mapping[str, Any] = nested if isinstance(nested, Mapping) else body
        code = str(inner.get("code") or "")
        message = str(inner.get("message") or inner.get("detail") or "")
    if not message:
        text = response.text.strip() if not response.is_stream_consumed else ""
        message = text.splitlines()[0] if text else response.reason_phrase
    if response.status_code == 401:
        message = f"{message} (pass --api-key, or set QPCFARM_API_KEY)"
    if code:
        message = f"{code}: {message}"
    return FarmError(
        code or f"http_{response.status_code}", f"{message} (HTTP {response.status_code})"
    )


def _connection_error(base_url: str, exc: httpx.HTTPError) -> FarmError:
    if isinstance(exc, httpx.TimeoutException):
        return FarmError("server_timeout", f"the server at {base_url} did not answer in time")
    detail = " ".join(str(exc).split()) or type(exc).__name__
    hint = ""
    if isinstance(exc, httpx.ConnectError):
        hint = (
            f"; is a farm running there? Start one on this machine with `{PROG} serve`, or "
            "name yours with --server URL (or QPCFARM_SERVER)"
        )
    return FarmError("server_unreachable", f"cannot reach the server at {base_url}: {detail}{hint}")


def _file_chunks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            yield chunk


class _MultipartFile:
    """A `multipart/form-data` body of one file field, generated in CHUNK pieces."""

    def __init__(self, field: str, path: Path, filename: str) -> None:
        self.boundary = uuid.uuid4().hex
        safe_name = filename.replace('"', "_").replace("\r", "_").replace("\n", "_")
        self.head = (
            f"--{self.boundary}\r\n"
            f'Content-Disposition: form-data; name="{field}"; filename="{safe_name}"\r\n'
            "Content-Type: application/octet-stream\r\n\r\n"
        ).encode()
        self.tail = f"\r\n--{self.boundary}--\r\n".encode()
        self.path = path
        self.size = path.stat().st_size

    @property
    def headers(self) -> dict[str, str]:
        return {
            "Content-Type": f"multipart/form-data; boundary={self.boundary}",
            "Content-Length": str(len(self.head) + self.size + len(self.tail)),
        }

    def __iter__(self) -> Iterator[bytes]:
        yield self.head
        yield from _file_chunks(self.path)
        yield self.tail


class FarmClient:
    """The API calls `qpcfarm submit` (and the service benchmark) make."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        timeout: float = 60.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        headers = {"User-Agent": USER_AGENT}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self._http = httpx.Client(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
            transport=transport,
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> FarmClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- plumbing ---------------------------------------------------------------------------

    def _request(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self._http.request(method, url, **kwargs)
        except httpx.HTTPError as exc:
            raise _connection_error(self.base_url, exc) from None
        if response.status_code >= 400:
            raise api_error(response)
        return response

    def _json(self, method: str, url: str, **kwargs: Any) -> dict[str, Any]:
        response = self._request(method, url, **kwargs)
        try:
            body = response.json()
        except ValueError:
            raise FarmError(
                "bad_response", f"{method} {url} answered something that is not JSON"
            ) from None
        if not isinstance(body, dict):
            raise FarmError("bad_response", f"{method} {url} answered {type(body).__name__}")
        return body

    # -- the API ----------------------------------------------------------------------------

    def upload_model(
        self,
        path: Path,
        filename: str | None = None,
        *,
        multipart: bool = False,
        input_shapes: str | None = None,
    ) -> dict[str, Any]:
        """POST /v1/models: an `.onnx`, a `.zip` of one with its external data, or a
        TensorFlow / PyTorch model; `input_shapes` (`-input-shapes`) let the farm convert a
        TorchScript module at upload, so one that does not convert is refused there.

        The default sends the file as the raw body (`?filename=`), which the server streams
        without a multipart parser; `multipart=True` sends the form field `file` instead."""
        name = filename or path.name
        params = {"input_shapes": input_shapes} if input_shapes else {}
        if multipart:
            form = _MultipartFile("file", path, name)
            return self._json(
                "POST", "/v1/models", params=params, content=iter(form), headers=form.headers
            )
        headers = {
            "Content-Type": "application/octet-stream",
            "Content-Length": str(path.stat().st_size),
        }
        return self._json(
            "POST",
            "/v1/models",
            params={"filename": name, **params},
            content=_file_chunks(path),
            headers=headers,
        )

    def submit_job(
        self, model_id: str, flags: Sequence[str], *, compiler: str | None = None
    ) -> dict[str, Any]:
        """POST /v1/compile-jobs with canonical flags (no -m, no -aic-binary-dir), by
        `compiler` (`backend[@version]`; None: the farm's default)."""
        body: dict[str, Any] = {"model_id": model_id, "flags": list(flags)}
        if compiler:
            body["compiler"] = compiler
        return self._json("POST", "/v1/compile-jobs", json=body)

    def get_job(self, job_id: str) -> dict[str, Any]:
        return self._json("GET", f"/v1/compile-jobs/{job_id}")

    def compare(self, a: str, b: str) -> dict[str, Any]:
        """GET /v1/compare: two QPCs (or compile jobs) side by side."""
        return self._json("GET", "/v1/compare", params={"a": a, "b": b})

    def cancel_job(self, job_id: str) -> dict[str, Any]:
        return self._json("POST", f"/v1/compile-jobs/{job_id}/cancel")

    def create_sweep(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """POST /v1/sweeps (a configurator sweep; see `qpcfarm configure`)."""
        return self._json("POST", "/v1/sweeps", json=dict(body))

    def get_sweep(self, sweep_id: str) -> dict[str, Any]:
        return self._json("GET", f"/v1/sweeps/{sweep_id}")

    def cancel_sweep(self, sweep_id: str) -> dict[str, Any]:
        return self._json("POST", f"/v1/sweeps/{sweep_id}/cancel")

    def download_qpc(self, qpc_id: str, dest: Path) -> str:
        """Stream GET /v1/qpcs/{id}/download to `dest` (atomically); its sha256.

        The bytes go to a temporary file beside `dest`, hashed on the way; `dest` appears only
        when the hash matches the ETag the server sent (when it sent one)."""
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
        tmp = Path(tmp_name)
        try:
            digest = hashlib.sha256()
            with os.fdopen(fd, "wb") as out:
                expected = self._stream_into(f"/v1/qpcs/{qpc_id}/download", out, digest)
            actual = digest.hexdigest()
            if expected and expected != actual:
                raise FarmError(
                    "checksum_mismatch",
                    f"the downloaded QPC's sha256 {actual} does not match the server's {expected}",
                )
            os.replace(tmp, dest)
            return actual
        finally:
            tmp.unlink(missing_ok=True)

    def _stream_into(self, url: str, out: BinaryIO, digest: Any) -> str:
        """Write a streamed GET's body to `out`; the sha256 its ETag names ("" if none)."""
        try:
            with self._http.stream("GET", url) as response:
                if response.status_code >= 400:
                    response.read()
                    raise api_error(response)
                etag = response.headers.get("ETag", "")
                for chunk in response.iter_bytes(CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
        except httpx.HTTPError as exc:
            raise _connection_error(self.base_url, exc) from None
        return etag_sha256(etag)


def etag_sha256(etag: str) -> str:
    """The hex sha256 in an ETag (`"abc..."`, `W/"abc..."`, `"sha256:abc..."`), else ""."""
    value = etag.strip()
    if value.startswith("W/"):
        value = value[2:]
    value = value.strip('"').lower()
    value = value.removeprefix("sha256:").removeprefix("sha256-")
    if len(value) == 64 and all(c in "0123456789abcdef" for c in value):
        return value
    return ""
