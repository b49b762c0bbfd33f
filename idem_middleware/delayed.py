"""One timer for many requests: call back the requests still running a fixed delay after they
started. A timer per request (`loop.call_later`, then `cancel` when the request is done sooner,
as most are) costs a heap entry and a handle each time; this costs a dictionary entry."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable
from typing import Protocol


class Due(Protocol):
    def due(self) -> None:
        """The delay has passed and the item is still registered."""


class _Serving:
    """The items and the timer of one event loop."""

    __slots__ = ("delay", "items", "loop", "timer")

    def __init__(self, loop: asyncio.AbstractEventLoop, delay: float) -> None:
        self.loop = loop
        self.delay = delay
        self.items: dict[Due, float] = {}  # insertion order is due order
        self.timer: asyncio.TimerHandle | None = None

    def fire(self) -> None:
        self.timer = None
        items = self.items
        now = self.loop.time()
        due = []
        for item, at in items.items():
            if at > now:
                break
            due.append(item)
        for item in due:
            del items[item]
        if items:
            at = next(iter(items.values()))
            self.timer = _arm(self.loop, max(at - now, 0.0), self.fire)
        for item in due:
            item.due()


def _arm(
    loop: asyncio.AbstractEventLoop, delay: float, fire: Callable[[], None]
) -> asyncio.TimerHandle:
    """A timer that runs in a context of its own, empty. `call_later` would copy the context of
    whichever request armed it, and every timer after it re-arms from there: that request's
    context variables (its IdempotencyContext, its connection, an outer middleware's request id
    or trace span) stayed alive as long as the chain ran, and each item's `due` ran under them,
    so a heartbeat or a client watch started for one request ran as another's."""
    return loop.call_later(delay, fire, context=contextvars.Context())


class Delayed:
    """Calls `item.due()` for each item still registered `delay` seconds after `add(item)`.

    The delay is the same for every item, so items fall due in the order they were added: one
    timer, set for the oldest, serves them all. Touched only from an event loop. Each loop has
    its own items and timer: an app served by another loop later (a test client's, say) starts
    afresh, and the loops of several threads (each app with its own store) share a module's
    Delayed without taking it from each other (the second loop's first item used to drop the
    first loop's items: lease mode's heartbeats never started).
    """

    __slots__ = ("_delay", "_main", "_others")

    def __init__(self, delay: float) -> None:
        self._delay = delay
        #: The loop served first (or after it closed, the next one); any other loop's, by loop.
        self._main: _Serving | None = None
        self._others: dict[asyncio.AbstractEventLoop, _Serving] | None = None

    @property
    def delay(self) -> float:
        return self._delay

    def add(self, item: Due) -> float:
        """Register `item`; returns when it falls due, on the loop's clock (the timer may call
        it later than that: a loop running late)."""
        loop = asyncio.get_running_loop()
        serving = self._main
        if serving is None or serving.loop is not loop:
            serving = self._serving(loop)
        # The loop's own clock, the one its timer keeps: another (time.monotonic) may run at
        # another pace in a test (frozen, or the loop's clock faked), and the timer then re-armed
        # itself for ever without an item falling due, or spun.
        at = serving.items[item] = loop.time() + self._delay
        if serving.timer is None:
            serving.timer = _arm(loop, self._delay, serving.fire)
        return at

    def discard(self, item: Due) -> None:
        # (An item is only in the items of the loop that added it: popping it from another's
        # changes nothing there.)
        main = self._main
        if main is not None:
            main.items.pop(item, None)
        if self._others:
            for serving in tuple(self._others.values()):
                serving.items.pop(item, None)

    def _serving(self, loop: asyncio.AbstractEventLoop) -> _Serving:
        main = self._main
        if main is None or main.loop.is_closed():
            # Items and timer of a closed loop are gone with it.
            serving = self._main = _Serving(loop, self._delay)
            return serving
        others = self._others or {}
        found = others.get(loop)
        if found is not None:
            return found
        others = {other: s for other, s in others.items() if not other.is_closed()}
        serving = others[loop] = _Serving(loop, self._delay)
        self._others = others  # (a new dict: another thread may be reading the old one)
        return serving
