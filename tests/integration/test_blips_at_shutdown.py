"""Lease-mode settlements around the store's close: a store that is closed (or was never
opened) refuses work for good, so a settlement that meets it is not sent again as if it had met
a blip (resettle.py); and a shutdown while the database is down stays within its bound."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from idem_middleware import IdempotencyContext
from idem_middleware.errors import StoreClosed, StoreError, blip
from idem_middleware.jobs import idempotent_job
from idem_middleware.policy import Mode
from idem_middleware.store.base import RecordKey, State
from idem_middleware.store.postgres import closing
from tests.apps import one_route_app
from tests.apps.clients import asgi_request
from tests.integration.test_settlement_blips import BOUND, KEY, POLICY, SettleLog, until
from tests.restarts import OwnServer

#: Long enough that sending a settlement again for a third of it would show.
LEASE_SECONDS = 3.0


def test_a_closed_store_is_no_blip() -> None:
    assert not blip(StoreClosed("the store is closed"))
    assert blip(StoreError("ConnectionRefusedError: the server is down"))


async def test_a_job_that_ends_after_the_store_closed_is_not_sent_again(db_dsn: str) -> None:
    """A job (a queue consumer's, which the store's close does not wait for) ends after the
    store closed: its settlement met "the store is closed", taken for a blip, and was sent
    again with backoff for a third of its lease, every try refused the same way, before the
    job's caller got the StoreError. Now the first refusal stands."""
    entered, release = asyncio.Event(), asyncio.Event()
    store = SettleLog(dsn=db_dsn, min_size=1, max_size=2, listen=False)
    store.settlements = []
    await store.open()

    @idempotent_job(
        store, operation="payout", key="ref", mode=Mode.LEASE, lease_seconds=LEASE_SECONDS
    )
    async def payout(job: IdempotencyContext, *, ref: str) -> dict[str, str]:
        entered.set()
        await asyncio.wait_for(release.wait(), BOUND)
        return {"paid": ref}

    running = asyncio.create_task(payout(ref="after-close"))
    await asyncio.wait_for(entered.wait(), BOUND)
    await asyncio.wait_for(store.close(), BOUND)
    release.set()
    with pytest.raises(StoreClosed, match="the store is closed"):
        await asyncio.wait_for(running, BOUND)
    # One try at the outcome, one at marking it unknown: neither sent again.
    assert store.settlements == [(State.SUCCEEDED, False), (State.UNKNOWN, False)]
    async with SettleLog(dsn=db_dsn, min_size=1, max_size=1, listen=False) as reader:
        record = await reader.get(RecordKey("", "payout", "after-close"))
    assert record is not None
    assert record.state is State.PENDING  # (until its lease lapses: nothing could mark it)


async def test_a_shutdown_while_the_database_is_down_is_bounded_and_says_what_it_left(
    own_server: OwnServer,
    own_dsn: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A deploy during a database outage: the server cancels a lease-mode request, whose
    executor sends its `unknown` mark again for up to a third of the lease (20 s here). The
    store's close waits for it only within its own bound, says it left the record `pending`,
    and closes; the execution's next try then meets the closed store and ends, rather than
    trying on, every try refused, for what was left of its third of the lease. The request's
    task ends cancelled, as the server asked."""
    monkeypatch.setattr(closing, "CLOSE_SECONDS", 1.0)
    entered = asyncio.Event()

    async def charge(request: Request) -> Response:
        entered.set()
        await asyncio.sleep(BOUND * 2)  # (cancelled by the shutdown)
        return JSONResponse({"charged": True}, status_code=201)

    store = SettleLog(dsn=own_dsn, min_size=1, max_size=2, listen=False)
    store.settlements = []
    await store.open()
    app = one_route_app("/charges", charge, store=store, policies={"POST /charges": POLICY})
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    request = asyncio.create_task(app(asgi_request("/charges", "down", 2), receive, send))
    await asyncio.wait_for(entered.wait(), BOUND)
    await asyncio.to_thread(own_server.stop)
    try:
        request.cancel()
        await until(lambda: store.settlements, "an unknown mark tried with the server down")
        with caplog.at_level(logging.WARNING, logger="idem_middleware.store"):
            await asyncio.wait_for(store.close(), BOUND)
        assert "1 cancelled lease-mode executions or claims did not finish" in caplog.text
        tried = len(store.settlements)
        # The cancellation goes on (a StoreError took its place: the task ended as if never
        # cancelled, answered `503 store-unavailable`). The client is told it was cancelled.
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(request, BOUND)
        assert [m.get("status") for m in sent] == [503, None]
        assert b"request-cancelled" in sent[1]["body"]
        # At most the try under way when the pool closed; none after it.
        assert len(store.settlements) <= tried + 1
        assert {state for state, _ in store.settlements} == {State.UNKNOWN}
        assert not any(done for _, done in store.settlements)
    finally:
        await asyncio.to_thread(own_server.start)
    async with SettleLog(dsn=own_dsn, min_size=1, max_size=1, listen=False) as reader:
        record = await reader.get(RecordKey(KEY.tenant, KEY.operation, "down"))
    assert record is not None
    assert record.state is State.PENDING  # (until its lease lapses, as the warning said)
