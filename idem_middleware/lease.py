"""Lease mode: the claim commits first, a heartbeat keeps it, and completion is a compare-and-set.

For routes whose effects live outside the database (a bank, a broker), where a crash or timeout
leaves the outcome unknown. See docs/lease-mode.md. Like transactional mode, it returns what the
client is to be told (an `answers.Answer`); the exchange sends it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable
from typing import TYPE_CHECKING

from .answers import TENANT_BUSY, WAITERS_FULL, Answer, InFlight, Problem
from .errors import ClaimBusy, ClaimRefused, ClaimTimeout, ProblemKind, StoreClosed, StoreError
from .fence import Verdict
from .lease_executor import LeaseExecution, log_extra
from .outcomes import duplicate_answer, settled_answer
from .policy import LeaseExpiry
from .reconcile_bound import bounded_reconciler
from .store.base import Claim, Claimed, Record, RecordKey, State, TokenRefused
from .waiting import FREE_SLOT, Held, lock_wait, wait_rounds

if TYPE_CHECKING:
    from .exchange import Exchange

logger = logging.getLogger("idem_middleware")

# Polling between notifications: quick at first, then backing off. A notification cuts it short.
_FIRST_POLL = 0.05
_MAX_POLL = 1.0
# Every loop is bounded: the waits by `waiting.wait_rounds`, the wait for a tenant's slot by this
# many pauses (a slot this slow to free is a bug, not load).
_MAX_ROUNDS = 10_000
#: How many moves of one record (its lapsed lease's, a takeover, a reconciler's settlement) may
#: change nothing before it is refused (`LeaseRun._moved_nothing`).
_UNMOVED_TIMES = 3
#: The first pause of a duplicate waiting for its tenant's slot (doubling, up to _MAX_POLL).
_FIRST_SLOT_PAUSE = 0.005


_NO_RECONCILER = "No reconciler can tell what happened."


class LeaseRun:
    def __init__(self, ex: Exchange, key: RecordKey, fingerprint: bytes) -> None:
        self.ex = ex
        self.key = key
        self.fingerprint = fingerprint
        self.policy = ex.policy
        self.store = ex.store
        #: The generation of an unknown record this request's reconciler said did not happen,
        #: whose takeover found it held: taken over when it is still that (not asked again).
        self._retake: int | None = None
        #: The generation of an unknown record whose fence another session held when this
        #: request's reconciler asked: asked again only once this request holds the fence.
        self._held: int | None = None
        #: The timer of this duplicate's wait, while it waits (`duplicate`).
        self._wait_timer: contextlib.ExitStack | None = None
        #: One of the process's waiting places (`max_waiters`), while this duplicate waits.
        self._place: Held | None = None
        #: (generation, times): a lapsed record's moves that changed nothing (`_moved_nothing`).
        self._unmoved = (0, 0)

    def claim(self) -> Awaitable[Claim]:
        # The store's own coroutine, returned: no coroutine of this method's wraps it.
        return self.store.claim_lease(
            self.key,
            self.fingerprint,
            retention_seconds=self.policy.retention_seconds,
            lease_seconds=self.policy.lease_seconds,
            token_hash=self.ex.token_hash,
        )

    def run(self) -> Awaitable[Answer]:
        """The request's coroutine: the execution's, which claims the key first in its own frame
        (`LeaseExecution.run`), so that each await of the handler passes one frame fewer; a key
        it could not claim is answered by `unclaimed`. A duplicate of a request this process runs
        (`Waiters.held`: an execution's, or a transactional attempt's) waits at once, as one whose
        claim found the key busy: with no slot (a tenant at its cap is not refused its replay)."""
        held = self.ex.mw.waiters.held
        if held and self.key in held:
            return self.duplicate(None, busy=True)
        return LeaseExecution(self.ex, self.key, 0, None).run(self)

    async def unclaimed(self, claim: Claim | None) -> Answer:
        """Answer a fresh request whose claim found the key held (`claim`, or None when a
        transaction was claiming it: waited for as a duplicate waits, without a connection, and
        the key claimed again). Its slot was given back: a duplicate holds none while it waits."""
        if claim is None:
            return await self.duplicate(None, busy=True)
        if isinstance(claim, TokenRefused):
            return Problem(ProblemKind.TOKEN_INVALID, claim.reason)
        assert not isinstance(claim, Claimed)
        return await self.duplicate(claim.record)

    # -- a duplicate: replay, wait, take over, or reconcile ------------------------------------

    async def duplicate(self, record: Record | None, *, busy: bool = False) -> Answer:
        """Answer a request whose key is held (`record`, or None when there was none), waiting
        first when `busy` (a transaction is claiming the key)."""
        policy = self.policy
        store = self.store
        loop = asyncio.get_running_loop()
        deadline = loop.time() + policy.wait_seconds
        poll = _FIRST_POLL
        waiters = self.ex.mw.waiters
        # The wait is timed from the first time this request waits until it is answered.
        async with store.watch(self.key) as watch, contextlib.AsyncExitStack() as waiting:
            for _ in range(wait_rounds(policy.wait_seconds, _MAX_POLL)):
                acted = True if busy else await self._act(record, deadline)
                busy = False
                if not isinstance(acted, bool):
                    return acted
                if acted:
                    remaining = deadline - loop.time()
                    if remaining <= 0:
                        return self._in_flight(record)
                    if self._place is None:  # (given back when it stops waiting: `_waited`)
                        if (place := waiters.place()) is None:
                            return Problem(
                                ProblemKind.IN_FLIGHT, WAITERS_FULL, policy.retry_after_seconds
                            )
                        self._place = place
                    if poll == _FIRST_POLL:
                        # (Registered first: a timer that fails to start, an observer's
                        # BaseException, leaves the place above given back all the same.)
                        waiting.callback(self._waited)
                        timer = self._wait_timer = contextlib.ExitStack()
                        timer.enter_context(self.ex.timed("wait"))
                    seconds = min(remaining, poll)
                    if self.key in waiters.held:  # (woken as this process's holder ends, with
                        # or without LISTEN: its end is not another process's NOTIFY)
                        await self.ex.wait_present(waiters.wait(self.key, seconds))
                    else:
                        await self.ex.wait_present(watch.wait(seconds))
                    poll = min(poll * 2, _MAX_POLL)
                try:
                    # (Bounded by the wait: a read held up by a lock on the table, a migration's
                    # say, waited for the whole lock.)
                    async with asyncio.timeout(lock_wait(deadline - loop.time())):
                        record = await store.get(self.key)
                except TimeoutError:
                    return self._in_flight(record)
                except StoreError as exc:
                    # The server went away while this duplicate waited (a restart): it holds
                    # nothing, so it polls on, for what is left of its wait (not a closed store).
                    if poll == _FIRST_POLL or loop.time() >= deadline or type(exc) is StoreClosed:
                        raise
                    busy = True  # (not read: waited for again, never acted on unread)
        raise RuntimeError("the record kept changing; giving up")  # pragma: no cover

    def _in_flight(self, record: Record | None) -> InFlight:
        """The original still runs. This request's fingerprint goes in a 202's Location, as a
        transactional duplicate's does, whether or not the record (`record`) could be compared
        with it yet (a transactional claim of another version or middleware holds the key
        uncommitted): the record the status resource reads later may be another request's (the
        original released, a corrected request claimed the key since), and it then tells this
        one `422 key-reused`, never that request's outcome as its own."""
        return InFlight(fingerprint=self.fingerprint)

    async def _act(self, record: Record | None, deadline: float) -> Answer | bool:
        """One look at the record: the answer; or True to wait (it is in flight, or another
        session holds the key or the record: waited for without a connection) or False to
        read it again at once (it changed) before the next look."""
        policy = self.policy
        store = self.store
        if record is None or record.expired:
            slot = await self._slot_by(deadline)
            if slot is None:
                return self.busy()
            try:
                try:
                    claim = await self.claim()
                except ClaimTimeout:
                    return True  # a transaction is claiming the key
                if isinstance(claim, Claimed):
                    return await self.execute(claim.generation, claim.epoch)
            finally:
                slot.give_back()
            if isinstance(claim, TokenRefused):
                return Problem(ProblemKind.TOKEN_INVALID, claim.reason)
            record = claim.record
        answer = settled_answer(record, self.fingerprint)
        if answer is not None:
            return answer  # another request's key (422), or the replay
        if record.state is State.UNKNOWN:
            if record.generation == self._retake:
                slot = await self._slot_by(deadline)
                if slot is None:
                    return self.busy()
                try:
                    return await self._run_again(record)
                finally:
                    slot.give_back()
            return await self.reconcile(record, deadline)
        if record.retry_allowed or (
            record.lease_expired and policy.on_lease_expiry is LeaseExpiry.TAKEOVER
        ):
            slot = await self._slot_by(deadline)
            if slot is None:
                return self.busy()
            try:
                try:
                    generation = await store.takeover(
                        self.key, record.generation, State.PENDING, policy.lease_seconds
                    )
                except ClaimBusy:
                    # Another session holds the record (the executor still in its fenced
                    # transaction past its lease, a transaction taking a released record over).
                    return True
                if generation is not None:
                    logger.info(
                        "took over a lapsed claim",
                        extra=log_extra(self.key, generation, "takeover"),
                    )
                    return await self.execute(generation, record.epoch)  # the same life
            finally:
                slot.give_back()
            return self._moved_nothing(record)
        if record.lease_expired:
            try:
                moved = await store.expire_lease(self.key, record.generation)
            except ClaimBusy:
                return True  # its executor is still in its fenced transaction, past its lease
            return False if moved else self._moved_nothing(record)
        return True  # in flight: wait for its outcome

    def _moved_nothing(self, record: Record) -> bool:
        """False (read the record again, at once) after a move of the record that changed
        nothing (a lapsed lease marked unknown, a takeover, a reconciler's settlement). The same
        generation moved in vain a third time is no race (whoever else moved it would have
        changed it): a trigger or rule on the store's table skips the write, and the reads and
        moves (a reconciler's call each) went on to the end of the wait, then a bare 500."""
        generation, times = self._unmoved
        times = times + 1 if generation == record.generation else 1
        if times >= _UNMOVED_TIMES:
            raise ClaimRefused(
                "the record could not be moved (marked unknown, taken over or settled): the "
                "write changed nothing three times, so a trigger or rule on idem_requests skips "
                "it (the store's tables take none that do)"
            )
        self._unmoved = (record.generation, times)
        return False

    async def reconcile(self, record: Record, deadline: float) -> Answer | bool:
        """Ask the route's reconciler about an unknown record: the answer, or as `_act`: True
        to wait (another session held the record, or its takeover), False when the record
        changed and the caller should read it again."""
        policy = self.policy
        if policy.reconciler is None:
            return duplicate_answer(record, self.fingerprint, _NO_RECONCILER)
        self._waited()
        # The reconciler may open its fenced transaction (a connection): it holds the tenant's
        # slot meanwhile, as an execution does, and keeps it to run the request again.
        slot = await self._slot_by(deadline)
        if slot is None:
            return self.busy()
        try:
            # (Bounded even if the reconciler swallows its cancellation: see reconcile_bound.)
            result = await bounded_reconciler(
                self.store,
                self.key,
                record.generation,
                policy.reconciler,
                seconds=policy.reconcile_timeout_seconds,
                epoch=record.epoch,
                # Another session's fence on the record (another reconciler asking): its own
                # waited for no longer than this request's wait, as a takeover's lock is.
                held_wait=lock_wait(deadline - asyncio.get_running_loop().time()),
                fence_first=record.generation == self._held,
                max_body_bytes=policy.max_response_bytes,  # (as a handler's response's)
            )
            if result.verdict is Verdict.NOT_HAPPENED:
                return await self._run_again(record)
        finally:
            slot.give_back()
        if result.verdict is Verdict.HELD:
            # Another session's fence (another reconciler asking): its reconciler's answer is
            # waited for without a connection, and the record read again; asked again only
            # with the fence in hand (not the downstream system on every poll).
            self._held = record.generation
            return True
        if result.verdict in (Verdict.STILL_UNKNOWN, Verdict.FAILED, Verdict.BY_HAND):
            return duplicate_answer(record, self.fingerprint, result.reason)
        return self._moved_nothing(record)  # settled (by us or someone else): read, replay

    async def _run_again(self, record: Record) -> Answer | bool:
        """Take over an unknown record reconciled as not happened, and run it (or False when
        the record changed meanwhile, True to wait when another session holds it)."""
        try:
            generation = await self.store.takeover(
                self.key, record.generation, State.UNKNOWN, self.policy.lease_seconds
            )
        except ClaimBusy:
            # Another reconciler's fence (another process's, however long it runs): waited for
            # as any other wait (without a connection or the slot, counted among the waiters,
            # ended by the client leaving), then the takeover is tried again if the record is
            # still this, the reconciler not asked again.
            self._retake = record.generation
            return True
        self._retake = None
        if generation is None:
            return self._moved_nothing(record)
        logger.info(
            "reconciled as not happened; running again",
            extra=log_extra(self.key, generation, "reconciled-retry"),
        )
        return await self.execute(generation, record.epoch)

    # -- the tenant's slot ----------------------------------------------------------------------

    def slot(self) -> Held | None:
        """The tenant's slot, held while this request may hold a connection: a claim, a
        takeover, a reconciliation or an execution (either may open a fenced transaction), never
        a wait. The exchange keeps it, so an execution whose response streams gives it back as
        the stream starts (its outcome is committed). With no cap: a slot that holds nothing."""
        slots = self.ex.mw.tenant_slots
        slot = self.ex.slot = slots.hold(self.key.tenant) if slots.limit is not None else FREE_SLOT
        return slot

    async def _slot_by(self, deadline: float) -> Held | None:
        """A duplicate's slot, to claim or run: waited for (with no connection held) until the
        duplicate's own deadline, since the request that held it is often just ending (its
        settlement woke this one before it gave its slot back); None at the deadline, ClientGone
        when its client leaves first."""
        loop = asyncio.get_running_loop()
        pause = _FIRST_SLOT_PAUSE
        for _ in range(_MAX_ROUNDS):
            slot = self.slot()
            remaining = deadline - loop.time()
            if slot is not None or remaining <= 0:
                return slot
            # (Watched as the duplicate's wait is: a client that leaves ends it, its waiting
            # place given back, and no handler runs for it after.)
            await self.ex.wait_present(asyncio.sleep(min(pause, remaining)))
            pause = min(pause * 2, _MAX_POLL)
        return None  # pragma: no cover

    def _waited(self) -> None:
        """The wait is over: its timer stops here, not after the handler or the reconciler the
        duplicate goes on to run (those would count as waiting, their spans under the wait's),
        and its waiting place is given back (another key's duplicate may wait in it)."""
        place, self._place = self._place, None
        if place is not None:
            place.give_back()
        timer, self._wait_timer = self._wait_timer, None
        if timer is not None:
            timer.close()

    def busy(self) -> Problem:
        return Problem(ProblemKind.TENANT_BUSY, TENANT_BUSY, self.policy.retry_after_seconds)

    # -- the executor --------------------------------------------------------------------------

    def execute(self, generation: int, epoch: int | None) -> Awaitable[Answer]:
        """Run the handler under `generation` (see lease_executor.py): the execution's own
        coroutine, returned (no coroutine of this method's sits above every await of the
        handler)."""
        self._waited()
        return LeaseExecution(self.ex, self.key, generation, epoch).run()
