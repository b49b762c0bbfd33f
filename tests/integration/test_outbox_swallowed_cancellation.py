"""A publisher whose task is cancelled stops, even when its sender caught the cancellation (a
client that retries on any error, CancelledError included, and then delivers, or reports a
failure): the send that went through is marked (never sent again), and no further event is
reserved. A cancellation under way before a send (a batch run to drain the outbox while its
task is being cancelled) stops nothing: only one caught since does."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from idem_middleware.outbox import OutboxEvent, Publisher, add
from tests.apps import BOUND


async def _five(pool: Any) -> None:
    async with pool.acquire() as conn:
        for n in range(5):
            await add(conn, "t", {"n": n}, event_id=f"e-{n}")


async def _cancelled_in_its_first_send(
    pool: Any, sender: Callable[[OutboxEvent], Awaitable[bool]], sending: asyncio.Event
) -> None:
    """Runs a publisher with `sender`, cancels it once `sending` is set, and checks that it ends
    cancelled (it ran on and sent every event, then idled for ever: a shutdown awaiting it hung)."""
    task = asyncio.ensure_future(Publisher(pool, sender).run(idle_seconds=0.05))
    await asyncio.wait_for(sending.wait(), BOUND)
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=2)
    if not done:
        task.cancel()
        await asyncio.wait([task], timeout=BOUND)
    assert done, "the cancelled publisher went on"
    assert task.cancelled()


async def test_a_cancelled_publisher_stops_when_its_sender_swallowed_the_cancellation(
    pool: Any,
) -> None:
    await _five(pool)
    sending = asyncio.Event()
    delivered: list[str] = []

    async def swallowing(event: OutboxEvent) -> bool:
        sending.set()
        with contextlib.suppress(asyncio.CancelledError):  # (the send goes on and delivers)
            await asyncio.sleep(0.2)
        delivered.append(event.event_id)
        return True

    await _cancelled_in_its_first_send(pool, swallowing, sending)
    assert delivered == ["e-0"]  # no further event reserved
    rows = await pool.fetch("SELECT event_id FROM idem_outbox WHERE sent_at IS NOT NULL")
    assert [r["event_id"] for r in rows] == ["e-0"]  # the delivered one marked: not sent again
    reserved = await pool.fetchval(
        "SELECT count(*) FROM idem_outbox WHERE attempts > 0 AND sent_at IS NULL"
    )
    assert reserved == 0


async def test_a_failed_send_that_caught_the_cancellation_stops_the_publisher(pool: Any) -> None:
    await _five(pool)
    sending = asyncio.Event()
    tried: list[str] = []

    async def swallowing_then_failing(event: OutboxEvent) -> bool:
        tried.append(event.event_id)
        sending.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(0.2)
        return False  # (the receiver refused it)

    await _cancelled_in_its_first_send(pool, swallowing_then_failing, sending)
    assert tried == ["e-0"]
    row = await pool.fetchrow("SELECT attempts, last_error FROM idem_outbox WHERE event_id='e-0'")
    assert row["attempts"] == 1
    assert row["last_error"] == "the sender reported failure"  # its failure marked


async def test_a_batch_run_while_its_task_is_being_cancelled_sends_every_event(pool: Any) -> None:
    await _five(pool)
    delivered: list[str] = []

    async def send(event: OutboxEvent) -> bool:
        delivered.append(event.event_id)
        return True

    publisher = Publisher(pool, send)
    started = asyncio.Event()

    async def drained_when_cancelled() -> Any:
        try:
            started.set()
            await asyncio.sleep(BOUND)
        except asyncio.CancelledError:
            # (the task's cancellation is under way, not uncancelled: a last drain)
            assert asyncio.current_task().cancelling() == 1  # type: ignore[union-attr]
            return await publisher.publish_batch()
        raise AssertionError("never cancelled")

    task = asyncio.ensure_future(drained_when_cancelled())
    await asyncio.wait_for(started.wait(), BOUND)
    task.cancel()
    report = await asyncio.wait_for(task, BOUND)
    assert report.sent == 5
    assert delivered == [f"e-{n}" for n in range(5)]
