"""Lease renewals (heartbeat.py) against a store that cannot be reached."""

from __future__ import annotations

import asyncio
import logging

import pytest

from idem_middleware.context import claimed_context
from idem_middleware.errors import StoreClosed, StoreError
from idem_middleware.heartbeat import keep_lease
from idem_middleware.policy import Mode
from idem_middleware.store.base import RecordKey


class Unreachable:
    """A store whose every renewal fails, as while its server restarts."""

    def __init__(self) -> None:
        self.tries = 0

    async def heartbeat(self, key: RecordKey, generation: int, lease_seconds: float) -> bool:
        self.tries += 1
        raise StoreError("FileNotFoundError: [Errno 2] No such file or directory")


@pytest.mark.parametrize("renew_now", [True, False], ids=["request", "job"])
async def test_renewals_failing_for_the_whole_lease_lose_it_with_one_traceback(
    renew_now: bool, caplog: pytest.LogCaptureFixture
) -> None:
    context = claimed_context("t", "POST /x", "k", 7, Mode.LEASE, None, None)
    store = Unreachable()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    with caplog.at_level(logging.WARNING, logger="idem_middleware"):
        await asyncio.wait_for(
            keep_lease(
                store, context, 0.09, stop, held_until=loop.time() + 0.09, renew_now=renew_now
            ),
            30,
        )
    assert context.lease_lost.is_set()
    assert store.tries >= 2
    failed = [r for r in caplog.records if r.getMessage().startswith("lease renewal failed")]
    assert len(failed) == store.tries - 1
    assert [bool(r.exc_info) for r in failed] == [True] + [False] * (len(failed) - 1)
    lost = [r for r in caplog.records if r.getMessage().startswith("lease lost")]
    assert len(lost) == 1
    assert "No such file" in lost[0].getMessage()
    assert "k" not in {v for v in vars(lost[0]).values() if isinstance(v, str)}  # no raw key


class Closed:
    """A store the app's lifespan closed while an execution ran on."""

    def __init__(self) -> None:
        self.tries = 0

    async def heartbeat(self, key: RecordKey, generation: int, lease_seconds: float) -> bool:
        self.tries += 1
        raise StoreClosed("the store is closed")


async def test_a_renewal_that_finds_the_store_closed_ends_the_lease_at_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Found by probing: the renewals tried a closed store again every third of the lease, a
    warning each, until the lease lapsed, and the handler went on believing it held its claim
    meanwhile. A closed store never comes back for this execution: one try, the lease lost."""
    context = claimed_context("t", "POST /x", "k", 7, Mode.LEASE, None, None)
    store = Closed()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    with caplog.at_level(logging.WARNING, logger="idem_middleware"):
        await asyncio.wait_for(
            keep_lease(store, context, 3600, stop, held_until=loop.time() + 3600, renew_now=True),
            30,
        )
    assert context.lease_lost.is_set()
    assert store.tries == 1
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1
    assert messages[0].startswith("lease lost: the store is closed")
