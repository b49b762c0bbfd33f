"""A CancelledError the handler raises itself (it awaited a task cancelled elsewhere), while
nobody cancels the request, is an error of the handler's: the server answers it 500, as any
other. Found by probing: it was answered `503 request-cancelled` + `Retry-After: 1` ("the server
stopped this request ... it is shutting down"), and its clients retried it every second, for
ever. A request the server does cancel is still answered 503 (test_cancelled_answer_bounded)."""

from __future__ import annotations

import asyncio

import pytest
from starlette.requests import Request
from starlette.responses import Response

from idem_middleware import MemoryStore, Policy
from idem_middleware.policy import Mode
from idem_middleware.store.base import new_record_key
from tests.apps import asgi_request, one_route_app
from tests.apps.concurrency import Leaves

pytestmark = pytest.mark.asyncio

BODY = b'{"amount": 5}'


@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
async def test_a_handlers_own_cancelled_error_is_not_answered_as_a_shutdown(mode: Mode) -> None:
    runs: list[int] = []

    async def handler(request: Request) -> Response:
        await request.body()
        runs.append(1)
        helper = asyncio.create_task(asyncio.sleep(10))
        helper.cancel()
        await helper  # raises CancelledError here, in the handler itself
        raise AssertionError("not reached")

    store = MemoryStore()
    app = one_route_app("/pay", handler, store=store, default_policy=Policy(mode=mode))
    client = Leaves(BODY)  # (never told to leave)
    task = asyncio.create_task(
        app(asgi_request("/pay", "k-own", len(BODY)), client.receive, client.send)
    )
    done, _ = await asyncio.wait({task}, timeout=5)
    assert done
    assert runs == [1]
    # The error goes on to the server (which answers 500), with nothing sent before it.
    assert task.cancelled()
    assert client.sent == []
    record = await store.get(new_record_key(("tenant-a", "POST /pay", "k-own")))
    if mode is Mode.TRANSACTIONAL:
        assert record is None  # rolled back with its claim: a retry runs it again
    else:
        assert record is not None
        assert record.state.value == "unknown"
