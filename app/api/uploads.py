"""Stream a request body into a blocking consumer (the blob store), never whole in memory.

Two ways in: `multipart/form-data` with one file part (form fields must come before it, as
in S3's browser uploads: the consumer starts as soon as the file does), or a raw body
(`application/octet-stream`, name in `?filename=`). The event loop reads the body, parses
multipart with python-multipart's streaming parser, and hands the file's bytes through a
small bounded buffer to a worker thread running the consumer (store.put while hashing, then
the service's checks). At most `BUFFER_ITEMS * FORWARD_BYTES` of an upload is in memory.

Limits: a Content-Length over the limit is refused before a byte is read; without one, the
store refuses as soon as the streamed size passes it. Either way it is 413 `upload_too_large`
and the store keeps nothing. A body that breaks off mid-way makes the consumer's stream raise,
so a truncated upload is never stored as if complete.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import anyio
import anyio.abc
import anyio.from_thread
import anyio.to_thread
from fastapi import Request
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import ClientDisconnect

from app.api.errors import ApiError, invalid_request, upload_too_large
from app.domain.services.errors import ServiceError

T = TypeVar("T")

FORWARD_BYTES = 1 << 20
"""Network chunks are coalesced to about this size before they cross to the worker thread."""
BUFFER_ITEMS = 4
MULTIPART_OVERHEAD = 64 << 10
"""Room for boundaries, part headers and small fields around a file of the maximum size."""
MAX_FIELD_BYTES = 16 << 10
MAX_FIELDS = 32
MAX_PART_HEADER_BYTES = 8 << 10
UPLOAD_THREADS = 64
"""Uploads run in threads of their own (`upload_limiter`), so that slow clients holding
uploads open never starve the thread pool of the other routes."""

UPLOAD_BODY_DOC: dict[str, Any] = {
    "required": True,
    "content": {
        "multipart/form-data": {
            "schema": {
                "type": "object",
                "properties": {"file": {"type": "string", "format": "binary"}},
                "required": ["file"],
            },
            "encoding": {"file": {"contentType": "application/octet-stream"}},
        },
        "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
    },
}
"""OpenAPI request body of the upload routes (they read the stream themselves)."""


@dataclass
class Upload:
    """What is known when the file starts: its name and the form fields sent before it."""

    filename: str | None
    fields: dict[str, str] = field(default_factory=dict)


Consumer = Callable[[Upload, Iterator[bytes]], T]


class UploadInterrupted(Exception):
    """The request body ended before it was complete (client gone, connection cut)."""


async def receive_upload(
    request: Request,
    consume: Consumer[T],
    *,
    max_bytes: int,
    filename: str | None = None,
    file_field: str = "file",
) -> T:
    """Run `consume(upload, chunks)` in a worker thread over the uploaded file's bytes, as
    they arrive; return its result. `consume` must read `chunks` to the end (or raise)."""
    media_type, params = parse_options_header(request.headers.get("content-type"))
    multipart = media_type == b"multipart/form-data"
    body_limit = max_bytes + (MULTIPART_OVERHEAD if multipart else 0)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > body_limit:
        raise upload_too_large(max_bytes)

    body: _Body
    if multipart:
        boundary = params.get(b"boundary")
        if not boundary:
            raise invalid_request("multipart/form-data without a boundary")
        body = _MultipartBody(boundary, file_field)
    elif media_type in (b"", b"application/octet-stream"):
        body = _RawBody(filename)
    else:
        raise ApiError(
            "unsupported_media_type",
            f"send multipart/form-data or application/octet-stream, not {media_type.decode()}",
            415,
        )
    try:
        return await _pump(request, body, consume, body_limit, max_bytes)
    except ServiceError as exc:
        if exc.code == "too_large":  # the store's refusal of a stream that passed the limit
            raise upload_too_large(max_bytes) from None
        raise


def upload_limiter(request: Request) -> anyio.CapacityLimiter:
    """The app's limiter of upload threads, made on first use (inside the event loop)."""
    limiter: anyio.CapacityLimiter | None = getattr(request.app.state, "upload_limiter", None)
    if limiter is None:
        limiter = anyio.CapacityLimiter(UPLOAD_THREADS)
        request.app.state.upload_limiter = limiter
    return limiter


