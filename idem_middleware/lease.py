"""Lease mode: the claim commits first, a heartbeat keeps it, and completion is a compare-and-set.

For routes whose effects live outside the database (a bank, a broker), where a crash or timeout
leaves the outcome unknown. See docs/lease-mode.md. Like transactional mode, it returns what the
client is to be told (an `answers.Answer`); the exchange sends it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

from .answers import (
    SENT,
    TENANT_BUSY,
    WAITERS_FULL,
    Answer,
    InFlight,
    Problem,
    Send,
    TokenRefused,
)
from .capture import ResponseCapture
from .context import IdempotencyContext, enter_context, key_digest, leave_context
from .errors import ClaimTimeout, ProblemKind, StaleGeneration
from .fence import Fence, Verdict, run_reconciler
from .observe import SETTLED_EVENTS, Event
from .outcomes import FINAL_STATE, Outcome, duplicate_answer, outcome_for_status, settled_answer
from .policy import LeaseExpiry, Mode
from .store.base import Claim, Record, RecordKey, Settlement, State

if TYPE_CHECKING:
    from .exchange import Exchange

logger = logging.getLogger("idem_middleware")

# Polling between notifications: quick at first, then backing off. A notification cuts it short.
_FIRST_POLL = 0.05
_MAX_POLL = 1.0
# Every loop is bounded: a record changing this often under one request is a bug, not load.
_MAX_ROUNDS = 10_000
#: The least a duplicate waits for a record an executor's fenced transaction holds.
_MIN_LOCK_WAIT = 0.05


_NO_RECONCILER = "No reconciler can tell what happened."
_LOST_CLAIM = (
    "This execution lost its claim (its lease was taken over); its result was not recorded. "
    "Retry to get the outcome."
)


def _lock_wait(remaining: float) -> float:
    """How long a duplicate may wait for the record's row lock: what is left of its wait."""
    return max(remaining, _MIN_LOCK_WAIT)


