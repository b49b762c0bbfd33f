"""Pinned: a holder's end wakes the waiters waiting when it ended, and only them
(waiting.Waiters.wake forgets the key's event as it sets it): a duplicate that starts waiting
after the wake, for the key's next holder, is not woken by the earlier holder's end (it was: the
set event stayed registered until the woken waiters had run, and a new waiter returned at once
and claimed again for nothing)."""

from __future__ import annotations

import asyncio

from idem_middleware.waiting import Waiters


async def test_a_waiter_that_arrives_after_a_wake_waits_for_the_next_one() -> None:
    waiters = Waiters(4)
    first = asyncio.ensure_future(waiters.wait("k", 30))
    await asyncio.sleep(0)  # (first is waiting)
    # A duplicate for the key's next holder, whose task runs before the woken waiter's does
    # (its step is scheduled first), and calls `wait` after the wake.
    later = asyncio.ensure_future(waiters.wait("k", 30))
    waiters.wake("k")  # the holder ended
    await asyncio.wait_for(first, 5)
    done, _ = await asyncio.wait({later}, timeout=0.05)
    assert not done, "woken by a holder that ended before it waited"
    waiters.wake("k")  # the next holder ends
    await asyncio.wait_for(later, 5)
