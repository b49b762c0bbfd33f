"""Lease renewals (heartbeat.py): a lease granted by a slow renewal is counted from when that
renewal was sent, not from when its answer came (the database extends the lease from its own
`now()`, which is at or before the answer). Pins `held_until = sent + lease_seconds`."""

from __future__ import annotations

import asyncio

from idem_middleware.context import claimed_context
from idem_middleware.errors import StoreError
from idem_middleware.heartbeat import keep_lease
from idem_middleware.policy import Mode
from idem_middleware.store.base import RecordKey


class SlowThenUnreachable:
    """The first renewal is granted after a slow round trip; every later one fails."""

    def __init__(self, slow: float) -> None:
        self.slow = slow
        self.tries = 0

    async def heartbeat(self, key: RecordKey, generation: int, lease_seconds: float) -> bool:
        self.tries += 1
        if self.tries == 1:
            await asyncio.sleep(self.slow)
            return True
        raise StoreError("ConnectionRefusedError: the server is down")


async def test_a_lease_renewed_by_a_slow_renewal_ends_a_lease_after_it_was_sent() -> None:
    """Counted from the answer, an execution whose renewals then fail believed it held the
    record for as long as that round trip took past the lease's end, when another process may
    take it over."""
    lease = 1.5
    context = claimed_context("t", "POST /x", "k", 7, Mode.LEASE, None, None)
    store = SlowThenUnreachable(slow=1.0)
    loop = asyncio.get_running_loop()
    sent = loop.time()
    await asyncio.wait_for(
        keep_lease(store, context, lease, asyncio.Event(), held_until=sent + lease, renew_now=True),
        30,
    )
    lost_at = loop.time() - sent
    assert context.lease_lost.is_set()
    assert store.tries >= 2
    # The lease the first renewal granted ends 1.5 s after it was sent (counted from its
    # answer, 2.5 s).
    assert lost_at < lease + 0.5, lost_at
