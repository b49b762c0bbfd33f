"""What a process lets requests hold while they wait or run: bounded waiters, per-tenant slots.

Both are per middleware instance (so per process) and touched only from the event loop: a check
and its increment have no `await` between them.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Hashable
from typing import Protocol

from .errors import ConfigurationError

#: The least a duplicate waits for a record an executor's fenced transaction holds.
_MIN_LOCK_WAIT = 0.05
#: How many looks a wait may take besides its polls: each is a change of the record or of who
#: holds the key (or a wake-up), and a wait that sees this many is caught in a livelock.
MAX_ROUNDS = 10_000


async def wait_at_most(event: asyncio.Event, seconds: float) -> None:
    """Until `event` is set, or `seconds` pass. (Not `asyncio.wait_for`: on Python 3.11 it
    returns normally when the event is set as the task is cancelled, and the cancellation is
    lost: a request the server cancelled went on to claim, a task awaited at its end ran on.)"""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await event.wait()


def wait_rounds(wait_seconds: float, longest_poll: float) -> int:
    """How many looks a wait of `wait_seconds`, polling at most every `longest_poll`, may take:
    its polls and `MAX_ROUNDS` more. Found by probing: a fixed 10,000 ended a wait longer than
    10,000 polls (a job's, told to wait for hours for the run that holds its key) with a
    RuntimeError ("the record kept changing"), long before its `wait_seconds`."""
    return MAX_ROUNDS + math.ceil(wait_seconds / longest_poll)


def lock_wait(remaining: float) -> float:
    """How long a duplicate (a request's or a job's) may wait for the record's row lock: what is
    left of its wait, and at least `_MIN_LOCK_WAIT`."""
    return max(remaining, _MIN_LOCK_WAIT)


class Waiters:
    """Duplicates waiting for a key that another request of this process, or of another, holds.

    A waiter holds no database connection: it sleeps until the holder in this process ends
    (`wake`), or until its poll interval runs out, then claims again. At most `limit` wait at
    once; past that a duplicate is answered at once (409 + Retry-After).
    """

    __slots__ = ("_events", "count", "held", "limit")

    def __init__(self, limit: int) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ConfigurationError("max_waiters must be a whole number, 0 or more")
        self.limit = limit
        self.count = 0
        #: Per key someone here waits on: its event and how many wait on it. The last waiter
        #: to leave removes it, woken or not (a holder in another process never wakes it).
        self._events: dict[Hashable, _Waiting] = {}
        #: Keys a transactional attempt of this process has claimed, by that attempt, while its
        #: transaction is open, and keys a lease execution runs, by that execution, until it
        #: ends or settles early: a duplicate of one waits at once, asking the pool for nothing
        #: (nor for a tenant slot).
        self.held: dict[Hashable, object] = {}

    def enter(self) -> bool:
        """Take a waiting place; False when all `limit` are taken."""
        if self.count >= self.limit:
            return False
        self.count += 1
        return True

    def leave(self) -> None:
        self.count -= 1

    def give_back(self, _: str) -> None:
        """`leave`, as a `Held` place gives it back."""
        self.count -= 1

    def place(self) -> Held | None:
        """A waiting place (`enter`), held until given back (once); None when all are taken."""
        return Held(self, "") if self.enter() else None

    async def wait(self, key: Hashable, seconds: float) -> None:
        """Sleep until the holder of `key` in this process ends, or `seconds` pass."""
        events = self._events
        waiting = events.get(key)
        if waiting is None:
            waiting = events[key] = _Waiting()
        waiting.count += 1
        try:
            await wait_at_most(waiting.event, seconds)
        finally:
            waiting.count -= 1
            if not waiting.count and events.get(key) is waiting:
                del events[key]

    def wake(self, key: Hashable, holder: object = None) -> None:
        """`holder` of `key` ended (committed or rolled back): its waiters here claim again."""
        held = self.held
        if holder is not None and held.get(key) is holder:  # (a later holder's is its own)
            del held[key]
        if self._events:
            waiting = self._events.pop(key, None)
            if waiting is not None:
                waiting.event.set()


class _Waiting:
    __slots__ = ("count", "event")

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.count = 0


class TenantSlots:
    """How many guarded requests of one tenant may hold a store connection at once.

    `limit` None: no cap. A request takes a slot before it acquires a connection for its claim
    and gives it back when it no longer holds one, so one tenant cannot take the whole pool.
    """

    __slots__ = ("_held", "limit")

    def __init__(self, limit: int | None) -> None:
        whole = isinstance(limit, int) and not isinstance(limit, bool)
        if limit is not None and (not whole or limit < 1):
            raise ConfigurationError("max_tenant_connections must be None or a whole number >= 1")
        self.limit = limit
        self._held: dict[str, int] = {}

    def hold(self, tenant: str) -> Held | None:
        """A slot of `tenant`'s, held until given back (once); None when all are taken."""
        return Held(self, tenant) if self.take(tenant) else None

    def take(self, tenant: str) -> bool:
        if self.limit is None:
            return True
        held = self._held.get(tenant, 0)
        if held >= self.limit:
            return False
        self._held[tenant] = held + 1
        return True

    def give_back(self, tenant: str) -> None:
        if self.limit is None:
            return
        held = self._held[tenant] - 1
        if held:
            self._held[tenant] = held
        else:
            del self._held[tenant]


class _Lender(Protocol):
    def give_back(self, name: str) -> None: ...


class Held:
    """One tenant slot, or one waiting place, a request holds, given back once however often
    `give_back` runs: a slot early, when the request stops holding a connection before it ends
    (a response that streams after its outcome is committed), or at its end; a place when the
    request stops waiting, or at its end."""

    __slots__ = ("_lender", "_name")

    def __init__(self, lender: _Lender | None, name: str) -> None:
        self._lender = lender  # None: given back (or a slot of no cap's)
        self._name = name

    @property
    def held(self) -> bool:
        return self._lender is not None

    def give_back(self) -> None:
        lender, self._lender = self._lender, None
        if lender is not None:
            lender.give_back(self._name)


#: The slot of a request when no cap is set: it holds nothing.
FREE_SLOT = Held(None, "")
