"""A sender's answer is True, False or None (`outbox.Sender`): anything else is no delivery.

A sender that hands back what it got instead (`return await client.post(...)`: a Response, a
503 as well as a 200) or a coroutine it forgot to await (`return client.post(...)`: nothing
was sent at all) had its event marked sent, and it was never sent again: lost. Each is a failed
send now, saying what the sender returned, retried and parked like any other."""

from __future__ import annotations

import asyncio
import gc
import warnings
from typing import Any

import httpx
import pytest

from idem_middleware.outbox import OutboxEvent, Publisher, add

pytestmark = pytest.mark.db_routes("pgbouncer")


async def _one_event(pool: Any) -> None:
    async with pool.acquire() as conn:
        await add(conn, "t", {"x": 1})


async def _row(pool: Any) -> Any:
    return await pool.fetchrow("SELECT sent_at, attempts, last_error FROM idem_outbox")


async def _delivered() -> None:
    """What a forgotten `await` leaves: a coroutine that never ran."""


class Text(str):
    pass


ANSWERS = {
    "a 503 response": lambda: httpx.Response(503),
    "a 200 response": lambda: httpx.Response(200),
    "a coroutine": _delivered,
    "a string": lambda: Text("ok"),
    "a number": lambda: 1,
    "bytes": lambda: b"",
}


@pytest.mark.parametrize("answer", list(ANSWERS))
@pytest.mark.parametrize("kind", ["async", "plain"])
async def test_a_sender_answering_neither_true_false_nor_none_did_not_deliver(
    pool: Any, answer: str, kind: str
) -> None:
    await _one_event(pool)
    make = ANSWERS[answer]
    if kind == "async":

        async def send(event: OutboxEvent) -> Any:
            return make()
    else:

        def send(event: OutboxEvent) -> Any:  # type: ignore[misc]
            return make()

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # (a coroutine left unawaited: closed)
        report = await Publisher(pool, send, base_backoff_seconds=60).publish_batch()
        gc.collect()
    if kind == "plain" and answer == "a coroutine":
        # A plain function answering a coroutine is an async sender by another name: awaited,
        # its answer (None) is the send's.
        assert (report.sent, report.failed) == (1, 0)
        return
    assert (report.sent, report.failed) == (0, 1)
    row = await _row(pool)
    assert row["sent_at"] is None, "the event was marked sent: it is never sent again"
    assert row["attempts"] == 1
    assert "the sender returned" in row["last_error"]
    assert "not True, False or None" in row["last_error"]


@pytest.mark.parametrize("accepted", [True, None])
async def test_true_and_none_still_deliver_and_false_fails(pool: Any, accepted: Any) -> None:
    await _one_event(pool)

    async def send(event: OutboxEvent) -> Any:
        await asyncio.sleep(0)
        return accepted

    report = await Publisher(pool, send).publish_batch()
    assert (report.sent, report.failed) == (1, 0)
    assert (await _row(pool))["sent_at"] is not None


async def test_false_is_still_a_failed_send(pool: Any) -> None:
    await _one_event(pool)
    report = await Publisher(pool, lambda event: False, base_backoff_seconds=60).publish_batch()
    assert (report.sent, report.failed) == (0, 1)
    row = await _row(pool)
    assert row["sent_at"] is None
    assert row["last_error"] == "the sender reported failure"
