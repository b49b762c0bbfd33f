"""A publisher whose task is cancelled stops, even when its sender caught the cancellation (a
client that retries on any error, CancelledError included, and then delivers): the send that
went through is marked sent (never sent again), and no further event is reserved."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from idem_middleware.outbox import OutboxEvent, Publisher, add
from tests.apps import BOUND


async def test_a_cancelled_publisher_stops_when_its_sender_swallowed_the_cancellation(
    pool: Any,
) -> None:
    async with pool.acquire() as conn:
        for n in range(5):
            await add(conn, "t", {"n": n}, event_id=f"e-{n}")
    sending = asyncio.Event()
    delivered: list[str] = []

    async def swallowing(event: OutboxEvent) -> bool:
        sending.set()
        with contextlib.suppress(asyncio.CancelledError):  # (the send goes on and delivers)
            await asyncio.sleep(0.2)
        delivered.append(event.event_id)
        return True

    task = asyncio.ensure_future(Publisher(pool, swallowing).run(idle_seconds=0.05))
    await asyncio.wait_for(sending.wait(), BOUND)
    task.cancel()
    # It ran on and sent every event, then idled for ever: a shutdown awaiting it hung.
    done, _ = await asyncio.wait([task], timeout=2)
    if not done:
        task.cancel()
        await asyncio.wait([task], timeout=BOUND)
    assert done, "the cancelled publisher went on"
    assert task.cancelled()
    assert delivered == ["e-0"]  # no further event reserved
    rows = await pool.fetch("SELECT event_id FROM idem_outbox WHERE sent_at IS NOT NULL")
    assert [r["event_id"] for r in rows] == ["e-0"]  # the delivered one marked: not sent again
    reserved = await pool.fetchval(
        "SELECT count(*) FROM idem_outbox WHERE attempts > 0 AND sent_at IS NULL"
    )
    assert reserved == 0
