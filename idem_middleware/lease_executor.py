"""Lease mode's executor: the handler runs under a generation, with a heartbeat, and its outcome
is settled by compare-and-set (or in the fenced transaction); a stale executor is answered 409.

`lease.LeaseRun` decides when to execute (a fresh claim, a takeover, a reconciled retry).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from functools import partial
from typing import TYPE_CHECKING

from anyio import CancelScope

from .answers import SENT, Answer, Problem
from .capture import ResponseCapture
from .context import IdempotencyContext, claimed_context, enter_context, key_digest, leave_context
from .delayed import Delayed
from .errors import CallerNamedLate, ClaimTimeout, ProblemKind, StaleGeneration, blip
from .fence import Fence
from .heartbeat import keep_lease
from .observe import SETTLED_EVENTS, Event
from .outcomes import outcome_for_status, settlement_for
from .policy import Mode
from .resettle import (
    committed_after_all,
    cut_short,
    settle_again,
    settle_early_again,
    to_the_end,
    unresolve,
    unresolve_after,
)
from .store.base import Claimed, RecordKey, State

if TYPE_CHECKING:
    from .exchange import Exchange
    from .lease import LeaseRun

logger = logging.getLogger("idem_middleware")

_LOST_CLAIM = (
    "This execution lost its claim (its lease lapsed, and the record was taken over or marked "
    "unknown); its result was not recorded. Retry to get the outcome."
)


def log_extra(key: RecordKey, generation: int, outcome: str) -> dict[str, object]:
    """A lease decision's log fields: never the raw key."""
    return {
        "tenant": key.tenant,
        "operation": key.operation,
        "key_digest": key_digest(key.key),
        "generation": generation,
        "outcome": outcome,
    }


#: One shared timer per lease length starts the heartbeats of executions still running when
#: their first renewal is due (a third of the lease).
_RENEWALS: dict[float, Delayed] = {}


def _renewals(lease_seconds: float) -> Delayed:
    delayed = _RENEWALS.get(lease_seconds)
    if delayed is None:
        delayed = _RENEWALS[lease_seconds] = Delayed(lease_seconds / 3)
    return delayed