@dataclass
class _Outcome(Generic[T]):
    value: T | None = None
    error: BaseException | None = None
    started: bool = False


class _Pipe:
    """A bounded hand-over of byte chunks from the event loop to one worker thread."""

    def __init__(self) -> None:
        self.send, self.receive = anyio.create_memory_object_stream[bytes](BUFFER_ITEMS)
        self.broken: BaseException | None = None
        """Set by the event loop before it closes `send` when the body did not end cleanly."""

    def chunks(self) -> Iterator[bytes]:
        """The file's bytes, in the worker thread; raises if the body broke off."""
        while True:
            try:
                chunk = anyio.from_thread.run(self.receive.receive)
            except anyio.EndOfStream:
                if self.broken is not None:
                    raise UploadInterrupted("the request body ended early") from self.broken
                return
            yield chunk


async def _pump(
    request: Request, body: _Body, consume: Consumer[T], body_limit: int, max_bytes: int
) -> T:
    pipe = _Pipe()
    limiter = upload_limiter(request)
    outcome: _Outcome[T] = _Outcome()
    host_error: BaseException | None = None

    def run(upload: Upload) -> T:
        try:
            return consume(upload, pipe.chunks())
        finally:
            anyio.from_thread.run_sync(pipe.receive.close)

    async def consumer(upload: Upload) -> None:
        try:
            outcome.value = await anyio.to_thread.run_sync(run, upload, limiter=limiter)
        except Exception as exc:  # reported after the task group; cancellation propagates
            outcome.error = exc

    pending: list[bytes] = []
    pending_bytes = 0

    async def forward(force: bool) -> None:
        nonlocal pending_bytes
        if pending and (force or pending_bytes >= FORWARD_BYTES):
            data = pending[0] if len(pending) == 1 else b"".join(pending)
            pending.clear()
            pending_bytes = 0
            await pipe.send.send(data)

    file_open = True

    async def handle(events: list[Event], tg: anyio.abc.TaskGroup) -> None:
        nonlocal file_open, pending_bytes
        for event in events:
            if isinstance(event, Upload):
                outcome.started = True
                tg.start_soon(consumer, event)
            elif isinstance(event, _EndOfFile):
                await forward(force=True)
                file_open = False
                pipe.send.close()
            else:
                pending.append(event)
                pending_bytes += len(event)
                await forward(force=False)

    async with anyio.create_task_group() as tg:
        try:
            received = 0
            async for chunk in request.stream():
                received += len(chunk)
                if received > body_limit:
                    raise upload_too_large(max_bytes)
                await handle(body.feed(chunk), tg)
            await handle(body.finish(), tg)
            if file_open:
                await forward(force=True)
        except anyio.BrokenResourceError:
            pass  # the consumer stopped reading: it refused the upload, its error answers
        except Exception as exc:
            pipe.broken = host_error = exc
        except BaseException as exc:  # cancelled: the consumer must not see a clean end
            pipe.broken = exc
            raise
        finally:
            pipe.send.close()
    if outcome.error is not None and not isinstance(outcome.error, UploadInterrupted):
        raise outcome.error
    if isinstance(host_error, ClientDisconnect):
        raise ApiError("upload_interrupted", "the request body ended before it was complete")
    if host_error is not None:
        raise host_error
    if outcome.error is not None:
        raise outcome.error
    if not outcome.started:
        raise invalid_request(f"the form has no file part (send the file as field {body.field!r})")
    return outcome.value  # type: ignore[return-value]


class _EndOfFile:
    pass


_END = _EndOfFile()
Event = Upload | bytes | _EndOfFile


class _Body:
    field = "file"

    def feed(self, chunk: bytes) -> list[Event]:
        raise NotImplementedError

    def finish(self) -> list[Event]:
        """The body ended: the last events, or an error if it is incomplete."""
        raise NotImplementedError


