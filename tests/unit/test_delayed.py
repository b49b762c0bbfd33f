"""One shared timer calls back the items still registered after the delay (delayed.py)."""

from __future__ import annotations

import asyncio
import contextvars
import gc
import threading
import time
import weakref

import pytest

from idem_middleware.delayed import Delayed

#: A request's own context variable, as an outer middleware sets one (a request id, a span).
REQUEST: contextvars.ContextVar[object] = contextvars.ContextVar("request")


class Item:
    def __init__(self, name: str, fired: list[str]) -> None:
        self.name = name
        self.fired = fired

    def due(self) -> None:
        self.fired.append(self.name)


async def test_items_still_registered_fall_due_in_order_and_discarded_ones_never() -> None:
    fired: list[str] = []
    # The delay is far longer than the pause before `c` is added: with 0.02 s against 0.01 s,
    # a loaded machine woke the test from its pause after `a` had fallen due (`['a'] == []`,
    # 4 runs in 20 with the CPUs busy).
    delayed = Delayed(0.5)
    a, b, c = Item("a", fired), Item("b", fired), Item("c", fired)
    delayed.add(a)
    delayed.add(b)
    delayed.discard(b)  # done sooner, as most requests are
    await asyncio.sleep(0.01)
    delayed.add(c)  # added later: falls due later, by the same timer chain
    assert fired == []
    for _ in range(500):  # (bounded: 5 s)
        if len(fired) == 2:
            break
        await asyncio.sleep(0.01)
    assert fired == ["a", "c"]
    await asyncio.sleep(0.05)
    assert fired == ["a", "c"], "an item fell due twice, or a discarded one fell due"


def test_another_event_loop_starts_afresh() -> None:
    """An app served by one loop, then another (test clients do this): the second loop's items
    fall due on the second loop, whatever the first left behind."""
    fired: list[str] = []
    delayed = Delayed(0.01)

    async def first() -> None:
        delayed.add(Item("left behind", fired))  # its loop ends before the delay passes

    async def second() -> None:
        delayed.add(Item("second", fired))
        for _ in range(100):
            if fired:
                return
            await asyncio.sleep(0.01)

    asyncio.run(first())
    asyncio.run(second())
    assert fired == ["second"]


def test_event_loops_of_two_threads_each_get_their_items_due() -> None:
    """Two threads, each running its own event loop (each app with its own store), share the
    module-wide timers (lease mode's heartbeats, the client watches). The second thread's first
    item took the timer over and dropped the first thread's items: their heartbeats never
    started, and the leases of handlers still running lapsed."""
    delayed = Delayed(0.05)
    added = threading.Event()
    fired: dict[str, list[str]] = {"one": [], "two": []}

    async def serve(name: str) -> None:
        delayed.add(Item(name, fired[name]))
        added.set()
        for _ in range(500):  # bounded: 5 s
            if fired[name]:
                return
            await asyncio.sleep(0.01)

    def thread(name: str, after: threading.Event | None) -> None:
        if after is not None:
            after.wait(5)
        asyncio.run(serve(name))

    threads = [
        threading.Thread(target=thread, args=("one", None)),
        threading.Thread(target=thread, args=("two", added)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert fired == {"one": ["one"], "two": ["two"]}


class Request:
    """What a request keeps in a context variable (weakly referable, to see whether it lives)."""


class Seen:
    def __init__(self) -> None:
        self.seen: list[object] = []

    def due(self) -> None:
        self.seen.append(REQUEST.get(None))


async def _request(delayed: Delayed, item: Seen, request: Request) -> None:
    REQUEST.set(request)
    delayed.add(item)  # the first item since the timer was idle: this arms it


async def test_the_timer_keeps_nothing_of_the_request_that_armed_it() -> None:
    """The timer was armed with `call_later`, which copies the context it is called from: the
    first request's context, and every timer the chain re-armed after it. That request's
    context variables (its IdempotencyContext and connection, an outer middleware's request id
    or span) stayed alive for as long as other requests kept the timer busy."""
    delayed = Delayed(3600.0)  # (never falls due during the test)
    item = Seen()
    request = Request()
    done = weakref.ref(request)
    await asyncio.create_task(_request(delayed, item, request))
    del request
    for _ in range(3):  # (the finished task's last callbacks let go of it)
        await asyncio.sleep(0)
    gc.collect()
    try:
        assert done() is None, "the shared timer keeps the context of the request that armed it"
    finally:
        delayed.discard(item)


async def test_items_fall_due_outside_the_context_of_the_request_that_armed_the_timer() -> None:
    """Each item's `due` ran in the first request's context: a lease heartbeat or a client
    watch started for one request ran as another (its logs, its spans)."""
    delayed = Delayed(0.01)
    first, second = Seen(), Seen()
    await asyncio.create_task(_request(delayed, first, Request()))
    await asyncio.create_task(_request(delayed, second, Request()))
    for _ in range(500):  # bounded: 5 s
        if first.seen and second.seen:
            break
        await asyncio.sleep(0.01)
    assert first.seen == [None]
    assert second.seen == [None]


async def test_items_fall_due_by_the_loops_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """A test suite's clock tool may stop `time.monotonic` while the event loop's clock runs
    (or fake the loop's clock alone): the items were timed by `time.monotonic` and the timer by
    the loop, so the timer re-armed itself for ever and nothing fell due (lease mode's
    heartbeats never started, a wait for the pool was never cut off)."""
    loop = asyncio.get_running_loop()
    monkeypatch.setattr(loop, "time", time.monotonic)  # the loop's clock keeps running
    monkeypatch.setattr(time, "monotonic", lambda: 1000.0)  # another clock, frozen
    fired: list[str] = []
    delayed = Delayed(0.01)
    delayed.add(Item("a", fired))
    for _ in range(200):  # bounded: 2 s
        if fired:
            break
        await asyncio.sleep(0.01)
    assert fired == ["a"]
