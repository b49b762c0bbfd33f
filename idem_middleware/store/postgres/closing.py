"""Closing the store: the lease-mode executions a shutdown cancelled settle first, and the pool's
close is bounded (a server that does not answer would hold it for ever)."""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from ...errors import StoreError, blip
from ..base import Claim, Claimed, RecordKey
from .convert import _Q
from .rows import notify_token

logger = logging.getLogger("idem_middleware.store")

#: How long `close` may take in all: waiting for cancelled lease-mode executions to settle, the
#: LISTEN connection's goodbye, the pool's (its connections given back, each closed with the
#: server's goodbye). Each step past the first gets what is left, and at least `LAST_SECONDS`.
CLOSE_SECONDS = 10.0
LAST_SECONDS = 0.5


class Budget:
    """What is left of `CLOSE_SECONDS` (read when `close` starts, so a test may shorten it)."""

    __slots__ = ("_until",)

    def __init__(self) -> None:
        self._until = asyncio.get_running_loop().time() + CLOSE_SECONDS

    def left(self) -> float:
        return max(self._until - asyncio.get_running_loop().time(), LAST_SECONDS)


_T = TypeVar("_T")
#: How long the undoing of a claim that landed for a request gone is sent again on a blip, and
#: the pauses between tries (doubling): within the store's close (`CLOSE_SECONDS`).
_UNDO_SECONDS = 8.0
_FIRST_PAUSE = 0.05
_MAX_PAUSE = 1.0
_UNDO_TRIES = 32

#: How many turns of the loop a close looks on after finding nothing to wait for (a
#: cancellation a few tasks away from the execution it cancels), and how often it looks at most.
_QUIET_TURNS = 4
_LOOKS = 64

#: Gives a claim back: `(key, generation)` (the store's `release`, `Executions._unclaim`).
Undo = Callable[[RecordKey, int], Awaitable[bool]]


def _generation_claimed(claimed: Claim) -> int | None:
    return claimed.generation if isinstance(claimed, Claimed) else None


def _generation_taken(new: int | None) -> int | None:
    return new


