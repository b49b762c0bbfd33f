"""waiting.py: the bounded waiters of a process and the per-tenant connection slots."""

from __future__ import annotations

import asyncio

import pytest

from idem_middleware.errors import ConfigurationError
from idem_middleware.waiting import TenantSlots, Waiters


def test_waiters_are_bounded() -> None:
    waiters = Waiters(2)
    assert waiters.enter()
    assert waiters.enter()
    assert not waiters.enter(), "a third waiter past the limit"
    assert waiters.count == 2
    waiters.leave()
    assert waiters.enter()
    assert not Waiters(0).enter()


@pytest.mark.parametrize("limit", [-1, 1.5, True, "3", None])
def test_waiters_refuse_a_limit_that_is_not_a_whole_number(limit: object) -> None:
    with pytest.raises(ConfigurationError):
        Waiters(limit)  # type: ignore[arg-type]


async def test_a_waiter_is_woken_by_its_keys_holder_only() -> None:
    waiters = Waiters(4)
    woken = asyncio.ensure_future(waiters.wait("k1", 30))
    other = asyncio.ensure_future(waiters.wait("k2", 30))
    await asyncio.sleep(0)
    waiters.wake("k1")
    await asyncio.wait_for(woken, 5)
    assert not other.done()
    waiters.wake("k2")
    await asyncio.wait_for(other, 5)
    waiters.wake("nobody")  # no waiter: nothing to do


async def test_a_waiter_returns_when_its_time_runs_out() -> None:
    await asyncio.wait_for(Waiters(1).wait("k1", 0.01), 5)


async def test_a_key_nobody_waits_on_any_more_is_forgotten() -> None:
    """Found by probing: the event per key was removed only by a wake from a holder in this
    process; a holder in another process (or one that ended first) left it for good, about a
    kilobyte per key."""
    waiters = Waiters(8)
    # Nobody here wakes them: they run out of time.
    await asyncio.gather(
        waiters.wait("k1", 0.01), waiters.wait("k1", 0.03), waiters.wait("k2", 0.02)
    )
    assert waiters._events == {}
    # Woken, and one waiting again before the others have left.
    first = asyncio.ensure_future(waiters.wait("k3", 30))
    second = asyncio.ensure_future(waiters.wait("k3", 30))
    await asyncio.sleep(0)
    waiters.wake("k3")
    again = asyncio.ensure_future(waiters.wait("k3", 0.01))
    await asyncio.wait_for(asyncio.gather(first, second, again), 5)
    assert waiters._events == {}
    # Cancelled waiters leave too.
    cancelled = asyncio.ensure_future(waiters.wait("k4", 30))
    await asyncio.sleep(0)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert waiters._events == {}


def test_tenant_slots_cap_each_tenant_apart() -> None:
    slots = TenantSlots(2)
    assert slots.take("a")
    assert slots.take("a")
    assert not slots.take("a")
    assert slots.take("b"), "one tenant's cap does not touch another's"
    slots.give_back("a")
    assert slots.take("a")
    for _ in range(2):
        slots.give_back("a")
    slots.give_back("b")
    assert slots._held == {}, "a tenant with nothing held is forgotten"


def test_no_tenant_cap() -> None:
    slots = TenantSlots(None)
    assert all(slots.take("a") for _ in range(1000))
    slots.give_back("a")


@pytest.mark.parametrize("limit", [0, -1, 1.5, True])
def test_tenant_slots_refuse_a_bad_limit(limit: object) -> None:
    with pytest.raises(ConfigurationError):
        TenantSlots(limit)  # type: ignore[arg-type]


def test_a_holder_ending_lets_go_of_its_own_hold_only() -> None:
    """A stream's attempt wakes its waiters as its stream starts and again as it ends; a request
    that claimed the key between the two (the stream's outcome was a release) keeps its hold."""
    waiters = Waiters(10)
    first, second = object(), object()
    waiters.held["k"] = first
    waiters.wake("k", first)
    assert waiters.held == {}
    waiters.held["k"] = second
    waiters.wake("k", first)  # the first attempt's end, late
    assert waiters.held == {"k": second}
    waiters.wake("k")  # (no holder named: nobody's hold is let go of)
    assert waiters.held == {"k": second}
    waiters.wake("k", second)
    assert waiters.held == {}
