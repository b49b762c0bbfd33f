"""Lease renewals (heartbeat.py) against a store that cannot be reached."""

from __future__ import annotations

import asyncio
import logging
import time

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


class Renews:
    """A store whose renewals succeed, each one's time on the loop's clock kept."""

    def __init__(self) -> None:
        self.at: list[float] = []

    async def heartbeat(self, key: RecordKey, generation: int, lease_seconds: float) -> bool:
        self.at.append(asyncio.get_running_loop().time())
        return True


async def test_a_jobs_first_renewal_is_due_a_third_of_a_lease_after_the_grant_not_its_start() -> (
    None
):
    """Found by probing: a lease-mode job's heartbeat (a task of its own) waited a third of the
    lease from when it first ran, which is after the job's first await. A job that blocked the
    loop for most of its lease before that renewed only after the lease had lapsed, and a
    redelivery took the record over and ran the job again."""
    lease = 1.8  # (margins of 0.3 s each way under a loaded machine's scheduling)
    context = claimed_context("t", "POST /x", "k", 7, Mode.LEASE, None, None)
    store = Renews()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    granted = loop.time()
    task = loop.create_task(
        keep_lease(store, context, lease, stop, held_until=granted + lease, renew_now=False)
    )
    time.sleep(lease * 0.5)  # noqa: ASYNC251 - the job blocks the loop before its first await
    blocked_until = loop.time()
    for _ in range(1000):  # (bounded: until the first renewal, or the lease's end)
        if store.at or loop.time() > granted + lease:
            break
        await asyncio.sleep(0.005)
    stop.set()
    await asyncio.wait_for(task, 5)
    assert store.at, "no renewal within the lease"
    # Due at granted + lease/3, passed while the loop was blocked: at once after the block.
    assert store.at[0] < blocked_until + lease / 6
