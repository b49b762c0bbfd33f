"""The LISTEN connection: change notifications for the records waiters watch, and the waits
registered in `idem_waiters` (a settlement notifies only a record someone waits on)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import asyncpg

from ...errors import RetryableConflict, StoreError
from ..base import EventWatch, RecordKey
from .convert import _Q, CONNECTION_ERRORS
from .rows import NOTIFY_CHANNEL, notify_token

logger = logging.getLogger("idem_middleware.store")

# How long one attempt to connect may take (waiters poll meanwhile), and the pause after a
# failed one.
CONNECT_SECONDS = 5.0
RETRY_SECONDS = 5.0
_ERRORS: tuple[type[BaseException], ...] = (*CONNECTION_ERRORS, asyncpg.PostgresError, StoreError)
_CONNECT_ERRORS: tuple[type[BaseException], ...] = (*_ERRORS, TimeoutError)
_REGISTER_ERRORS: tuple[type[BaseException], ...] = (*_CONNECT_ERRORS, RetryableConflict)
_T = TypeVar("_T")
_NEVER_IDLE_OUT = (
    "SELECT set_config(name, '0', false) FROM pg_catalog.pg_settings"
    " WHERE name = 'idle_session_timeout'"
)


class Listener:
    """One LISTEN connection per store, fanning notifications out to the waiters in-process.

    Notifications are hints: a waiter always re-reads the record, and polls when none come (a
    lost notification, or PgBouncer in transaction mode, where LISTEN cannot work).

    The connection is made by one background attempt at a time, bounded by
    `CONNECT_SECONDS`. No waiter ever waits for it: a waiter that finds no connection
    starts the attempt (if none is running) and polls; once the connection is up, it is woken by
    notifications like every later waiter (its event is registered either way).
    """

    def __init__(
        self,
        *,
        enabled: bool,
        connect: Callable[[], Awaitable[Any]],
        execute: Callable[..., Awaitable[Any]],
    ) -> None:
        # `connect` makes a connection of the listener's own, never one of the pool's: held for
        # the store's life, it would be a pooled connection less for every request (a pool of
        # one, none at all). `execute(query, *args)` runs a statement on a pooled connection
        # (the waits' registrations).
        self._enabled = enabled
        self._open_connection = connect
        self._execute = execute
        self._conn: Any = None
        self._connecting: asyncio.Task[None] | None = None
        self._waiters: dict[str, set[asyncio.Event]] = {}
        self._retry_at = 0.0
        #: Registrations (`idem_waiters`) being made or removed (see `_spawn`).
        self._pending: set[asyncio.Task[Any]] = set()
        #: Between `close` and `resume` (the store's next open): no connection is made. A wait
        #: that began after the store's close (a duplicate whose claim read the record just
        #: before) made one that nothing closed: a connection of the pool (a pool of the app's
        #: own) never given back, or one of its own left open.
        self._stopped = False
        #: Once a connection was up and was lost, it is made again by itself (not only when a
        #: wait begins): after a failed attempt, again every RETRY_SECONDS (`_retry`).
        self._keep_up = False
        self._retrying: asyncio.TimerHandle | None = None

    def resume(self) -> None:
        self._stopped = False

    def connected(self) -> bool:
        return self._conn is not None and not self._conn.is_closed()

    def ensure(self) -> bool:
        """Whether a LISTEN connection is up now; if not, start connecting (in the background)."""
        if not self._enabled or self._stopped:
            return False
        if self.connected():
            return True
        loop = asyncio.get_running_loop()
        if self._connecting is None and loop.time() >= self._retry_at:
            self._connecting = loop.create_task(self._connect())
        return False

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        conn: Any = None
        try:
            async with asyncio.timeout(CONNECT_SECONDS):
                conn = await self._open_connection()
                # Idle by design: a role's or database's idle_session_timeout would end it again
                # and again (each time made again by `_lost`). (The setting: PostgreSQL 14 on.)
                await conn.execute(_NEVER_IDLE_OUT)
                await conn.add_listener(NOTIFY_CHANNEL, self._notified)
            conn.add_termination_listener(self._lost)
            if conn.is_closed():  # (ended as its LISTEN was answered: its end was heard by no one)
                raise ConnectionResetError("the LISTEN connection ended as it was made")
            self._conn, conn = conn, None
        except Exception as exc:  # (the pool's `connect=`, `init` or `setup` may raise anything)
            logger.warning("LISTEN unavailable, polling instead: %r", exc)
            self._retry_at = loop.time() + RETRY_SECONDS
            if self._keep_up and not self._stopped and self._retrying is None:
                self._retrying = loop.call_later(RETRY_SECONDS, self._retry)
        finally:
            self._connecting = None
            if conn is not None:  # it never became the listener (a timeout, or closing)
                conn.terminate()

    def _retry(self) -> None:
        self._retrying = None
        self._retry_at = 0.0  # (a timer may fire a little early: its time has come)
        self.ensure()

    def _notified(self, conn: object, pid: int, channel: str, payload: object) -> None:
        for event in self._waiters.get(str(payload), ()):
            event.set()

    def _lost(self, conn: Any) -> None:
        self._conn = None
        # Made again at once, and while the server is away every RETRY_SECONDS: the waits of
        # this process may all be in-process ones for a while (`Waiters.held`), which never
        # start an attempt, and a wait of another process's key would find none.
        self._keep_up = True
        self._retry()
        # Wake everyone: they re-read the record, then poll until a new listener is up.
        for events in self._waiters.values():
            for event in events:
                event.set()

    @asynccontextmanager
    async def watch(self, key: RecordKey) -> AsyncIterator[EventWatch]:
        """Woken by the record's notifications while the block runs. Before its first wait the
        wait is registered in `idem_waiters` too (after the event, so no notification slips
        between): settlements notify only records someone waits on. A registration that fails,
        or that a settlement running at that moment does not see yet, costs a wake-up: the
        waiter polls, as it does whenever no notification comes."""
        token = notify_token(key)
        event = asyncio.Event()
        self.ensure()
        self._waiters.setdefault(token, set()).add(event)
        watch = _Registered(self, token, event)
        cancelled = False
        try:
            yield watch
        except asyncio.CancelledError:
            cancelled = True
            raise
        finally:
            waiters = self._waiters.get(token)
            if waiters is not None:
                waiters.discard(event)
                if not waiters:
                    del self._waiters[token]
            ending = watch.end()
            if ending is not None and not cancelled:
                await asyncio.shield(ending)  # (cancelled meanwhile: it ends in the background)

    def _spawn(self, coro: Coroutine[Any, Any, _T]) -> asyncio.Task[_T]:
        """A registration's statements, in a task of their own: a cancelled waiter (its client
        left, its server shuts down) never cuts one short, so no row outlives its wait. Kept
        until done (the loop holds tasks only weakly); `close` waits for them."""
        task = asyncio.get_running_loop().create_task(coro)
        self._pending.add(task)
        task.add_done_callback(self._finished)
        return task

    def _finished(self, task: asyncio.Task[Any]) -> None:
        self._pending.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.debug("a wait's registration failed: %r", task.exception())

    async def _end(self, token: str, registering: asyncio.Task[int | None]) -> None:
        await asyncio.wait((registering,))  # (its error, if any, was its waiter's to see)
        if registering.cancelled() or registering.exception() is not None:
            return
        waiter = registering.result()
        if waiter is not None:
            await self._unregister(token, waiter)

    async def _register(self, token: str) -> int | None:
        waiter = random.getrandbits(63)
        try:
            await self._execute(_Q["watch_begin"], token, waiter)
        except _REGISTER_ERRORS as exc:
            logger.debug("could not register a wait, polling: %r", exc)
            return None
        return waiter

    async def _unregister(self, token: str, waiter: int) -> None:
        try:
            await self._execute(_Q["watch_end"], token, waiter)
        except _REGISTER_ERRORS as exc:  # (`purge` removes it within the hour)
            logger.debug("could not remove a wait's registration: %r", exc)

    async def close(self, seconds: float = CONNECT_SECONDS) -> None:
        """Stop listening: each wait (for the registrations still ending, for the server's
        goodbye) takes at most `seconds` (and `CONNECT_SECONDS`)."""
        seconds = min(seconds, CONNECT_SECONDS)
        self._stopped = True
        if self._retrying is not None:
            self._retrying.cancel()
            self._retrying = None
        if self._pending:  # registrations still ending (their waiters were cancelled)
            await asyncio.wait(tuple(self._pending), timeout=seconds)
            for task in tuple(self._pending):  # (a server that does not answer: `purge`'s)
                task.cancel()
        connecting, self._connecting = self._connecting, None
        if connecting is not None:
            connecting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await connecting
        conn, self._conn = self._conn, None
        if conn is None or conn.is_closed():
            return
        conn.remove_termination_listener(self._lost)
        try:
            # (Bounded: a server that does not answer never acknowledges the goodbye.)
            async with asyncio.timeout(seconds):
                await conn.close()
        except TimeoutError:
            logger.warning("the LISTEN connection did not close in time; terminated it")
            conn.terminate()


class _Registered(EventWatch):
    """A watch whose wait is registered in `idem_waiters` before it first waits: a duplicate
    answered from the record it read (a replay, a takeover) never waits, and registers nothing
    (the registration and its removal were two statements on every lease-mode replay)."""

    __slots__ = ("_listener", "_registering", "_token")

    def __init__(self, listener: Listener, token: str, event: asyncio.Event) -> None:
        super().__init__(event, listener.connected)
        self._listener = listener
        self._token = token
        self._registering: asyncio.Task[int | None] | None = None

    async def wait(self, seconds: float) -> bool:
        listener = self._listener
        if self._registering is None and listener._enabled:
            loop = asyncio.get_running_loop()
            started = loop.time()
            self._registering = listener._spawn(listener._register(self._token))
            await asyncio.shield(self._registering)
            seconds -= loop.time() - started
        listener.ensure()  # (at each poll: a wait that began while the server was away)
        return await super().wait(seconds)

    def end(self) -> asyncio.Task[None] | None:
        """Remove the registration (once it is made), in a task of its own; None: none made."""
        registering, self._registering = self._registering, None
        if registering is None:
            return None
        return self._listener._spawn(self._listener._end(self._token, registering))
