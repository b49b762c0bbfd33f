"""Fenced transitions of a record: an executor's fenced transaction, and a reconciler's run."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from .context import derive_downstream_key, key_digest
from .errors import ClaimBusy, FenceRollback, StaleGeneration, StatementRefused, StoreError
from .outcomes import FINAL_STATE, outcome_for_status
from .policy import Mode
from .reconcile import Happened, NotHappened, ReconcileContext, Reconciler, StillUnknown
from .responses import storable_headers
from .sendable import header_problem
from .store.base import FINAL_STATES, RecordKey, Settlement, State, Store, StoredResponse

logger = logging.getLogger("idem_middleware")

#: What a client's retry is told when the reconciler failed (raised, timed out, or gave no usable
#: answer): the record stays unknown.
_FAILED = "Asking the downstream system failed; retry later."
#: What a client's retry of a record an operator settles (`RecordSummary.by_hand`) is told.
_BY_HAND = "An operator settles this request's outcome; no retry runs it again."


class Fence:
    """The fenced transaction of one execution or reconciliation, opened on first use."""

    #: Whether the settlement was sent in the fenced transaction (set on the instance then): its
    #: writes commit with it or not at all, so once failed it cannot be sent again alone. (A
    #: release, or `unknown`, is sent once that transaction rolled back, as a compare-and-set of
    #: its own: that one can.)
    committing = False
    #: A reconciler's fence that found the record held by another session, or waited its
    #: `held_wait` for a connection (see `run_reconciler`).
    held = False
    #: This fence's own transaction was refused: the record changed under its generation (a
    #: StaleGeneration from elsewhere, a job the reconciler called, is not this fence's).
    refused = False
    #: The settlement began (set on the instance then): no fenced transaction opens after it.
    #: A handler's task of its own (FastAPI's event-stream generator) may ask for one while a
    #: response's start settles: opened then, it held the row the settlement waited for.
    settling = False

    def __init__(self, store: Store, key: RecordKey, generation: int, expected: State) -> None:
        self.store = store
        self.key = key
        self.generation = generation
        self.expected = expected
        # The store's fenced session, entered on first use, and its context manager: entered
        # and left by hand (an exit stack for the one context cost more than the rest of the
        # fence's bookkeeping).
        self._fenced: AbstractAsyncContextManager[Any] | None = None
        self._session: Any = None
        #: Held while the fenced transaction opens: callers at once (helpers of a handler run
        #: under `asyncio.gather`) share it. Each opened one of its own, and the second waited
        #: inside the database for the first's row lock, held until the handler ended: never.
        self._opening: asyncio.Lock | None = None

    async def connection(self) -> Any:
        if self._session is None:
            if self._opening is None:
                self._opening = asyncio.Lock()
            async with self._opening:
                if self._session is None:
                    await self._open()
        return self._session.connection

    async def _open(self) -> None:
        if self.settling:
            raise StaleGeneration("this execution's outcome is settled or being settled")
        fenced = self.store.fenced(self.key, self.generation, self.expected)
        try:
            self._session = await fenced.__aenter__()
        except ClaimBusy:
            # Another session holds the record (another reconciler's fence): a reconciler's
            # fence never waits for it inside the database (see `run_reconciler`).
            self.held = True
            raise
        except StaleGeneration:
            self.refused = True
            raise
        self._fenced = fenced  # (only once entered: `close` leaves what was entered)
        if self.settling:  # settled while it opened: its writes would never commit
            await self.close()
            raise StaleGeneration("this execution's outcome is settled or being settled")

    def lost(self, error: BaseException) -> StoreError | None:
        """A StoreError if the handler's `error` reports the fenced transaction's connection
        gone (PgBouncer's `idle_transaction_timeout`, a restart of the server or the pooler):
        its writes rolled back, and the store failed, not the handler. None otherwise."""
        lost = getattr(self._session, "lost", None)
        if not callable(lost) or not lost(error):
            return None
        return StoreError("the fenced transaction's connection was lost while the handler ran")

    @property
    def over_unknown(self) -> bool:
        """Whether a final outcome may be recorded over `unknown` under this generation: a
        duplicate found the lease lapsed and marked the record so, and nobody took it over, so
        this outcome is still the one to record. (A takeover, an operator's move (a reopen too)
        and a release for a retry each draw a new generation; a reconciler's `Happened` settles
        it first, and the outcome then finds it settled.) Not if the handler asked for its
        fenced transaction: refused (or lost), its fenced writes never happened, whatever it
        answered."""
        return self.expected is State.PENDING and self._opening is None

    async def settle(self, settlement: Settlement) -> bool:
        """Record the outcome: inside the fenced transaction if one is open, then commit."""
        self.settling = True
        if self._session is None:
            key, generation = self.key, self.generation
            if await self.store.settle(key, generation, self.expected, settlement):
                return True
            if settlement.state not in FINAL_STATES or not self.over_unknown:
                return False
            return await self.store.settle(key, generation, State.UNKNOWN, settlement)
        self.committing = True
        try:
            settled: bool = await self._session.settle(settlement)
        except BaseException:
            # Never leave the transaction open: it holds the record's row lock (every later
            # request on the key would wait on it) and a pooled connection.
            await self.close()
            raise
        await self.close(commit=settled)
        return settled

    def record(self, settlement: Settlement | None) -> Awaitable[bool]:
        """An execution's outcome (`outcome.settlement_for`): a final one in the fenced
        transaction, with the handler's writes if it opened one (`settle`'s own coroutine,
        returned: no second one wraps it); `unknown`, or a release (None), as a compare-and-set
        of its own once the fence is closed (its writes rolled back)."""
        if settlement is not None and settlement.state is not State.UNKNOWN:
            return self.settle(settlement)
        return self._unsettled(settlement)

    async def _unsettled(self, settlement: Settlement | None) -> bool:
        await self.seal()
        if settlement is None:
            return await self.store.release(self.key, self.generation)
        return await self.store.settle(self.key, self.generation, State.PENDING, settlement)

    async def seal(self) -> None:
        """The execution is over (its handler raised, or returned): the fenced transaction is
        rolled back, and none opens after it. A helper of the handler's still running (the other
        half of an `asyncio.gather` whose first half raised) asked for one as the execution
        cleaned up: opened after the rollback, nothing ever ended it, and the `unknown` mark
        waited for its row lock for good."""
        self.settling = True
        await self.close()

    async def close(self, *, commit: bool = False) -> None:
        """Commit (or roll back) the fenced transaction, if one was opened."""
        if self._session is None:
            return
        self._session = None
        fenced, self._fenced = self._fenced, None
        assert fenced is not None
        if commit:
            await fenced.__aexit__(None, None, None)
        else:
            # As if FenceRollback left the `async with`: the session rolls back (and raises it
            # again, or swallows it).
            with contextlib.suppress(FenceRollback):
                await fenced.__aexit__(FenceRollback, FenceRollback(), None)


class Verdict(StrEnum):
    #: Happened: the record now holds the reconciler's response.
    SETTLED = "settled"
    #: Did not happen: the caller may run it again (or allow the client's retry to).
    NOT_HAPPENED = "not-happened"
    STILL_UNKNOWN = "still-unknown"
    #: The reconciler raised, ran out of time, or returned no usable answer.
    FAILED = "failed"
    #: The record moved on meanwhile (someone else resolved it).
    CHANGED = "changed"
    #: A record an operator reopened (transactional, or lease-mode): writes may have committed
    #: with its outcome, so no reconciler may run on it (a "not happened" would run it again, a
    #: `Happened` repeat its writes). An operator resolves it; the record is left as it is.
    BY_HAND = "by-hand"
    #: Another session held the record (the reconciler's fenced connection found it locked, or
    #: waited `held_wait` for a connection): the reconciler's answer is not used, and the record
    #: is left for a later run.
    HELD = "held"


@dataclass(frozen=True, slots=True)
class ReconcileResult:
    verdict: Verdict
    reason: str = ""


async def run_reconciler(
    store: Store,
    key: RecordKey,
    generation: int,
    reconciler: Reconciler,
    *,
    seconds: float,
    epoch: int | None = None,
    held_wait: float | None = None,
    by_hand: bool | None = None,
    fence_first: bool = False,
    max_body_bytes: int | None = None,  # (a `Happened` body over it: an error, left unknown)
) -> ReconcileResult:
    """Run one reconciler, bounded by `seconds`, on an unknown record under `generation`.

    `epoch` is the record's (`Record.epoch`): the reconciler asks about the downstream key the
    executors of this life of the record sent.

    A `Happened` answer is settled in the reconciler's fenced transaction, together with any
    writes it made there. `NotHappened` changes nothing: the caller takes the record over.
    A record only an operator settles (`RecordSummary.by_hand`: a transactional one, or one an
    operator reopened) is never given to the reconciler (`Verdict.BY_HAND`).
    The reconciler's fenced connection never waits for a record another session holds (another
    reconciler at work, a process paused holding it) inside the database, a pooled connection
    held: it is refused at once, and the result is `Verdict.HELD`, whatever the reconciler made
    of it (the caller waits without a connection, or passes the record over). With `held_wait`,
    the fenced connection also waits no longer than that for a connection from the pool (then
    HELD as well). Without, as long as `seconds` allows.
    `by_hand`: the record's, if the caller read it under `generation` (else it is read here).
    `fence_first`: the fenced transaction is opened before the reconciler is called, and a
    record another session holds is HELD without asking it (a retry asking again after HELD:
    asked on each of its polls, the reconciler called the downstream system each time).
    """
    # Whether it is settled by hand is read first, under the same generation: a record keeps its
    # mode and its reopen mark while it stays unknown under one generation (only a claim, a
    # takeover or an operator's move changes either, and each draws a new generation), so what
    # is read here still holds when the fence locks the row.
    if by_hand is None:
        summary = await store.describe(key)
        if summary is None or (summary.generation, summary.state) != (generation, State.UNKNOWN):
            return ReconcileResult(Verdict.CHANGED)
        by_hand = summary.by_hand
    if by_hand:
        return ReconcileResult(Verdict.BY_HAND, _BY_HAND)
    fence = Fence(store, key, generation, State.UNKNOWN)
    context = ReconcileContext(
        tenant=key.tenant,
        operation=key.operation,
        key=key.key,
        downstream_key=derive_downstream_key(key.tenant, key.operation, key.key, epoch),
        generation=generation,
        _fence=fence.connection if held_wait is None else _bounded(fence, held_wait),
    )
    log = {
        "tenant": key.tenant,
        "operation": key.operation,
        "key_digest": key_digest(key.key),
        "generation": generation,
    }
    task = asyncio.current_task()
    cancelling = 0 if task is None else task.cancelling()
    try:
        async with asyncio.timeout(seconds):
            if fence_first:
                await context.fenced_connection()
            result = await reconciler(context)
    except StaleGeneration:
        own = fence.refused  # (read first: a helper may ask for the fence while it is sealed)
        await fence.seal()
        if fence.held:  # (whatever the reconciler made of the record another session held)
            return ReconcileResult(Verdict.HELD)
        if own:  # (its own fence: the record changed under this generation)
            return ReconcileResult(Verdict.CHANGED)
        # Another's (a lease-mode job the reconciler called lost its claim): the reconciler's
        # failure. Read as "changed", a client's retry read the record again and asked again,
        # thousands of times, and a batch counted it changed, run after run.
        logger.warning("reconciler failed", extra=log, exc_info=True)
        return ReconcileResult(Verdict.FAILED, _FAILED)
    except StoreError:
        # The store failed (no connection for the fence: the server is down), not the
        # reconciler: raised, as every other store failure is (a batch stops and says so, a
        # client's retry gets a 503), never counted as the reconciler's failure.
        await fence.seal()
        raise
    except (Exception, asyncio.CancelledError) as exc:
        await fence.seal()
        if isinstance(exc, asyncio.CancelledError) and (
            task is None or task.cancelling() > cancelling
        ):
            raise  # our task was cancelled (our own timeout's is a TimeoutError by now)
        # (A CancelledError nobody asked of our task is the reconciler's own: it awaited a
        # task someone else cancelled. Raised, it ended the whole batch, or the client's
        # request, as if they had been cancelled.)
        if fence.held:
            return ReconcileResult(Verdict.HELD)
        logger.warning("reconciler failed", extra=log, exc_info=True)
        return ReconcileResult(Verdict.FAILED, _FAILED)
    except BaseException:
        await fence.seal()
        raise
    if fence.held:
        # Whatever the reconciler made of the TimeoutError, it answered without the record.
        await fence.seal()
        return ReconcileResult(Verdict.HELD)
    if isinstance(result, StillUnknown):
        await fence.seal()
        return ReconcileResult(
            Verdict.STILL_UNKNOWN, result.reason or "The downstream system cannot tell yet."
        )
    if isinstance(result, NotHappened):
        await fence.seal()
        return ReconcileResult(Verdict.NOT_HAPPENED)
    state = _settles_to(result, max_body_bytes)
    if not isinstance(state, State):  # (State is a StrEnum: test for it, not for str)
        # A reconciler's bug, handled as if it had raised: its writes roll back, the record
        # stays unknown, and the batch (or the client's retry) goes on.
        await fence.seal()
        level = logging.ERROR if "max_response_bytes" in state else logging.WARNING
        logger.log(level, "reconciler gave no usable answer: %s", state, extra=log)
        return ReconcileResult(Verdict.FAILED, _FAILED)
    assert isinstance(result, Happened)  # (_settles_to checked it)
    # Kept as a handler's headers are: a reconciler that hands over the downstream's own
    # (Content-Length, Transfer-Encoding, Date ...) would otherwise break every replay.
    # (`int`: an `HTTPStatus` member is recorded as the number it is, as a handler's is.)
    stored = StoredResponse(int(result.status), storable_headers(result.headers), result.body)
    line = f"reconciled unknown -> {state.value} {stored.status}"  # (as an operator's move)
    try:
        settled = await fence.settle(Settlement(state, stored, note=line))
    except StatementRefused as exc:
        # The database refused to commit the answer with the reconciler's fenced writes (it
        # went on after one of its statements failed, or broke a deferred constraint): the
        # reconciler's failure, as if it had raised. The record stays unknown and the batch
        # goes on (raised, it stopped every run at this record, the oldest, for good); a
        # client's retry is told 409. A blip (a connection lost) is still raised.
        # (The server's error is logged without its DETAIL, which the store dropped: no row.)
        cause = exc.__cause__ or exc
        logger.warning(
            "reconciler's answer could not be recorded: the database refused to commit its "
            "fenced transaction (%s: %s); the record stays unknown",
            type(cause).__name__,
            cause,
            extra=log,
        )
        return ReconcileResult(Verdict.FAILED, _FAILED)
    if not settled:
        return ReconcileResult(Verdict.CHANGED)
    logger.info("reconciled as happened", extra={**log, "outcome": state.value})
    return ReconcileResult(Verdict.SETTLED)


def _bounded(fence: Fence, held_wait: float) -> Callable[[], Awaitable[Any]]:
    """`fence.connection`, waiting at most `held_wait` (for a connection from the pool; the
    record's row lock is never waited for): past it, the TimeoutError is raised into the
    reconciler and the fence is marked held."""

    async def connection() -> Any:
        try:
            async with asyncio.timeout(held_wait):
                return await fence.connection()
        except TimeoutError:
            fence.held = True
            raise

    return connection


def _settles_to(result: object, cap: int | None) -> State | str:
    """The state a `Happened` answer settles the record to, or why the answer cannot be used.

    The reason is logged: it names the type or the status a reconciler returned, never a body.
    """
    if not isinstance(result, Happened):
        returned = "None" if result is None else type(result).__qualname__
        return f"it returned {returned}, not Happened, NotHappened or StillUnknown"
    status = result.status
    if isinstance(status, bool) or not isinstance(status, int) or not 100 <= status <= 599:
        return f"Happened({status!r:.40}): not an HTTP status"
    state = FINAL_STATE.get(outcome_for_status(status, Mode.LEASE)) if status >= 200 else None
    if state is None:
        return f"Happened({status}): not a final outcome (a 2xx, a 3xx or a final 4xx)"
    if not isinstance(result.body, bytes):
        return f"Happened({status}): its body is a {type(result.body).__qualname__}, not bytes"
    if cap is not None and (size := len(result.body)) > cap:
        return f"Happened({status}): a body of {size} bytes, over max_response_bytes ({cap})"
    headers = result.headers
    if not isinstance(headers, Sequence) or not all(
        isinstance(pair, tuple | list)
        and len(pair) == 2
        and isinstance(pair[0], bytes)
        and isinstance(pair[1], bytes)
        for pair in headers
    ):
        return f"Happened({status}): its headers are not (bytes, bytes) pairs"
    # Stored, a header a server refuses to send (sendable.py's rule) would be left out of every
    # replay: refused now, the record stays unknown. Named, never quoted (see above). Only what
    # is stored: a hop-by-hop header (Proxy-Connection, say) is dropped first, as a handler's.
    for pair in storable_headers(headers):
        if header_problem(pair) is not None:
            return f"Happened({status}): the header {pair[0][:64]!r} is not valid in HTTP"
    return state