class LeaseRun:
    def __init__(self, ex: Exchange, key: RecordKey, fingerprint: bytes) -> None:
        self.ex = ex
        self.key = key
        self.fingerprint = fingerprint
        self.policy = ex.policy
        self.store = ex.store

    async def _claim(self) -> Claim:
        return await self.store.claim_lease(
            self.key,
            self.fingerprint,
            retention_seconds=self.policy.retention_seconds,
            lease_seconds=self.policy.lease_seconds,
            token_hash=self.ex.token_hash,
        )

    async def run(self) -> Answer:
        # The tenant's slot is held while this request may hold a connection: its claim, and
        # its execution (the handler may open a fenced transaction). Not while it waits.
        slots = self.ex.mw.tenant_slots
        if not slots.take(self.key.tenant):
            return Problem(ProblemKind.TENANT_BUSY, TENANT_BUSY, self.policy.retry_after_seconds)
        try:
            try:
                with self.ex.timed("claim"):
                    claim = await self._claim()
            except ClaimTimeout:
                return InFlight()
            if claim.claimed:
                return await self.execute(claim.generation, claim.epoch)
        finally:
            slots.give_back(self.key.tenant)
        if claim.record is None:
            return TokenRefused()
        return await self.duplicate(claim.record)

    # -- a duplicate: replay, wait, take over, or reconcile ------------------------------------

    async def duplicate(self, record: Record | None) -> Answer:
        policy = self.policy
        store = self.store
        loop = asyncio.get_running_loop()
        deadline = loop.time() + policy.wait_seconds
        poll = _FIRST_POLL
        waiters = self.ex.mw.waiters
        # The wait is timed from the first time this request waits until it is answered.
        async with store.watch(self.key) as watch, contextlib.AsyncExitStack() as waiting:
            for _ in range(_MAX_ROUNDS):
                if record is None or record.expired:
                    claim = await self._claim()
                    if claim.claimed:
                        return await self.execute(claim.generation, claim.epoch)
                    if claim.record is None:
                        return TokenRefused()
                    record = claim.record
                answer = settled_answer(record, self.fingerprint)
                if answer is not None:
                    return answer  # another request's key (422), or the replay
                if record.state is State.UNKNOWN:
                    answer = await self.reconcile(record)
                    if answer is not None:
                        return answer
                elif record.retry_allowed or (
                    record.lease_expired and policy.on_lease_expiry is LeaseExpiry.TAKEOVER
                ):
                    try:
                        async with asyncio.timeout(_lock_wait(deadline - loop.time())):
                            generation = await store.takeover(
                                self.key, record.generation, State.PENDING, policy.lease_seconds
                            )
                    except TimeoutError:
                        # The executor is still in its fenced transaction, past its lease.
                        return InFlight()
                    if generation is not None:
                        logger.info(
                            "took over a lapsed claim",
                            extra=self._log_extra(generation, "takeover"),
                        )
                        return await self.execute(generation, record.epoch)  # the same life
                elif record.lease_expired:
                    try:
                        async with asyncio.timeout(_lock_wait(deadline - loop.time())):
                            await store.expire_lease(self.key, record.generation)
                    except TimeoutError:
                        # The executor is still in its fenced transaction, past its lease.
                        return InFlight()
                else:
                    remaining = deadline - loop.time()
                    if remaining <= 0:
                        return InFlight()
                    if poll == _FIRST_POLL:
                        if not waiters.enter():
                            return Problem(
                                ProblemKind.IN_FLIGHT, WAITERS_FULL, policy.retry_after_seconds
                            )
                        waiting.callback(waiters.leave)
                        waiting.enter_context(self.ex.timed("wait"))
                    await watch.wait(min(remaining, poll))
                    poll = min(poll * 2, _MAX_POLL)
                record = await store.get(self.key)
        raise RuntimeError("the record kept changing; giving up")  # pragma: no cover

    async def reconcile(self, record: Record) -> Answer | None:
        """Ask the route's reconciler about an unknown record: the answer, or None when the
        record changed and the caller should read it again."""
        policy = self.policy
        if policy.reconciler is None:
            return duplicate_answer(
                record, self.fingerprint, "No reconciler can tell what happened."
            )
        result = await run_reconciler(
            self.store,
            self.key,
            record.generation,
            policy.reconciler,
            seconds=policy.reconcile_timeout_seconds,
            epoch=record.epoch,
        )
        if result.verdict is Verdict.NOT_HAPPENED:
            # (No fenced transaction can hold an unknown record: a fence needs it pending.)
            generation = await self.store.takeover(
                self.key, record.generation, State.UNKNOWN, policy.lease_seconds
            )
            if generation is None:
                return None
            logger.info(
                "reconciled as not happened; running again",
                extra=self._log_extra(generation, "reconciled-retry"),
            )
            return await self.execute(generation, record.epoch)
        if result.verdict in (Verdict.STILL_UNKNOWN, Verdict.FAILED):
            return duplicate_answer(record, self.fingerprint, result.reason)
        return None  # settled (by us or by someone else): read it again and replay

    # -- the executor --------------------------------------------------------------------------

    async def execute(self, generation: int, epoch: int | None) -> Answer:
        ex = self.ex
        policy = self.policy
        fence = Fence(self.store, self.key, generation, State.PENDING)
        context = IdempotencyContext(
            tenant=self.key.tenant,
            operation=self.key.operation,
            key=self.key.key,
            generation=generation,
            mode=Mode.LEASE,
            connection=None,
            epoch=epoch,
            _fence=fence.connection,
        )

        async def settle_early(reason: str) -> None:
            # Before the first byte of a response that cannot be held: a refused settlement
            # (a newer generation owns the record) must stop it, or the client would see an
            # outcome the record contradicts. The StaleGeneration reaches `_execute` through
            # the handler, like a refused fenced write.
            if not await self._settle(context, fence, capture, omitted=reason):
                raise StaleGeneration("this execution's early settlement was refused")
            ex.started = True

        capture = ResponseCapture(ex.send, policy.max_response_bytes, settle_early)
        try:
            return await self._execute(context, fence, capture)
        finally:
            capture.close()  # settle_early and capture refer to each other

    async def _execute(
        self,
        context: IdempotencyContext,
        fence: Fence,
        capture: ResponseCapture,
    ) -> Answer:
        ex = self.ex
        policy = self.policy
        generation = context.generation
        ex.emit(Event.CLAIMED, generation)
        # The heartbeat task starts only when the first renewal is due (a third of the lease):
        # most handlers are done sooner, and a task per request is not free.
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        heartbeat: asyncio.Task[None] | None = None

        def start_heartbeat() -> None:
            nonlocal heartbeat
            heartbeat = loop.create_task(self._heartbeat(context, stop))

        first_renewal = loop.call_later(policy.lease_seconds / 3, start_heartbeat)
        token = enter_context(ex.scope, context)
        try:
            try:
                await ex.app(ex.scope, ex.app_receive, capture)
            except StaleGeneration:
                if capture.passthrough:
                    raise
                # The handler let its fenced write's refusal escape: this generation no longer
                # holds the record (a takeover, or the lease lapsed), so nothing of ours can be
                # settled. The same answer as a refused completion: retry for the outcome.
                await fence.close()
                logger.warning(
                    "a stale executor's fenced write was refused",
                    extra=self._log_extra(generation, "stale"),
                )
                settled = False
            except BaseException:
                # Clean up, then re-raise. Whatever the handler did outside the database may
                # have happened: unknown, unless it declared the request did nothing.
                if not capture.passthrough:
                    await fence.close()
                    if context.declared is Outcome.RELEASE:
                        await self.store.release(self.key, generation)
                        ex.emit(Event.RELEASED, generation)
                    else:
                        await self.store.settle(
                            self.key, generation, State.PENDING, Settlement(State.UNKNOWN)
                        )
                        ex.emit(Event.UNRESOLVED, generation)
                raise
            else:
                if capture.passthrough:
                    return SENT
                if capture.start is None or not capture.complete:
                    await fence.close()
                    await self.store.settle(
                        self.key, generation, State.PENDING, Settlement(State.UNKNOWN)
                    )
                    raise RuntimeError("the application returned without a complete response")
                stop.set()  # no new renewals once settling starts
                settled = await self._settle(context, fence, capture)
        finally:
            leave_context(ex.scope, token)
            # Stopped by awaiting, never cancelled mid-write: a renewal in flight finishes (after
            # the settlement, if it waited on the fenced transaction's row lock), and it cannot
            # change a settled record (it only renews a pending one).
            first_renewal.cancel()
            stop.set()
            if heartbeat is not None:
                await heartbeat
        if settled:
            return Send(capture.flush)
        return Problem(ProblemKind.IN_FLIGHT, _LOST_CLAIM, policy.retry_after_seconds)

    async def _settle(
        self,
        context: IdempotencyContext,
        fence: Fence,
        capture: ResponseCapture,
        omitted: str | None = None,
    ) -> bool:
        outcome = context.declared or outcome_for_status(capture.status, Mode.LEASE)
        state = FINAL_STATE.get(outcome)
        generation = context.generation
        with self.ex.timed("complete"):
            if state is not None:
                settled = await fence.settle(Settlement(state, capture.stored(omitted)))
            else:
                await fence.close()
                if outcome is Outcome.RELEASE:
                    settled = await self.store.release(self.key, generation)
                else:
                    settled = await self.store.settle(
                        self.key, generation, State.PENDING, Settlement(State.UNKNOWN)
                    )
        if settled:
            self.ex.emit(SETTLED_EVENTS[outcome], generation)
        else:
            logger.warning(
                "a stale executor's completion was refused",
                extra=self._log_extra(generation, "stale"),
            )
        return settled

    async def _heartbeat(self, context: IdempotencyContext, stop: asyncio.Event) -> None:
        """Renew the lease now (started when the first renewal is due), then every third of it."""
        interval = self.policy.lease_seconds / 3
        while not stop.is_set():
            try:
                alive = await self.store.heartbeat(
                    self.key, context.generation, self.policy.lease_seconds
                )
            except Exception:
                logger.warning("heartbeat failed", exc_info=True)
                alive = True  # unknown: try again at the next renewal
            if not alive:
                if not stop.is_set():
                    context.lease_lost.set()
                    logger.warning(
                        "lease lost: this execution can no longer complete",
                        extra=self._log_extra(context.generation, "lease-lost"),
                    )
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)

    def _log_extra(self, generation: int, outcome: str) -> dict[str, object]:
        return {
            "tenant": self.key.tenant,
            "operation": self.key.operation,
            "key_digest": key_digest(self.key.key),
            "generation": generation,
            "outcome": outcome,
        }
