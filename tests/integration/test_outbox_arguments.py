"""The outbox's arguments, checked before any statement or send. Found by probing: a plain
(sync) sender, or `webhook_sender` over a sync `httpx.Client`, delivered each event and then
failed as awaited, so the event was sent again at every attempt; `requeue(pool, "evt-1")`
requeued the events `e`, `v`, `t`, `-` and `1`; `run(batches=0)` did nothing without a word;
`list_events(limit=-1)` was the server's raw error, `limit=None` every event; `add` on no
connection an AttributeError from inside; an async `progress` was taken and never run."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import httpx
import pytest

from idem_middleware import MemoryStore, PostgresStore
from idem_middleware.outbox import (
    OutboxEvent,
    Publisher,
    add,
    list_events,
    purge_sent,
    requeue,
    webhook_sender,
)


@pytest.mark.parametrize("sender", [None, "https://receiver.example/events", 5])
def test_a_sender_that_is_not_callable_is_refused_when_the_publisher_is_made(
    pool: Any, sender: Any
) -> None:
    with pytest.raises(TypeError, match="a Publisher's sender is a function of an OutboxEvent"):
        Publisher(pool, sender)


async def test_a_plain_functions_answer_is_the_send_and_the_event_is_sent_once(
    pool: Any,
) -> None:
    delivered: list[str] = []

    def sync_sender(event: OutboxEvent) -> bool:
        delivered.append(event.event_id)
        return True

    async with pool.acquire() as conn, conn.transaction():
        await add(conn, "credit", {"amount": 5}, event_id="e1")
    publisher = Publisher(pool, sync_sender, max_attempts=3, base_backoff_seconds=0.0)
    for _ in range(3):
        await publisher.publish_batch()
    assert delivered == ["e1"]
    row = await pool.fetchrow("SELECT sent_at IS NOT NULL AS sent, attempts FROM idem_outbox")
    assert (row["sent"], row["attempts"]) == (True, 1)


def test_webhook_sender_refuses_a_sync_client() -> None:
    with httpx.Client() as client, pytest.raises(TypeError, match="an async client"):
        webhook_sender(client, "https://receiver.example/events")


@pytest.mark.parametrize("ids", ["evt-1", b"evt-1", bytearray(b"evt-1"), [1], 7])
async def test_requeue_refuses_what_is_no_list_of_ids(pool: Any, ids: Any) -> None:
    async with pool.acquire() as conn, conn.transaction():
        await add(conn, "credit", {}, event_id="e")  # (what "evt-1" read as letters named)
    await pool.execute("UPDATE idem_outbox SET parked_at = now()")
    with pytest.raises(TypeError, match="event_ids is a list of event ids"):
        await requeue(pool, ids)
    assert await pool.fetchval("SELECT parked_at IS NOT NULL FROM idem_outbox")


@pytest.mark.parametrize("batches", [0, -1, "2", 1.5, True])
async def test_run_refuses_a_count_of_batches_that_is_no_whole_number_from_one(
    pool: Any, batches: Any
) -> None:
    async def sender(event: OutboxEvent) -> bool:
        return True

    with pytest.raises(ValueError, match="batches must be an integer from 1"):
        await Publisher(pool, sender).run(batches=batches)


@pytest.mark.parametrize("limit", [-1, None, 1.5, 2**63])
async def test_list_events_refuses_a_limit_that_is_no_whole_number_from_zero(
    pool: Any, limit: Any
) -> None:
    with pytest.raises(ValueError, match="limit must be a whole number from 0"):
        await list_events(pool, limit=limit)


async def test_add_on_no_connection_is_a_type_error_naming_what_it_takes() -> None:
    with pytest.raises(TypeError, match="the handler's asyncpg connection"):
        await add(None, "credit", {})


async def test_an_async_progress_is_refused_before_anything_is_deleted(pool: Any) -> None:
    async def progress(count: int) -> None: ...

    async with pool.acquire() as conn, conn.transaction():
        await add(conn, "credit", {}, event_id="old")
    await pool.execute("UPDATE idem_outbox SET sent_at = now() - interval '30 days'")
    refused = r"an async one, .* would never run"
    with pytest.raises(ValueError, match=refused):
        await purge_sent(pool, older_than_seconds=0, progress=progress)  # type: ignore[arg-type]
    assert await pool.fetchval("SELECT count(*) FROM idem_outbox") == 1
    async with PostgresStore(pool=pool) as store:
        with pytest.raises(ValueError, match=refused):
            await store.purge(progress=progress)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=refused):
        await MemoryStore().purge(progress=progress)  # type: ignore[arg-type]


async def test_a_sender_answering_with_an_awaitable_of_its_own_is_awaited(pool: Any) -> None:
    """Not only a coroutine: a future (a callback-style client's) is awaited too."""
    delivered: list[str] = []

    def future_sender(event: OutboxEvent) -> Any:
        delivered.append(event.event_id)
        answered = asyncio.get_running_loop().create_future()
        answered.set_result(True)
        return answered

    async with pool.acquire() as conn, conn.transaction():
        await add(conn, "credit", {}, event_id="e1")
    report = await Publisher(pool, future_sender).publish_batch()
    assert (report.sent, report.failed, delivered) == (1, 0, ["e1"])


async def test_requeue_takes_any_iterable_of_ids(pool: Any) -> None:
    async with pool.acquire() as conn, conn.transaction():
        await add(conn, "credit", {}, event_id="evt-1")
        await add(conn, "credit", {}, event_id="evt-2")
    await pool.execute("UPDATE idem_outbox SET parked_at = now()")
    assert await requeue(pool, (event_id for event_id in ["evt-1"])) == 1
    assert await requeue(pool, {"evt-2": None}.keys()) == 1


@pytest.mark.parametrize("stop", [threading.Event(), True], ids=["threading.Event", "True"])
async def test_run_refuses_a_stop_that_is_no_asyncio_event(pool: Any, stop: Any) -> None:
    """Found by probing: a threading.Event was taken, and each idle pause waited on it with its
    blocking `wait`, the whole event loop frozen meanwhile."""

    async def sender(event: Any) -> bool:  # pragma: no cover - nothing is due
        return True

    with pytest.raises(TypeError, match=r"stop is an asyncio\.Event"):
        await Publisher(pool, sender).run(stop=stop)


async def test_run_takes_an_anyio_event_as_stop(pool: Any) -> None:
    """An anyio Event (what Starlette's and FastAPI's task groups hand out) has an awaited
    `wait`, as asyncio's has: it is taken (found by review of the check above)."""
    import anyio

    async def sender(event: Any) -> bool:  # pragma: no cover - nothing is due
        return True

    stop = anyio.Event()
    stop.set()
    report = await Publisher(pool, sender).run(stop=stop)
    assert report.sent == 0
