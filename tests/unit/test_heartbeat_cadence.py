"""Pinned: lease renewals run every third of the lease (heartbeat.keep_lease), so a renewal
that fails is tried again twice more before the lease ends: three failed renewals in a row,
then one that reaches the store, keep the lease (renewing every half lease, the third failure
came at the lease's end, and the lease was lost)."""

from __future__ import annotations

import asyncio

from idem_middleware.context import claimed_context
from idem_middleware.errors import StoreError
from idem_middleware.heartbeat import keep_lease
from idem_middleware.policy import Mode
from idem_middleware.store.base import RecordKey


class Blip:
    """A store whose first `failures` renewals fail; the next succeeds and stops the renewals."""

    def __init__(self, failures: int, stop: asyncio.Event) -> None:
        self.failures = failures
        self.stop = stop
        self.tries = 0

    async def heartbeat(self, key: RecordKey, generation: int, lease_seconds: float) -> bool:
        self.tries += 1
        if self.tries <= self.failures:
            raise StoreError("ConnectionResetError: the server restarted")
        self.stop.set()
        return True


async def test_three_failed_renewals_within_the_lease_do_not_lose_it() -> None:
    context = claimed_context("t", "POST /x", "k", 7, Mode.LEASE, None, None)
    stop = asyncio.Event()
    store = Blip(3, stop)
    loop = asyncio.get_running_loop()
    lease = 0.9
    await asyncio.wait_for(
        keep_lease(store, context, lease, stop, held_until=loop.time() + lease, renew_now=True),
        30,
    )
    assert store.tries == 4
    assert not context.lease_lost.is_set()
