"""uvicorn's read-ahead of request bodies, sized for model uploads.

uvicorn stops reading a connection once 64 KiB of its request body wait for the app
(`flow_control.HIGH_WATER_LIMIT`) and starts again on the app's next `receive()`: an upload
then crosses the event loop in 64 KiB pieces, each a pause, a resume and a message, and a
bare uvicorn app that only counts the bytes of a 64 MiB body received them at 170-360 MiB/s
on this project's 2-CPU machine (a `sendfile` client); with 1 MiB it was 395-445 MiB/s. The
body still never sits whole in memory: at most `REQUEST_BODY_HIGH_WATER` (plus one socket
read) per connection, on top of the upload pipe's own bound (`api.uploads`).

uvicorn (pinned in pyproject.toml) reads the limit from each protocol module's global at
every body chunk, so setting it in the process that serves is enough; `create_app` does it,
which covers `serve --workers N` (each worker process builds its app).
"""

from __future__ import annotations

REQUEST_BODY_HIGH_WATER = 1 << 20


def raise_body_read_ahead(limit: int = REQUEST_BODY_HIGH_WATER) -> None:
    """Let uvicorn's HTTP protocols (httptools, h11) buffer up to `limit` bytes of a request
    body before they pause reading. A no-op without uvicorn or if it already buffers more."""
    try:
        from uvicorn.protocols.http import h11_impl, httptools_impl
    except ImportError:  # served by something else (or uvicorn without httptools)
        try:
            from uvicorn.protocols.http import h11_impl

            modules: tuple[object, ...] = (h11_impl,)
        except ImportError:
            return
    else:
        modules = (httptools_impl, h11_impl)
    for module in modules:
        if getattr(module, "HIGH_WATER_LIMIT", limit) < limit:
            module.HIGH_WATER_LIMIT = limit  # type: ignore[attr-defined]