class _RawBody(_Body):
    def __init__(self, filename: str | None) -> None:
        self._filename = filename
        self._started = False

    def feed(self, chunk: bytes) -> list[Event]:
        if self._started:
            return [chunk]
        self._started = True
        return [Upload(self._filename), chunk]

    def finish(self) -> list[Event]:
        if self._started:
            return []
        self._started = True  # an empty body: the consumer still sees (and judges) it
        return [Upload(self._filename)]


class _MultipartBody(_Body):
    """python-multipart's streaming parser, turned into file events and small form fields."""

    def __init__(self, boundary: bytes, file_field: str) -> None:
        self.field = file_field
        self._events: list[Event] = []
        self._fields: dict[str, str] = {}
        self._header_name = bytearray()
        self._header_value = bytearray()
        self._headers: dict[str, bytes] = {}
        self._part: str | None = None  # "file" | "field" | "skip"
        self._name = ""
        self._value = bytearray()
        self._file_seen = False
        self._file_done = False
        self._ended = False
        self._error: ApiError | None = None
        self._parser = MultipartParser(
            boundary,
            callbacks={
                "on_part_begin": self._part_begin,
                "on_header_field": self._header_field,
                "on_header_value": self._header_value_cb,
                "on_header_end": self._header_end,
                "on_headers_finished": self._headers_finished,
                "on_part_data": self._part_data,
                "on_part_end": self._part_end,
                "on_end": self._end,
            },
            max_header_size=MAX_PART_HEADER_BYTES,
        )

    def feed(self, chunk: bytes) -> list[Event]:
        try:
            self._parser.write(chunk)
        except FormParserError as exc:
            raise invalid_request(f"malformed multipart body: {exc}") from None
        if self._error is not None:
            raise self._error
        events, self._events = self._events, []
        return events

    def finish(self) -> list[Event]:
        if not self._ended:
            raise invalid_request("the multipart body ended before its closing boundary")
        return []

    def _fail(self, message: str) -> None:
        if self._error is None:
            self._error = invalid_request(message)

    def _part_begin(self) -> None:
        self._headers = {}
        self._part = None

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_name += data[start:end]

    def _header_value_cb(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]

    def _header_end(self) -> None:
        name = self._header_name.decode("latin-1").strip().lower()
        self._headers[name] = bytes(self._header_value)
        self._header_name.clear()
        self._header_value.clear()

    def _headers_finished(self) -> None:
        disposition, params = parse_options_header(self._headers.get("content-disposition"))
        name = params.get(b"name", b"").decode("utf-8", "replace")
        filename = params.get(b"filename")
        if disposition != b"form-data" or not name:
            self._fail("a multipart part without a form-data name")
            self._part = "skip"
            return
        if name == self.field or filename is not None:
            if self._file_seen:
                self._fail("only one file per upload")
                self._part = "skip"
                return
            self._file_seen = True
            self._part = "file"
            shown = filename.decode("utf-8", "replace") if filename is not None else None
            self._events.append(Upload(shown, dict(self._fields)))
            return
        if self._file_seen:
            self._fail(f"form field {name!r} must come before the file part")
            self._part = "skip"
            return
        if len(self._fields) >= MAX_FIELDS:
            self._fail(f"more than {MAX_FIELDS} form fields")
        self._part = "field"
        self._name = name
        self._value.clear()

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if self._part == "file":
            self._events.append(data[start:end])
        elif self._part == "field":
            self._value += data[start:end]
            if len(self._value) > MAX_FIELD_BYTES:
                self._fail(f"form field {self._name!r} is longer than {MAX_FIELD_BYTES} bytes")
                self._part = "skip"

    def _part_end(self) -> None:
        if self._part == "file":
            self._file_done = True
            self._events.append(_END)
        elif self._part == "field":
            self._fields[self._name] = self._value.decode("utf-8", "replace")
        self._part = None

    def _end(self) -> None:
        self._ended = True
