"""A replay hook's own CancelledError (it awaited a task or future someone else cancelled: a
lookup shared between requests) is the hook's failure, as its other errors are: logged, and the
stored response replayed unchanged. It went on as if the server had cancelled the request: the
retry got no answer at all (the server's plain 500) for an outcome that was committed, at every
retry, and a client that reads a 500 as "it failed" tries again under a new key (a second
effect). A cancellation of the request itself still goes through."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import pytest

from idem_middleware.responses import hooked_response
from idem_middleware.store.base import StoredResponse
from tests.apps import client, counting_pay_app


def _app(store: Any, hook: Any, mode: str) -> tuple[Any, list[int]]:
    return counting_pay_app(store, mode, replay_hook=hook)


@pytest.mark.parametrize("mode", ["transactional", "lease"])
async def test_a_hooks_own_cancelled_error_replays_the_stored_response(
    store: Any, mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    shared: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    shared.cancel()  # (another request's, cancelled when that request was)

    async def hook(response: StoredResponse, scope: Any) -> StoredResponse:
        await shared
        return response

    app, runs = _app(store, hook, mode)
    key = {"idempotency-key": "k-hooked"}
    with caplog.at_level(logging.ERROR, logger="idem_middleware"):
        async with client(app) as c:
            first = await c.post("/pay", json={}, headers=key)
            # (BaseException: ASGITransport would raise it here rather than answer 500)
            again = await asyncio.wait_for(c.post("/pay", json={}, headers=key), 5)
    assert (first.status_code, again.status_code) == (201, 201)
    assert again.json() == {"run": 1}
    assert again.headers["idempotent-replayed"] == "true"
    assert runs == [1]
    assert any("replay hook failed" in r.getMessage() for r in caplog.records)


async def test_the_requests_own_cancellation_goes_through_the_hook(store: Any) -> None:
    started = asyncio.Event()

    async def hook(response: StoredResponse, scope: Any) -> None:
        started.set()
        await asyncio.sleep(60)

    app, _ = _app(store, hook, "transactional")
    key = {"idempotency-key": "k-hooked"}
    async with client(app) as c:
        assert (await c.post("/pay", json={}, headers=key)).status_code == 201
        replay = asyncio.ensure_future(c.post("/pay", json={}, headers=key))
        await asyncio.wait_for(started.wait(), 5)
        replay.cancel()
        with pytest.raises(asyncio.CancelledError):
            await replay


async def test_a_hooks_own_cancelled_error_in_a_task_cancelled_before_is_its_failure() -> None:
    """Counted from the hook's start: a cancellation the task took (and swallowed) before it is
    not the hook's, nor makes the hook's own CancelledError the request's."""
    shared: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    shared.cancel()

    async def hook(response: StoredResponse, scope: Any) -> StoredResponse:
        await shared
        return response

    stored = StoredResponse(201, [(b"x-receipt", b"r-1")], b"{}", None)

    async def replay() -> StoredResponse:
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):  # (its count stays 1)
            await asyncio.sleep(0)
        assert task.cancelling() == 1
        return await hooked_response(hook, stored, {}, "POST /pay")

    replayed = await asyncio.wait_for(asyncio.create_task(replay()), 5)
    assert (replayed.status, replayed.body) == (201, b"{}")
