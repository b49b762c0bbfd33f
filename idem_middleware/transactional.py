"""Transactional mode: the claim, the handler's writes and the outcome in one transaction.

Nothing is held while this request talks to its client or waits for another request:
- a claim never waits inside the database: a key another transaction is claiming is reported
  at once (`ClaimBusy`), the transaction is rolled back and its connection given back, and the
  duplicate waits (woken by the holder in this process, or polling) before it claims again;
- every answer (a replay, a problem, the handler's own response) is sent after the transaction
  ended and its connection went back to the pool;
- a response that cannot be held (streamed, or over the cap) is settled and committed before its
  first byte, and the connection is given back before the stream starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

from .answers import TENANT_BUSY, Answer, InFlight, Problem
from .capture import ResponseCapture
from .context import CURRENT, SCOPE_KEY, IdempotencyContext, claimed_context
from .delayed import Delayed
from .errors import (
    ClaimBusy,
    ClaimTimeout,
    ClientGone,
    ProblemKind,
    RetryableConflict,
    SettlementRefused,
    StoreError,
)
from .observe import SETTLED_EVENTS, Event
from .outcomes import FINAL_STATE, Outcome, duplicate_answer, outcome_for_status
from .policy import Mode
from .store.base import Claimed, Existing, RecordKey, TokenRefused

if TYPE_CHECKING:
    from .exchange import Exchange

logger = logging.getLogger("idem_middleware")

#: How long a transactional handler runs before the middleware watches for its client leaving.
#: Watching only saves work (a departed client's outcome is committed or rolled back whole
#: either way), and it costs a task per watched request. A handler's time includes its waits for
#: a busy event loop: at 50 ms, 40-76% of the requests of a loaded server were watched, and the
#: watches cost it 13% of its throughput (docs/performance-history.md). So only really long
#: handlers are.
DISCONNECT_WATCH_AFTER = 1.0
#: Starts the client watch of handlers still running after DISCONNECT_WATCH_AFTER.
_WATCH = Delayed(DISCONNECT_WATCH_AFTER)


#: `outcome_for_status` of the statuses, looked up (a call fewer per request).
_OUTCOMES = {status: outcome_for_status(status, Mode.TRANSACTIONAL) for status in range(100, 600)}

#: What the first attempt (`Attempt(...).run()`, awaited by the exchange itself) may raise for
#: `run_transactional` to carry on from.
RETRIED = (ClaimBusy, ClaimTimeout, RetryableConflict)


class Attempt(ResponseCapture):
    """One run of claim, handler and outcome inside one database transaction. The attempt is
    the `send` its handler gets (a `ResponseCapture` settling early by itself): the response is
    held on it, and it is what the exchange flushes.

    The handler runs in the request's task. A client that disconnects while it runs cancels it
    (its writes roll back with the claim). The client is watched only once the handler has run
    `DISCONNECT_WATCH_AFTER` seconds (`due`, called by one timer shared by all requests): a
    watch is a task of its own, and most handlers are done sooner. A client that leaves a
    quicker handler finds its outcome committed, and replayed to its retry.
    """

    __slots__ = (
        "claimed",
        "context",
        "ex",
        "fingerprint",
        "gone",
        "record_key",
        "running",
        "task",
        "tx",
        "uncancelled",
        "unsettled",
        "waited",
        "watcher",
    )

    def __init__(
        self,
        ex: Exchange,
        record_key: RecordKey,
        fingerprint: bytes,
        waited: contextlib.ExitStack | None,
    ) -> None:
        self.ex = ex
        #: The timer of the wait for a busy key this attempt follows (`run_transactional`), which
        #: stops once the key is claimed; None for a first attempt, the one whose claim is timed.
        self.waited = waited
        self.record_key = record_key
        self.fingerprint = fingerprint
        self.tx: Any = None
        self.context: IdempotencyContext | None = None
        self.claimed = False
        # The capture's fields, set here (`ResponseCapture.__init__`'s, without its call: a
        # frame fewer per attempt; a test checks that every one of them is set).
        self._send = ex.send
        self._cap = ex.policy.max_response_bytes
        self._owner = None
        self.start = self.chunks = self.last = None
        self.body = b""
        self.size = 0
        self.complete = self.passthrough = False
        # The handler's run and its client's watch (see the class's docstring).
        self.task: asyncio.Task[Any] | None = None
        self.watcher: asyncio.Task[None] | None = None
        self.running = False
        self.gone = False
        self.uncancelled = False

    async def run(self) -> Answer | None:
        ex = self.ex
        policy = ex.policy
        record_key = self.record_key
        mw = ex.mw
        held = mw.waiters.held
        if held and record_key in held:  # (a duplicate of a request running in this process)
            raise ClaimBusy("a request of this process holds this key")
        slots = mw.tenant_slots
        slot = None
        if slots.limit is not None:
            # (Given back at the end, or when a stream starts: see `settle_early`.)
            slot = ex.slot = slots.hold(record_key.tenant)
            if slot is None:
                if self.waited is not None:  # a duplicate waiting already: for a slot too, as long
                    raise ClaimBusy("no tenant slot")  # (its wait lasts: then a 409, as lease's)
                return Problem(ProblemKind.TENANT_BUSY, TENANT_BUSY, policy.retry_after_seconds)
        try:
            async with mw.store.transaction(acquire_timeout=mw.acquire_timeout) as tx:
                self.tx = tx
                claiming = tx.claim(
                    record_key,
                    self.fingerprint,
                    retention_seconds=policy.retention_seconds,
                    wait_seconds=policy.wait_seconds,
                    token_hash=ex.token_hash,
                )
                # With nothing observing, no timer and no event calls at all (each is a call).
                observed = mw.observer is not None
                if observed and self.waited is None:
                    with ex.timed("claim"):
                        claim = await claiming
                else:
                    claim = await claiming
                if type(claim) is not Claimed:  # (the common answer: no isinstance call)
                    if isinstance(claim, Existing):
                        answer = duplicate_answer(claim.record, self.fingerprint)
                        if type(answer) is InFlight:
                            # A lease-mode execution's live claim (its route is in lease mode in
                            # another process, in a deploy): waited for as a busy key is, with no
                            # connection held, then claimed again (replayed, or `unknown`).
                            raise ClaimBusy("a lease-mode execution holds this key")
                        return answer
                    if isinstance(claim, TokenRefused):
                        return Problem(ProblemKind.TOKEN_INVALID, claim.reason)
                if self.waited is not None:
                    self.waited.close()  # the wait is over: the handler's run is no wait
                self.claimed = True
                held[record_key] = self  # (until `wake`: the transaction is over)
                self.context = claimed_context(
                    record_key.tenant,
                    record_key.operation,
                    record_key.key,
                    claim.generation,
                    Mode.TRANSACTIONAL,
                    tx.connection,
                    # One life of the record (its epoch): a key claimed again after its
                    # retention is a new request downstream too.
                    claim.epoch,
                )
                # Neither the claim's answer nor its spent coroutine is kept alive while the
                # handler runs: each would be one more object for the collector to pass over.
                del claim, claiming
                if observed:
                    ex.emit(Event.CLAIMED, self.context.generation)
                # (enter_context and leave_context, inline: two calls fewer per request)
                scope = ex.scope
                scope[SCOPE_KEY] = self.context
                self.context._scope = scope
                token = CURRENT.set(self.context)
                try:
                    # The handler runs in this task, not in a coroutine of its own: every await
                    # of a handler passes through each frame between it and the task.
                    # (The task is the attempt's, never a local here: a cancelled task keeps its
                    # CancelledError, whose traceback holds this frame: a cycle per request.)
                    self.task = asyncio.current_task()
                    # The app's receive() after its body waits for the watch's verdict.
                    ex.watched = self.running = True
                    _WATCH.add(self)
                    try:
                        await mw.app(scope, ex, self)  # ex: receive; self: send
                    except asyncio.CancelledError:
                        if not self._cancelled_by_watch():
                            raise
                    finally:
                        self.running = ex.watched = False
                        ex.disconnected = None
                        _WATCH.discard(self)
                        if self.watcher is not None:
                            self.watcher.cancel()
                        if not self.gone:
                            self.task = None
                    if self.gone:
                        self._client_gone()
                except BaseException as exc:
                    # Clean up, then re-raise: abandoning the transaction releases the key.
                    await tx.abandon()
                    if not self.passthrough:  # (a stream's outcome committed before its start)
                        # (A settlement the store could not make, as a held response's: `error`.)
                        # (`unsettled`: set by `settle_early` alone, unset on every other path)
                        failed = getattr(self, "unsettled", False)
                        event = Event.ERROR if failed else Event.RELEASED
                        ex.emit(event, self.context.generation)
                    if tx.conflict(exc):
                        # The database refused the handler's writes: the attempt may run again.
                        raise RetryableConflict(str(exc), from_handler=True) from exc
                    if isinstance(exc, Exception) and (gone := tx.lost()) is not None:
                        raise gone from exc  # (idle_in_transaction_session_timeout, say): a 503
                    raise
                finally:
                    scope.pop(SCOPE_KEY, None)
                    CURRENT.reset(token)
                    self.context._ended = True  # (see context.current_context)
                if self.passthrough:
                    return None  # settled before its first byte, and already sent
                if self.start is None or not self.complete:
                    await tx.abandon()
                    raise RuntimeError("the application returned without a complete response")
                try:
                    await self._settle()
                except (SettlementRefused, RetryableConflict):
                    # Rolled back, the key free (a CallerNamedLate, or a serialization failure
                    # at the COMMIT: the attempt runs again, its claim counted anew).
                    ex.emit(Event.RELEASED, self.context.generation)
                    raise
            # The transaction is over and the connection is back in the pool: now the client.
            return self  # the response held: the exchange flushes it
        finally:
            if slot is not None:
                slot.give_back()
            if self.claimed:
                mw.waiters.wake(record_key, self)

    def _cancelled_by_watch(self) -> bool:
        """The handler was cancelled: whether only by the client watch (then `_client_gone`
        reports it), not by someone else too (server shutdown: the cancellation goes on)."""
        if not self.gone or self.task is None:
            return False
        self.uncancelled = True
        return self.task.uncancel() == 0

    def _client_gone(self) -> None:
        """The client left while the handler ran: ClientGone (the claim and the handler's
        writes roll back), unless the response was streaming already (its outcome is settled)."""
        task, self.task = self.task, None
        if not self.uncancelled and task is not None:
            task.uncancel()  # the handler swallowed our cancellation and returned
        if not self.passthrough:
            raise ClientGone("the client left while the handler ran; its work was rolled back")

    def due(self) -> None:
        """The handler has run `DISCONNECT_WATCH_AFTER` seconds: watch its client."""
        if self.running and self.task is not None:
            self.watcher = self.task.get_loop().create_task(self.ex.until_disconnect())
            self.watcher.add_done_callback(self._client_left)

    def _client_left(self, watched: asyncio.Task[None]) -> None:
        if not self.running or watched.cancelled() or watched.exception() is not None:
            return
        self.ex.disconnect_event().set()  # the app's own receive() reports it too
        if self.ex.started:
            # A stream's outcome is committed (`settle_early`): the client leaving ends the
            # stream (through the app's receive()), never the work the app does after it (a
            # background task, a dependency's teardown). Servers report a disconnect once the
            # response is complete too: cancelled, that work was cut short, its record
            # `succeeded` and replayed to every retry.
            return
        self.gone = True
        assert self.task is not None
        self.task.cancel()

    async def settle_early(self, reason: str) -> None:
        """Before the first byte of a response that cannot be held (see ResponseCapture)."""
        if not self.running:  # a send from a task the handler left behind
            raise RuntimeError("the response was sent after the request ended")
        assert self.context is not None
        await self.context.flush_held_writes()  # (claim sessions' writes: see sqla.py)
        self.context._settled = True  # (a declare from here on is refused: context.declare)
        try:
            await self._settle(omitted=reason)
        except SettlementRefused:
            raise  # (rolled back, the key free: `released`, as a held response's)
        except StoreError:
            self.unsettled = True  # (the store could not record it: `error`, as a held one's)
            raise
        # The outcome is committed and the first byte follows: from here on nothing may run the
        # attempt again (a serialization failure while streaming ends the response instead).
        self.ex.started = True  # (nor is the handler cancelled for its client: `_client_left`)
        # The stream may take as long as its client likes: it holds no connection. Writes the
        # handler makes from here on are outside the claim, on a connection of its own.
        await self.tx.release()
        self.ex.mw.waiters.wake(self.record_key, self)
        if self.ex.slot is not None:
            self.ex.slot.give_back()  # nor the tenant's slot: the stream holds no connection

    def _settle(self, omitted: str | None = None, checked: bool = False) -> Awaitable[None]:
        """Complete (or abandon) the record with the held response's outcome: the store's own
        awaitable, returned (no coroutine of this method's wraps it unless it is observed, or
        claimed as anonymous: see `_settle_anonymous`)."""
        if not self.record_key.tenant and not checked:
            return self._settle_anonymous(omitted)
        assert self.context is not None
        start = self.start
        assert start is not None
        status = start["status"]
        outcome = (
            self.context.declared
            or _OUTCOMES.get(status)
            or outcome_for_status(status, Mode.TRANSACTIONAL)
        )
        state = FINAL_STATE.get(outcome)
        ex = self.ex
        completing: Awaitable[None]
        if state is None:
            completing = self.tx.abandon()
            outcome = Outcome.RELEASE
        else:
            completing = self.tx.finish(state, self.stored(omitted))
        if ex.mw.observer is None:
            return completing
        return self._observed(completing, outcome)

    async def _settle_anonymous(self, omitted: str | None) -> None:
        """Claimed as anonymous: refused (CallerNamedLate, the transaction rolled back) if
        authentication inside the middleware has named the caller since."""
        await self.ex.mw.tenants.refuse_named_late(self.ex.scope)
        await self._settle(omitted, True)

    async def _observed(self, completing: Awaitable[None], outcome: Outcome) -> None:
        assert self.context is not None
        with self.ex.timed("complete"):
            await completing
        self.ex.emit(SETTLED_EVENTS[outcome], self.context.generation)