class Executions:
    """The tasks that claimed a lease-mode record through the store (a request's, a job's).

    A server's shutdown cancels the requests still running, then closes the app (the store)
    at once, without waiting for them: an execution still unwinding then found the store closed
    and could not mark its record `unknown`, which stayed `pending` (its retries answered 409)
    until its lease lapsed. `close` waits for those (only the cancelled ones: a task that runs
    on, a queue consumer's, is the app's to stop)."""

    __slots__ = ("_release", "_run", "_tasks", "_unrun")

    def __init__(self, release: Undo, run: Callable[..., Awaitable[Any]]) -> None:
        self._release = release  # the store's `release`
        self._run = run  # the store's `_run`
        self._tasks: weakref.WeakSet[asyncio.Task[Any]] = weakref.WeakSet()
        #: Claims (and takeovers) in flight, and the undoing of those that landed for requests
        #: cancelled meanwhile.
        self._unrun: set[asyncio.Future[Any]] = set()

    async def claim(
        self, claiming: Coroutine[Any, Any, Claim], key: RecordKey, seconds: float
    ) -> Claim:
        """A lease-mode claim (a statement that commits on its own), run to its end whatever
        becomes of the request that asked for it, which counts as an execution once it claimed.
        A request cancelled with the statement in flight (a shutdown, a timeout around the app)
        unwinds at once; its claim may commit all the same, and the record stayed `pending`
        under a live lease (retries 409), then `unknown` for good, for a handler that never ran.
        A claim that lands for a request gone is released: its retry runs it. One the server
        has not answered in `seconds` (it stopped answering: the request was held as long) is a
        StoreError, and released if it lands after."""
        claimed = await self._to_the_end(claiming, key, _generation_claimed, self._release, seconds)
        if isinstance(claimed, Claimed):
            self.add()  # its settlement comes before the store's close
        return claimed

    async def take_over(
        self, taking: Coroutine[Any, Any, int | None], key: RecordKey, seconds: float
    ) -> int | None:
        """A takeover (the new generation, or None), as `claim`. One that lands for a request
        gone leaves the record to the next retry as one released for it (`unclaim`), its epoch
        (the downstream key) and fingerprint kept: it was taken over because the request could
        run again (a lapsed lease under TAKEOVER, a retry allowed, a reconciler's "not
        happened"), and left under the taker's live lease, nobody ran it, then `unknown`."""
        new = await self._to_the_end(taking, key, _generation_taken, self._unclaim, seconds)
        if new is not None:
            self.add()
        return new

    async def _unclaim(self, key: RecordKey, generation: int) -> bool:
        args = (key.tenant, key.operation, key.key, generation, notify_token(key))
        return bool(await self._run("fetchval", _Q["unclaim"], *args))

    async def _to_the_end(
        self,
        coro: Coroutine[Any, Any, _T],
        key: RecordKey,
        generation_of: Callable[[_T], int | None],
        undo: Undo,
        seconds: float,
    ) -> _T:
        task = asyncio.ensure_future(coro)
        # (In flight until done: a close waits for it, however many tasks away, and turns of
        # the loop, the cancellation of the request that asked for it is.)
        self._unrun.add(task)
        task.add_done_callback(self._unrun.discard)
        landed = lambda done: self._landed(done, key, generation_of, undo)  # noqa: E731
        try:
            async with asyncio.timeout(seconds):
                return await asyncio.shield(task)
        except TimeoutError:
            if task.done():  # (it ended in the turn the bound ran out: its own answer)
                return task.result()
            task.add_done_callback(landed)  # (one that lands after is given back)
            raise StoreError(f"the database did not answer in {seconds:g} s") from None
        except asyncio.CancelledError:
            task.add_done_callback(landed)
            raise

    def _landed(
        self,
        task: asyncio.Future[Any],
        key: RecordKey,
        generation_of: Callable[[Any], int | None],
        undo: Undo,
    ) -> None:
        if task.cancelled() or task.exception() is not None:
            return  # (nothing claimed; an error retrieved, never "never retrieved")
        generation = generation_of(task.result())
        if generation is not None:
            undoing = asyncio.ensure_future(_undo(undo, key, generation))
            self._unrun.add(undoing)
            undoing.add_done_callback(self._undone)

    def _undone(self, undoing: asyncio.Future[bool]) -> None:
        self._unrun.discard(undoing)
        if not undoing.cancelled() and undoing.exception() is not None:
            logger.warning(
                "a cancelled lease-mode request's claim could not be given back; its record "
                "stays pending until its lease lapses",
                exc_info=undoing.exception(),
            )

    def add(self) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)

    async def unwound(self, seconds: float) -> None:
        """Wait (at most `seconds`) for the claims in flight and the cancelled executions to
        finish: looked for again after every wait, and a few turns of the loop on (a
        cancellation reaches an execution under `wait_for` or a task group a turn or two
        late), until none is left."""
        current = asyncio.current_task()
        loop = asyncio.get_running_loop()
        until = loop.time() + seconds
        pending: list[asyncio.Future[Any]] = []
        quiet = 0
        for _ in range(_LOOKS):
            await asyncio.sleep(0)
            pending = [*self._unrun, *self._unwinding(current, loop)]
            if not pending:
                quiet += 1
                if quiet == _QUIET_TURNS:
                    return
                continue
            quiet = 0
            _, left = await asyncio.wait(pending, timeout=max(until - loop.time(), 0))
            if left and loop.time() >= until:
                break
        if undone := [p for p in pending if not p.done()]:
            logger.warning(
                "closing the store: %d cancelled lease-mode executions or claims did not "
                "finish within %.0f s; their records stay pending until their leases lapse",
                len(undone),
                seconds,
            )

    def _unwinding(
        self, current: asyncio.Task[Any] | None, loop: asyncio.AbstractEventLoop
    ) -> list[asyncio.Task[Any]]:
        return [
            t
            for t in self._tasks
            if t is not current and t.get_loop() is loop and not t.done() and t.cancelling()
        ]


async def close_pool(pool: Any, seconds: float) -> None:
    """`pool.close()` (it waits for its connections to come back, then says goodbye on each),
    bounded: past `seconds` (a server that does not answer, a connection never given back)
    the pool's connections are terminated."""
    try:
        async with asyncio.timeout(seconds):
            await pool.close()
    except TimeoutError:
        # (asyncpg has terminated the pool on the cancellation already; this is for the others.)
        pool.terminate()
        logger.warning("the pool did not close within %.0f s; its connections were cut", seconds)


async def _undo(undo: Undo, key: RecordKey, generation: int) -> bool:
    """`undo`, sent again while the store cannot be reached, for up to `_UNDO_SECONDS` (a
    compare-and-set of the generation: one that finds it done changes nothing). Sent once, a
    blip left the record `pending` under the lease, for a handler that never ran: every retry
    409, then `unknown` for good on a route without a reconciler."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + _UNDO_SECONDS
    pause = _FIRST_PAUSE
    for _ in range(_UNDO_TRIES - 1):  # (the deadline ends it sooner)
        try:
            return await undo(key, generation)
        except StoreError as exc:
            if not blip(exc) or loop.time() + pause >= deadline:
                raise
        await asyncio.sleep(pause)
        pause = min(pause * 2, _MAX_PAUSE)
    return await undo(key, generation)
