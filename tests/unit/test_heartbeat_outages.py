"""Pinned: how lease renewals behave across failures (heartbeat.keep_lease).

- A failed renewal is tried again when the lease ends if that is sooner than the next third of
  the lease: the execution learns it lost its lease when it ended, not a third of a lease later
  (meanwhile another execution may have taken the record over).
- One warning with a traceback per outage: a renewal that reaches the store ends the outage, and
  the next outage's first warning carries its traceback again.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from idem_middleware.context import claimed_context
from idem_middleware.errors import StoreError
from idem_middleware.heartbeat import keep_lease
from idem_middleware.policy import Mode
from idem_middleware.store.base import RecordKey


class Scripted:
    """Renewals that fail (False) or reach the store (True) in the order given; past the
    script, the renewals are stopped."""

    def __init__(self, script: list[bool], stop: asyncio.Event) -> None:
        self.script = list(script)
        self.stop = stop
        self.tries: list[float] = []

    async def heartbeat(self, key: RecordKey, generation: int, lease_seconds: float) -> bool:
        self.tries.append(asyncio.get_running_loop().time())
        if not self.script:
            self.stop.set()
            return True
        if not self.script.pop(0):
            raise StoreError("ConnectionResetError: the server restarted")
        return True


async def test_a_failed_renewal_is_tried_again_when_the_lease_ends_not_after() -> None:
    """Lease 3 s, renewed every second; the lease last granted ends 1.1 s from now. Every
    renewal fails: the third try is at the lease's end (1.1 s), and the lease is lost then, not
    at the next third (2 s)."""
    context = claimed_context("t", "POST /x", "k", 7, Mode.LEASE, None, None)
    stop = asyncio.Event()
    store = Scripted([False] * 10, stop)
    loop = asyncio.get_running_loop()
    held_until = loop.time() + 1.1
    await asyncio.wait_for(
        keep_lease(store, context, 3.0, stop, held_until=held_until, renew_now=True), 30
    )
    lost_at = loop.time()
    assert context.lease_lost.is_set()
    assert len(store.tries) == 3
    assert store.tries[-1] >= held_until
    assert lost_at - held_until < 0.6, f"lost {lost_at - held_until:.2f}s after the lease ended"


async def test_each_outage_logs_its_first_failure_with_a_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    context = claimed_context("t", "POST /x", "k", 7, Mode.LEASE, None, None)
    stop = asyncio.Event()
    # fail, reach the store (the outage ends), fail (a second outage), reach it, stop
    store = Scripted([False, True, False, True], stop)
    loop = asyncio.get_running_loop()
    with caplog.at_level(logging.WARNING, logger="idem_middleware"):
        await asyncio.wait_for(
            keep_lease(store, context, 0.3, stop, held_until=loop.time() + 0.3, renew_now=True),
            30,
        )
    assert not context.lease_lost.is_set()
    failed = [r for r in caplog.records if r.getMessage().startswith("lease renewal failed")]
    assert [bool(r.exc_info) for r in failed] == [True, True]
