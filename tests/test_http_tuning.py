"""The app's server reads request bodies ahead in 1 MiB, not uvicorn's 64 KiB: an upload
crosses the event loop in fewer, larger pieces (see app/http_tuning.py for the figures)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from uvicorn.protocols.http import flow_control, h11_impl, httptools_impl

from qpcfarm.app.http_tuning import REQUEST_BODY_HIGH_WATER, raise_body_read_ahead
from qpcfarm.app.main import create_app


@pytest.fixture
def uvicorn_defaults() -> Iterator[None]:
    """uvicorn's own limit around the test, whatever an app made earlier set."""
    saved = httptools_impl.HIGH_WATER_LIMIT, h11_impl.HIGH_WATER_LIMIT
    httptools_impl.HIGH_WATER_LIMIT = h11_impl.HIGH_WATER_LIMIT = flow_control.HIGH_WATER_LIMIT
    try:
        yield
    finally:
        httptools_impl.HIGH_WATER_LIMIT, h11_impl.HIGH_WATER_LIMIT = saved


def test_making_the_app_raises_uvicorns_body_read_ahead_to_one_mib(
    uvicorn_defaults: None,
) -> None:
    assert httptools_impl.HIGH_WATER_LIMIT == 64 * 1024  # uvicorn's own, before the app

    create_app()

    assert REQUEST_BODY_HIGH_WATER == 1 << 20
    assert httptools_impl.HIGH_WATER_LIMIT == REQUEST_BODY_HIGH_WATER
    assert h11_impl.HIGH_WATER_LIMIT == REQUEST_BODY_HIGH_WATER


def test_a_larger_read_ahead_already_set_is_kept(uvicorn_defaults: None) -> None:
    httptools_impl.HIGH_WATER_LIMIT = 4 << 20

    raise_body_read_ahead()

    assert httptools_impl.HIGH_WATER_LIMIT == 4 << 20
    assert h11_impl.HIGH_WATER_LIMIT == REQUEST_BODY_HIGH_WATER
