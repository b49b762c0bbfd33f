"""A task cancelled just as the event it waits for is set ends cancelled. `asyncio.wait_for`
(Python 3.11) returned normally then, and the cancellation was lost: a lease execution awaiting
its heartbeat answered 201 and returned as if never cancelled (its `asyncio.timeout` missed), a
duplicate the server cancelled as the key was freed went on to claim it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from idem_middleware.context import IdempotencyContext
from idem_middleware.heartbeat import keep_lease
from idem_middleware.policy import Mode
from idem_middleware.store.base import EventWatch
from idem_middleware.waiting import Waiters, wait_at_most


async def _cancelled_as_set(event: asyncio.Event, waiting: Any) -> None:
    task = asyncio.ensure_future(waiting)
    for _ in range(3):
        await asyncio.sleep(0)  # it waits for the event
    event.set()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)


async def test_wait_at_most() -> None:
    event = asyncio.Event()
    await _cancelled_as_set(event, wait_at_most(event, 30))
    event.set()
    await asyncio.wait_for(wait_at_most(event, 30), 5)  # (set: at once)
    await asyncio.wait_for(wait_at_most(asyncio.Event(), 0.01), 5)  # (not set: the time)


async def test_a_heartbeat_waiting_for_its_next_renewal() -> None:
    stop = asyncio.Event()
    context = IdempotencyContext(
        tenant="t", operation="POST /x", key="k", generation=1, mode=Mode.LEASE, connection=None
    )
    lease = keep_lease(object(), context, 30.0, stop, held_until=1e9, renew_now=False)
    await _cancelled_as_set(stop, lease)


async def test_a_duplicate_waiting_for_the_holder() -> None:
    waiters = Waiters(8)
    waiting = asyncio.ensure_future(waiters.wait("k", 30))
    for _ in range(3):
        await asyncio.sleep(0)
    waiters.wake("k")
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(waiting, 5)


async def test_a_store_watch_a_lease_mode_job_waits_on() -> None:
    """`EventWatch.wait` (a lease-mode job's wait for its key, on either store) used
    `asyncio.wait_for`: a job cancelled as the record was released went on to claim the key and
    run its function (a worker's shutdown cancelled it, and the downstream call was made all
    the same). Found by probing."""
    event = asyncio.Event()
    watch = EventWatch(event)
    await _cancelled_as_set(event, watch.wait(30))
    event.set()
    assert await asyncio.wait_for(watch.wait(30), 5)  # (set: at once, and cleared)
    assert not event.is_set()
    assert not await asyncio.wait_for(watch.wait(0.01), 5)  # (not set: the time)
