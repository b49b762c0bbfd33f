"""The plugin's `idem_store` fixture (see `pytest_plugin`, which registers this module once the
plugins `-p` names are loaded: its decorator is pytest-asyncio's, when that is installed)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import pytest

from . import pytest_plugin  # (its `_CLOSE_SECONDS`, read when a test ends)

if TYPE_CHECKING:
    from .store.postgres import PostgresStore

try:  # the async fixture's decorator: pytest-asyncio's, else pytest's (anyio's plugin runs it)
    from pytest_asyncio import fixture as _async_fixture
except ModuleNotFoundError:  # this module loads in every pytest run of a project with the package
    _async_fixture = pytest.fixture  # type: ignore[assignment]


def _other_loop(request: pytest.FixtureRequest) -> str | None:
    """Why the test runs in another event loop than its function-scoped async fixtures, if it
    does: asyncpg's pool belongs to the loop it was made in, and the test then fails with
    "attached to a different loop" errors that name neither setting."""
    if "anyio_backend" in request.fixturenames:  # an anyio test (`@pytest.mark.anyio`)
        return _under_anyio(request)
    marker = request.node.get_closest_marker("asyncio")
    if marker is None:  # not an asyncio test: nothing of the store runs in it
        return None
    config = request.config
    # (`scope=`: the marker's older spelling, which pytest-asyncio still honours)
    scope = marker.kwargs.get("loop_scope") or marker.kwargs.get("scope")
    test = scope or _ini(config, "asyncio_default_test_loop_scope")
    fixture = _ini(config, "asyncio_default_fixture_loop_scope")
    fixture = "function" if fixture in (None, "", "fixture-scope") else fixture
    if (test or "function") == fixture:
        return None
    return (
        f"idem_store is made in the {fixture}-scoped event loop (asyncio_default_fixture_loop_"
        f"scope) but this test runs in the {test}-scoped one: asyncpg's pool works only in the "
        "loop that made it. Give both the same scope (both unset: function)"
    )


def _ini(config: pytest.Config, name: str) -> object:
    """An ini setting of pytest-asyncio's; None where its version has none (before 0.24 and 0.26
    they were unknown names, and every asyncio test using idem_store failed at its setup)."""
    try:
        return config.getini(name)
    except ValueError:
        return None


def _under_anyio(request: pytest.FixtureRequest) -> str | None:
    """Why an anyio test cannot use idem_store, if it cannot. Under pytest-asyncio's auto mode
    the fixture ran in pytest-asyncio's loop and the test in anyio's: the test failed on the
    store's pool with a message about loop scopes, which are not the cause."""
    backend = request.getfixturevalue("anyio_backend")
    name = backend if isinstance(backend, str) else backend[0]
    if name != "asyncio":
        return f"idem_store needs asyncio (asyncpg runs on nothing else); this test runs on {name}"
    try:  # (as pytest-asyncio reads it: its command-line option first, then the ini file)
        mode = request.config.getoption("asyncio_mode", None) or request.config.getini(
            "asyncio_mode"
        )
    except ValueError:  # pytest-asyncio is not installed
        return None
    if str(mode) != "auto":
        return None
    return (
        "this test runs in anyio's event loop, while pytest-asyncio's asyncio_mode = auto makes "
        "idem_store in a loop of its own: asyncpg's pool works only in the loop that made it. "
        "Mark the test @pytest.mark.asyncio instead of anyio, or set asyncio_mode = strict"
    )


@_async_fixture
async def idem_store(
    idem_clean_dsn: str, request: pytest.FixtureRequest
) -> AsyncIterator[PostgresStore]:
    """An open PostgresStore on the test database, with no records, tokens or outbox events."""
    mismatch = _other_loop(request)
    if mismatch is not None:
        pytest.fail(mismatch, pytrace=False)
    import asyncpg  # (the store and its driver load when a test asks for them, not with the plugin)

    from .store.postgres import PostgresStore

    pool = await asyncpg.create_pool(idem_clean_dsn, min_size=1, max_size=10)
    try:
        async with PostgresStore(pool=pool) as store:
            yield store
    finally:
        try:
            # asyncpg's close waits, without end, for every connection to come back.
            await asyncio.wait_for(pool.close(), pytest_plugin._CLOSE_SECONDS)
        except TimeoutError:  # close() terminated the pool when it was cancelled
            seconds = pytest_plugin._CLOSE_SECONDS
            pytest.fail(
                f"idem_store: a connection of the store's pool was still in use {seconds:g}"
                " s after the test ended (a request still running, or a connection acquired and "
                "never released); the pool was terminated",
                pytrace=False,
            )
