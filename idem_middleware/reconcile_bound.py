"""A reconciler's run, bounded even when the reconciler swallows its cancellation.

`run_reconciler` bounds the reconciler with `asyncio.timeout`: at the bound, the reconciler is
cancelled. One that catches the CancelledError and goes on awaiting (or loops) made the bound a
lie: the batch (`reconcile_unknown`, `idem-middleware reconcile`) hung for good, and so did the
client's retry that asked it (the client leaving cancelled it, and it swallowed that too). Here
the run is a task of its own: past its bound and `GRACE_SECONDS` more, it is abandoned, logged
at ERROR, and counted as `failed` (the record stays `unknown`: nothing is lost).

The abandoned run goes on in its own task and ends as any other run does: its fenced
transaction (and the row lock and pooled connection it holds) is kept until the reconciler
returns, then sealed by the run itself (never while the reconciler may still use it), so other
reconcilers find the record held meanwhile, as for a fence held elsewhere. A late `Happened` is
settled under the generation it was asked about, a compare-and-set (inside the fence, whose row
lock kept every other move out): it is the downstream system's answer, and nothing else can
have moved the record under that generation. A late `NotHappened` changes nothing.

Each abandoned run may hold a connection, so at most `MAX_ABANDONED` (and half the pool) may
pile up: past them a batch stops (`ReconcilersStuck`) and a client's retry is told the
reconciler failed, without asking it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from .context import key_digest
from .errors import IdempotencyError
from .fence import _FAILED, ReconcileResult, Verdict, run_reconciler
from .reconcile import ReconcileContext, Reconciler, Reconciliation
from .store.base import RecordKey, Store

logger = logging.getLogger("idem_middleware")

#: How long a reconciler's run is waited for past its bound (or past its caller's cancellation)
#: before it is abandoned: the reconciler was cancelled at its bound and did not end.
GRACE_SECONDS = 1.0
#: How many abandoned runs (each may hold a pooled connection and a record's row lock) may be
#: still running before a batch stops and a client's retry no longer asks its reconciler.
MAX_ABANDONED = 8

#: The abandoned runs still running (kept here so that none is garbage-collected mid-run).
_abandoned: set[asyncio.Task[ReconcileResult]] = set()


class ReconcilersStuck(IdempotencyError):
    """Too many reconcilers ignored their cancellation and still run (`MAX_ABANDONED`)."""


def abandoned() -> int:
    """How many abandoned reconciler runs are still running on this event loop."""
    loop = asyncio.get_running_loop()
    for task in list(_abandoned):
        if task.done() or task.get_loop().is_closed():
            _abandoned.discard(task)  # (a closed loop's never end: not counted for good)
    return sum(1 for task in _abandoned if task.get_loop() is loop)


async def bounded_reconciler(
    store: Store,
    key: RecordKey,
    generation: int,
    reconciler: Reconciler,
    *,
    seconds: float,
    stuck_raises: bool = False,
    **options: Any,
) -> ReconcileResult:
    """`run_reconciler(store, key, generation, reconciler, seconds=seconds, **options)`, ended
    within `seconds` and a grace (`min(GRACE_SECONDS, seconds)`) however the reconciler treats
    its cancellation (see the module's doc). With `MAX_ABANDONED` runs still abandoned, the
    reconciler is not asked: ReconcilersStuck with `stuck_raises` (a batch), else `failed`."""
    log = {
        "tenant": key.tenant,
        "operation": key.operation,
        "key_digest": key_digest(key.key),
        "generation": generation,
    }
    if (count := abandoned()) >= (most := _most(store)):
        message = (
            f"{count} reconciler runs that ignored their cancellation are still running (at "
            f"most {most}, each may hold a database connection): no reconciler is asked until "
            "they end; fix the reconciler that swallows CancelledError"
        )
        if stuck_raises:
            raise ReconcilersStuck(message)
        logger.error("reconciler not asked: %s", message, extra=log)
        return ReconcileResult(Verdict.FAILED, _FAILED)
    grace = min(GRACE_SECONDS, seconds)
    probe = _Probe(reconciler)
    task = asyncio.ensure_future(
        run_reconciler(store, key, generation, probe, seconds=seconds, **options)
    )
    try:
        ended = await _run_ended(task, probe, seconds + grace)
    except asyncio.CancelledError:
        # Our caller was cancelled (the client left, the batch was stopped): so is the run, and
        # it is waited for no longer than the grace.
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait({task}, timeout=grace)
        _left(task, reconciler, log)
        raise
    if not ended:
        _left(task, reconciler, log)
        return ReconcileResult(Verdict.FAILED, _FAILED)
    return task.result()


class _Probe:
    """The reconciler, watched: when it was called, and whether it has returned (or raised)."""

    def __init__(self, reconciler: Reconciler) -> None:
        self.reconciler = reconciler
        self.called = asyncio.Event()
        self.returned = asyncio.Event()
        self.called_at = 0.0

    async def __call__(self, context: ReconcileContext) -> Reconciliation:
        self.called_at = asyncio.get_running_loop().time()
        self.called.set()
        try:
            return await self.reconciler(context)
        finally:
            self.returned.set()


async def _run_ended(task: asyncio.Task[ReconcileResult], probe: _Probe, bound: float) -> bool:
    """Whether the run ended; False when its reconciler was still running `bound` seconds after
    it was called. Only the reconciler is bounded here: the store's moves around it (the record
    read first, its answer settled after) are bounded by the store's own timeouts, as before (a
    busy pool or a slow commit never made a reconciler that had answered an abandoned one)."""
    await _either(task, probe.called, None)
    if not task.done():
        left = probe.called_at + bound - asyncio.get_running_loop().time()
        await _either(task, probe.returned, max(left, 0.0))
    if not task.done() and probe.returned.is_set():
        await asyncio.wait({task})  # (its answer being settled)
    return task.done()


async def _either(task: asyncio.Task[Any], event: asyncio.Event, seconds: float | None) -> None:
    """Until `task` ends or `event` is set (or `seconds` pass)."""
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({task, waiter}, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()


def _left(task: asyncio.Task[ReconcileResult], reconciler: object, log: dict[str, Any]) -> None:
    """The caller no longer waits for `task`: abandoned if it still runs, its outcome (an
    exception too) retrieved either way."""
    if task.done():
        if not task.cancelled():
            task.exception()  # (retrieved: the caller goes on without it)
        return
    logger.error(
        "reconciler %s did not end within its grace after its cancellation (it swallows "
        "CancelledError?): abandoned, the record stays unknown; its fenced transaction, if "
        "any, is kept until it ends",
        _name(reconciler),
        extra=log,
    )
    _abandoned.add(task)
    task.add_done_callback(lambda done: _ended(done, log))


def _ended(task: asyncio.Task[ReconcileResult], log: dict[str, Any]) -> None:
    """An abandoned run ended (its fence sealed by the run itself): logged, and forgotten."""
    _abandoned.discard(task)
    if task.cancelled():
        logger.warning("abandoned reconciler run ended: cancelled", extra=log)
    elif (error := task.exception()) is not None:
        logger.warning("abandoned reconciler run ended: %s", type(error).__qualname__, extra=log)
    else:
        logger.warning("abandoned reconciler run ended: %s", task.result().verdict.value, extra=log)


def _most(store: Store) -> int:
    """How many abandoned runs may be still running: `MAX_ABANDONED`, and at most half of the
    store's pool (the command line's has two connections: with both held, the batch stopped on
    "no database connection", which named the wrong culprit)."""
    size = getattr(getattr(store, "_pool", None), "get_max_size", None)
    pool = size() if callable(size) else None
    if isinstance(pool, int) and not isinstance(pool, bool) and pool > 0:
        return max(1, min(MAX_ABANDONED, pool // 2))
    return MAX_ABANDONED


def _name(reconciler: object) -> str:
    """The reconciler's name for a log line (its module and qualified name, as far as known)."""
    name = getattr(reconciler, "__qualname__", None) or type(reconciler).__qualname__
    module = getattr(reconciler, "__module__", None)
    return f"{module}.{name}"[:200] if module else str(name)[:200]
