"""One timer for many requests: call back the requests still running a fixed delay after they
started. A timer per request (`loop.call_later`, then `cancel` when the request is done sooner,
as most are) costs a heap entry and a handle each time; this costs a dictionary entry."""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Due(Protocol):
    def due(self) -> None:
        """The delay has passed and the item is still registered."""


class Delayed:
    """Calls `item.due()` for each item still registered `delay` seconds after `add(item)`.

    The delay is the same for every item, so items fall due in the order they were added: one
    timer, set for the oldest, serves them all. Touched only from the event loop; an app served
    by another event loop later (a test client's, say) starts afresh on that loop.
    """

    __slots__ = ("_delay", "_items", "_loop", "_timer")

    def __init__(self, delay: float) -> None:
        self._delay = delay
        self._items: dict[Due, float] = {}  # insertion order is due order
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def delay(self) -> float:
        return self._delay

    def add(self, item: Due) -> None:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            # Items and timer of another loop are that loop's business (and it is usually gone).
            self._loop, self._items, self._timer = loop, {}, None
        self._items[item] = time.monotonic() + self._delay
        if self._timer is None:
            self._timer = loop.call_later(self._delay, self._fire)

    def discard(self, item: Due) -> None:
        self._items.pop(item, None)

    def _fire(self) -> None:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            return  # a timer of a loop this no longer serves
        self._timer = None
        items = self._items
        now = time.monotonic()
        due = []
        for item, at in items.items():
            if at > now:
                break
            due.append(item)
        for item in due:
            del items[item]
        if items:
            at = next(iter(items.values()))
            self._timer = loop.call_later(max(at - now, 0.0), self._fire)
        for item in due:
            item.due()
