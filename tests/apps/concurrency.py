"""Waiting for, holding and cancelling requests in flight, bounded by `BOUND`."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from idem_middleware import IdempotencyMiddleware
from idem_middleware.store.base import Store
from tests.apps.transactional import Probe

BOUND = 5.0


_LOCK_WAITS = (
    "SELECT coalesce(array_agg((pid, query_start)::text), '{}') FROM pg_stat_activity "
    "WHERE datname = current_database() AND wait_event_type = 'Lock'"
)


async def lock_waiters(pool: Any, looks: int = 3, apart: float = 0.05) -> int:
    """How many backends of this database wait for a lock, the same statement at each of
    `looks` looks `apart` seconds apart (a statement waiting for a row another transaction
    holds, its pooled connection held meanwhile, is seen at every look). A wait seen at one
    look only is not counted: a relation's extension while inserts grow a table, a NOTIFY's
    turn at commit, a backend of an earlier test on its way out last a moment, and a single
    snapshot counting them fails a "nobody waits" check on a loaded machine (see `blocked_by`,
    which is better still where the holding session is at hand)."""
    waiting = set(await pool.fetchval(_LOCK_WAITS))
    for _ in range(looks - 1):
        if not waiting:
            break
        await asyncio.sleep(apart)
        waiting &= set(await pool.fetchval(_LOCK_WAITS))
    return len(waiting)


async def blocked_by(pool: Any, holder: Any) -> int:
    """How many backends wait for a lock the session on connection `holder` holds (a statement
    waiting for the record's row, its pooled connection held meanwhile). Counted by who blocks
    them, not as every lock wait in the database: a wait nobody holds a row for (a relation's
    extension while concurrent inserts grow a table, a NOTIFY's turn at commit) is momentary,
    and counting it made a storm's "nobody waits" check fail one CI run in dozens."""
    waiting: int = await pool.fetchval(
        "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))",
        holder.get_server_pid(),
    )
    return waiting


async def wait_for_lock_waiters(pool: Any, n: int = 1) -> None:
    """Until `n` backends of this database are blocked on a lock (a duplicate on a claim)."""

    async def poll() -> None:
        while True:
            waiting = await pool.fetchval(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
            if waiting >= n:
                return
            await asyncio.sleep(0.01)

    await asyncio.wait_for(poll(), BOUND)


def idempotency_middleware(app: Any) -> IdempotencyMiddleware:
    """The IdempotencyMiddleware in a Starlette app's stack (built by its first request)."""
    layer = app.middleware_stack
    for _ in range(20):
        if isinstance(layer, IdempotencyMiddleware):
            return layer
        layer = getattr(layer, "app", None)
    raise LookupError("no IdempotencyMiddleware in this app's stack")


async def wait_for_waiters(app: Any, n: int = 1, bound: float = BOUND) -> None:
    """Until `n` duplicates wait in the app's middleware for a key another request holds (they
    wait in the process, holding no connection: see idem_middleware/transactional.py); at most
    `bound` seconds."""

    for _ in range(int(bound / 0.01)):
        # (A request not started yet has not built the app's stack: looked for again.)
        if app.middleware_stack is not None and idempotency_middleware(app).waiters.count >= n:
            return
        await asyncio.sleep(0.01)
    raise TimeoutError(f"fewer than {n} duplicates waited")


async def wait_entered(probe: Probe) -> None:
    await asyncio.wait_for(probe.entered.wait(), BOUND)


class CountingStore:
    """Wraps a store and counts what the middleware asks of it (to prove a pass-through)."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.calls = 0

    def transaction(self, *, acquire_timeout: float) -> Any:
        self.calls += 1
        return self.inner.transaction(acquire_timeout=acquire_timeout)

    async def get(self, key: Any) -> Any:
        self.calls += 1
        return await self.inner.get(key)


async def cancel_while_held(c: httpx.AsyncClient, probe: Probe, url: str, **kwargs: Any) -> None:
    """Start a request, hold its handler inside the claim, and cancel the request from outside.

    Returns once the cancelled task has finished, having checked it ended in CancelledError and
    nothing else; the probe is left ready for a retry (no gate).
    """
    async with Held(probe) as held:
        task = held.start(c.post(url, **kwargs))
        await wait_entered(probe)
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=BOUND)
        assert task in done, "the cancelled request did not finish"
        assert task.cancelled(), f"expected only CancelledError, got {task.exception()!r}"
    probe.entered.clear()


class Held:
    """Requests run in the background while `probe.gate` holds the handler.

    `async with Held(probe) as held:` closes the gate; `held.start(coro)` runs a request as a
    task; `await held.release()` opens the gate. On exit the gate is opened whatever happened and
    every task is finished (cancelled after BOUND), so a failing test never leaves a claim open
    and a pool that cannot close.
    """

    def __init__(self, probe: Probe) -> None:
        self.probe = probe
        self.tasks: list[asyncio.Task[Any]] = []

    async def __aenter__(self) -> Held:
        self.probe.gate = asyncio.Event()
        return self

    def start(self, request: Any) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(request)
        self.tasks.append(task)
        return task

    def release(self) -> None:
        assert self.probe.gate is not None
        self.probe.gate.set()

    async def __aexit__(self, *exc: object) -> None:
        if self.probe.gate is not None:
            self.probe.gate.set()
        pending = {t for t in self.tasks if not t.done()}
        if pending:
            _, stuck = await asyncio.wait(pending, timeout=BOUND)
            for task in stuck:
                task.cancel()
            if stuck:
                await asyncio.wait(stuck, timeout=BOUND)
        for task in self.tasks:
            if task.done() and not task.cancelled():
                task.exception()  # retrieved: a failure is the test's to report, not asyncio's
        self.probe.gate = None


async def until(predicate: Any) -> None:
    """Wait (at most BOUND) until `predicate()` holds."""
    for _ in range(int(BOUND / 0.005)):
        if predicate():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition never became true")


class NeverReads:
    """A client that sends its request (`body`) and never reads the response: its `send` blocks
    on the first body message (as a full socket buffer would), and it never disconnects."""

    def __init__(self, body: bytes = b"{}") -> None:
        self.started = asyncio.Event()
        self._body: bytes | None = body

    async def receive(self) -> dict[str, Any]:
        body, self._body = self._body, None
        if body is not None:
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            self.started.set()
            await asyncio.Event().wait()


class Leaves:
    """A client that sends its request (`body`), then disconnects when `leave()` is called; what
    it was sent is kept in `sent`."""

    def __init__(self, body: bytes = b"{}") -> None:
        self._body: bytes | None = body
        self._left = asyncio.Event()
        self.sent: list[dict[str, Any]] = []

    def leave(self) -> None:
        self._left.set()

    async def receive(self) -> dict[str, Any]:
        body, self._body = self._body, None
        if body is not None:
            return {"type": "http.request", "body": body, "more_body": False}
        await self._left.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)