class LeaseExecution:
    """One execution of a claimed (or taken over) lease-mode request."""

    __slots__ = (
        "capture",
        "context",
        "due_at",
        "epoch",
        "ex",
        "fence",
        "generation",
        "heartbeat",
        "key",
        "policy",
        "request_context",
        "stop",
        "store",
    )

    #: When the first renewal falls due, on the loop's clock (a third of the lease after the
    #: execution started, which is after its claim committed); set as it starts.
    due_at: float

    def __init__(self, ex: Exchange, key: RecordKey, generation: int, epoch: int | None) -> None:
        self.ex = ex
        self.key = key
        self.generation = generation
        self.epoch = epoch
        self.policy = ex.policy
        self.store = ex.store
        # The heartbeat, once started (`due`), and what stops it.
        self.context: IdempotencyContext | None = None
        self.heartbeat: asyncio.Task[None] | None = None
        self.stop: asyncio.Event | None = None
        self.fence: Fence | None = None
        self.capture: ResponseCapture | None = None
        self.request_context: contextvars.Context | None = None

    async def run(self, first: LeaseRun | None = None) -> Answer:
        """Run the handler under the generation; `first`: a fresh request's, whose claim is made
        here first (in this frame, not in one of `first`'s above it: each await of the handler
        passes through every frame between it and the task), the tenant's slot held until the
        execution ends (it may open a fenced transaction)."""
        ex = self.ex
        slot = None
        if first is not None:
            slot = first.slot()
            if slot is None:
                return first.busy()
            try:
                claiming = first.claim()
                if ex.mw.observer is None:
                    claim = await claiming  # (nothing observes: no timer calls)
                else:
                    with ex.timed("claim"):
                        claim = await claiming
            except ClaimTimeout:
                # A transaction is claiming the key (or the record kept changing): it is waited
                # for as a duplicate waits, without a connection, and the key claimed again.
                claim = None
            except BaseException:
                slot.give_back()
                raise
            if not isinstance(claim, Claimed):
                slot.give_back()
                return await first.unclaimed(claim)
            self.generation, self.epoch = claim.generation, claim.epoch
        policy = self.policy
        generation = self.generation
        fence = Fence(self.store, self.key, generation, State.PENDING)
        key = self.key
        context = claimed_context(
            key.tenant,
            key.operation,
            key.key,
            generation,
            Mode.LEASE,
            None,  # connection: the fence's, opened when the handler asks
            self.epoch,
            fence.connection,
        )
        self.fence = fence
        capture = self.capture = ResponseCapture(ex.send, policy.max_response_bytes, self)
        try:
            # (The execution itself, in this frame: each await of the handler passes through
            # every frame between it and the task.) Its key is held here until it ends (or
            # settles early): a duplicate of this process's waits for it with no slot.
            ex.mw.waiters.held[key] = self
            ex.emit(Event.CLAIMED, generation)
            # The heartbeat task starts only when the first renewal is due (a third of the
            # lease): most handlers are done sooner, and a task (or a timer) per request is not
            # free.
            self.context = context
            renewals = _renewals(policy.lease_seconds)
            # (The heartbeat runs in this request's context, not the shared timer's.)
            self.request_context = contextvars.copy_context()
            self.due_at = renewals.add(self)
            token = enter_context(ex.scope, context)
            try:
                try:
                    await ex.mw.app(ex.scope, ex, capture)  # ex: the app's receive
                except StaleGeneration if context.lease_lost.is_set() else ():  # noqa: B030
                    if capture.passthrough:
                        raise
                    # The handler let its fenced write's refusal escape: this generation no
                    # longer holds the record (a takeover, or the lease lapsed), so nothing of
                    # ours can be settled. The same answer as a refused completion: retry for
                    # the outcome. (The clause matches only this execution's own, which sets
                    # `lease_lost` before it is raised: another's, a lease-mode job's the
                    # handler called, is the handler's error like any other, below.)
                    await fence.seal()
                    logger.warning(
                        "a stale executor's fenced write was refused",
                        extra=log_extra(key, generation, "stale"),
                    )
                    settled = False
                except BaseException as exc:
                    # Clean up, then re-raise. Whatever the handler did outside the database
                    # may have happened: unknown, unless it declared the request did nothing.
                    if capture.passthrough:
                        raise
                    gone = fence.lost(exc) if isinstance(exc, Exception) else None
                    # (To its end: cancellations, anyio's too, wait for it: see `to_the_end`.)
                    third = policy.lease_seconds / 3
                    moved, event = await to_the_end(
                        fence.seal,
                        partial(
                            unresolve_after,
                            exc,
                            self.store,
                            key,
                            generation,
                            context,
                            seconds=third,
                        ),
                    )
                    if moved:
                        ex.emit(event, generation)
                    if moved and gone is not None:
                        raise gone from exc  # (its fenced connection lost): a 503, not a 500
                    if moved or not isinstance(exc, Exception):
                        raise
                    # Another execution owns the record now: answered as a stale executor
                    # that returned is (retry for the outcome), not with a plain 500.
                    logger.warning(
                        "a stale executor's handler raised",
                        exc_info=True,
                        extra=log_extra(key, generation, "stale"),
                    )
                    settled = False
                else:
                    if capture.passthrough:
                        return SENT
                    try:
                        if capture.start is None or not capture.complete:
                            if capture.start is None or not ex.client_left():
                                await fence.seal()
                                # (`unknown`, or released as declared; sent again on a blip)
                                await self._unresolved(context)
                                raise RuntimeError(
                                    "the application returned without a complete response"
                                )
                            # The client left while the response was produced, and the server's
                            # disconnect ended it (Starlette's streaming response stops when its
                            # client leaves): the handler ran, and its outcome is its status, the
                            # body omitted as a stream's. (Marked `unknown`, with a 500, the key
                            # waited for an operator.)
                            if await cut_short(self, context, fence, capture):
                                return SENT  # (nobody to send it to)
                            settled = False
                        else:
                            # (Renewals go on while it settles: its statement may wait for a pooled
                            # connection past the lease. The finally stops them once it returns.)
                            try:
                                settled = await self._settle(context, fence, capture)
                            except Exception as exc:
                                if fence.committing or not blip(exc):
                                    await self._unresolved(context)
                                    if not blip(exc) or not await committed_after_all(
                                        self, context, capture
                                    ):
                                        raise
                                    settled = True
                                else:
                                    settled = await settle_again(self, context, capture, exc)
                    except asyncio.CancelledError:
                        # (The server's shutdown, the settlement in flight: waiting for a pooled
                        # connection, say.) The handler ran: `unknown`, as a cancelled handler's
                        # record is, not `pending` until its lease lapses (a takeover would run
                        # it again). A settlement that committed stands: the mark changes nothing.
                        await to_the_end(fence.seal, lambda: self._unresolved(context))
                        raise
            finally:
                leave_context(ex.scope, token, context)
                # Stopped by awaiting, never cancelled mid-write: a renewal in flight finishes
                # (it never waits on the fenced transaction's row lock), and it cannot change a
                # settled record (it only renews a pending one). (Once: an early settlement
                # stopped it.)
                if self.context is not None:
                    self._stop_renewing(renewals)
                if self.heartbeat is not None:  # (shielded: this task's cancellation is its own)
                    await asyncio.shield(self.heartbeat)
            if settled:
                return capture  # held: the exchange flushes it
            ex.emit(Event.STALE, generation)  # (the claim's end, not a duplicate's `in_flight`)
            return Problem(ProblemKind.IN_FLIGHT, _LOST_CLAIM, policy.retry_after_seconds, True)
        finally:
            capture.close()  # this execution and its capture refer to each other
            if slot is not None:
                slot.give_back()
            ex.mw.waiters.wake(key, self)

    async def settle_early(self, reason: str) -> None:
        """Before the first byte of a response that cannot be held: a refused settlement (a
        newer generation owns the record) must stop it, or the client would see an outcome the
        record contradicts. The StaleGeneration reaches `_execute` through the handler, like a
        refused fenced write."""
        assert self.context is not None
        assert self.fence is not None
        assert self.capture is not None
        await self.context.flush_held_writes()  # (claim sessions' writes: see sqla.py)
        self.context._settled = True  # (a declare from here on is refused: context.declare)
        # Shielded: the server's disconnect cancels a streaming response's task (Starlette's,
        # under a server of ASGI spec 2.3), and the outcome, cut off in flight, was marked
        # `unknown` for a handler that had run. It is recorded; the stream then ends.
        with CancelScope(shield=True):
            try:
                settled = await self._settle(self.context, self.fence, self.capture, omitted=reason)
            except Exception as exc:
                settled = await settle_early_again(self, self.context, self.capture, reason, exc)
        if not settled:
            self.context.lease_lost.set()
            raise StaleGeneration("this execution's early settlement was refused")
        # Settled: no lease is left to keep while the response streams (a renewal would find the
        # record settled, and take it for a lost lease).
        self._stop_renewing(_renewals(self.policy.lease_seconds))
        self.ex.started = True
        if self.ex.slot is not None:
            self.ex.slot.give_back()  # the stream holds no connection, nor the tenant's slot
        self.ex.mw.waiters.wake(self.key, self)

    async def _settle(
        self,
        context: IdempotencyContext,
        fence: Fence,
        capture: ResponseCapture,
        omitted: str | None = None,
    ) -> bool:
        if not self.key.tenant:  # claimed as anonymous: was the caller named since?
            try:
                await self.ex.mw.tenants.refuse_named_late(self.ex.scope)
            except CallerNamedLate:
                await fence.seal()  # (its writes rolled back; the caller marks it unknown)
                raise
        outcome = context.declared or outcome_for_status(capture.status, Mode.LEASE)
        generation = context.generation
        recording = fence.record(settlement_for(outcome, lambda: capture.stored(omitted)))
        observed = self.ex.mw.observer is not None
        if observed:
            with self.ex.timed("complete"):
                settled = await recording
        else:
            settled = await recording  # (nothing observes: no timer and no event calls)
        if not settled:
            logger.warning(
                "a stale executor's completion was refused",
                extra=log_extra(self.key, generation, "stale"),
            )
        elif observed:
            self.ex.emit(SETTLED_EVENTS[outcome], generation)
        return settled

    async def _unresolved(self, context: IdempotencyContext, seconds: float | None = None) -> None:
        """The settlement failed (the database refused its transaction, or lost its
        connection): what the handler did outside the database may have happened, so the
        record is `unknown` now, as when the handler raises, not `pending` until the lease
        lapses (sent again on a blip for `seconds`, a third of the lease by default). A
        settlement that committed after all (its connection lost after the COMMIT) held the
        record's row lock until then, and this changes nothing."""
        key, generation = self.key, self.generation
        if seconds is None:
            seconds = self.policy.lease_seconds / 3
        try:
            moved, event = await unresolve(self.store, key, generation, context, seconds=seconds)
        except Exception:
            logger.warning(
                "a failed settlement's record stays pending until its lease lapses",
                exc_info=True,
                extra=log_extra(key, generation, "unsettled"),
            )
            return
        if moved:
            self.ex.emit(event, generation)

    def due(self) -> None:
        """The first renewal is due and the handler still runs: start the heartbeat."""
        if self.context is not None and self.stop is None:
            self.stop = asyncio.Event()
            self.heartbeat = asyncio.get_running_loop().create_task(
                self._heartbeat(self.context, self.stop), context=self.request_context
            )

    def _stop_renewing(self, renewals: Delayed) -> None:
        renewals.discard(self)
        self.context = None  # a renewal not yet started never starts
        if self.stop is not None:
            self.stop.set()

    async def _heartbeat(self, context: IdempotencyContext, stop: asyncio.Event) -> None:
        """Renew the lease now (started when the first renewal is due, a third of the lease
        after the claim), then every third of it (see heartbeat.py). The lease granted ends a
        lease after the execution started (`due_at` is a third of it after), not two thirds
        after this task started: a loop running late starts it late, and an execution whose
        renewals fail believed it held the record past the lease's end, when another process
        may take it over."""
        lease = self.policy.lease_seconds
        held_until = self.due_at + lease * 2 / 3
        fence = self.fence
        assert fence is not None
        await keep_lease(
            self.store,
            context,
            lease,
            stop,
            held_until=held_until,
            renew_now=True,
            settling=lambda: fence.settling,
        )
