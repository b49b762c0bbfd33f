"""Lease renewals (heartbeat.py), pinned against hand-made mutants (mutation17):

- a successful renewal moves the lease's end (`held_until = sent + lease_seconds`): an outage
  that starts after some renewals succeeded loses the lease only when the lease the *last*
  successful renewal granted ends, not when the first one did (a false "lease lost" abandons an
  execution that still holds its record);
- renewals come a third of the lease apart, the first a third of the lease after it was granted
  (not at once, not more often: each is a statement on a pooled connection).
"""

from __future__ import annotations

import asyncio

from idem_middleware.context import claimed_context
from idem_middleware.errors import StoreError
from idem_middleware.heartbeat import keep_lease
from idem_middleware.policy import Mode
from idem_middleware.store.base import RecordKey


class GrantsThenFails:
    """The first `grants` renewals are granted at once; every later one fails."""

    def __init__(self, grants: int) -> None:
        self.grants = grants
        self.at: list[float] = []

    async def heartbeat(self, key: RecordKey, generation: int, lease_seconds: float) -> bool:
        self.at.append(asyncio.get_running_loop().time())
        if len(self.at) <= self.grants:
            return True
        raise StoreError("ConnectionRefusedError: the server is down")


async def test_an_outage_after_renewals_loses_the_lease_when_the_last_renewed_one_ends() -> None:
    lease = 1.5  # renewals every 0.5 s
    context = claimed_context("t", "POST /x", "k", 7, Mode.LEASE, None, None)
    store = GrantsThenFails(grants=2)
    loop = asyncio.get_running_loop()
    granted = loop.time()
    await asyncio.wait_for(
        keep_lease(
            store, context, lease, asyncio.Event(), held_until=granted + lease, renew_now=False
        ),
        30,
    )
    lost_at = loop.time() - granted
    assert context.lease_lost.is_set()
    # Renewed at ~0.5 and ~1.0: the lease ends at ~2.5, not at 1.5 (the lease first granted).
    last_grant = store.at[1] - granted
    assert lost_at >= last_grant + lease - 0.05, (lost_at, store.at)
    assert lost_at < last_grant + lease + 0.5, (lost_at, store.at)


async def test_renewals_come_a_third_of_the_lease_apart_the_first_a_third_after_the_grant() -> None:
    lease = 1.5  # renewals every 0.5 s
    context = claimed_context("t", "POST /x", "k", 7, Mode.LEASE, None, None)
    store = GrantsThenFails(grants=1000)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    granted = loop.time()
    task = asyncio.create_task(
        keep_lease(store, context, lease, stop, held_until=granted + lease, renew_now=False)
    )
    await asyncio.sleep(1.25)
    stop.set()
    await asyncio.wait_for(task, 5)
    offsets = [round(at - granted, 2) for at in store.at]
    assert not context.lease_lost.is_set()
    assert len(offsets) == 2, offsets  # at ~0.5 and ~1.0
    assert 0.45 <= offsets[0] < 0.7, offsets
    assert 0.45 <= offsets[1] - offsets[0] < 0.7, offsets
