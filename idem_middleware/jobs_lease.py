"""A job in lease mode: the claim commits first, a heartbeat keeps the lease, and the outcome is
a compare-and-set under the run's generation."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from functools import partial
from typing import Any

import orjson

from .context import Outcome
from .errors import ClaimBusy, ClaimTimeout, JobInProgress, StaleGeneration, StoreError, blip
from .fence import Fence
from .heartbeat import keep_lease
from .jobs_spec import JSON_HEADERS, UNSETTLED, JobSpec
from .outcomes import settlement_for
from .policy import LeaseExpiry
from .resettle import landed, send_again, to_the_end, unresolve, unresolve_after
from .store.base import (
    Claimed,
    Record,
    RecordKey,
    State,
    StoredResponse,
    TokenRefused,
)
from .waiting import lock_wait, wait_rounds

logger = logging.getLogger("idem_middleware")

#: A waiting run looks at the record again at least this often (a settlement wakes it sooner).
_POLL = 0.5


async def run_leased(
    job: JobSpec, key: RecordKey, fingerprint: bytes, args: Any, kwargs: Any
) -> Any:
    store = job.store
    loop = asyncio.get_running_loop()
    deadline = loop.time() + job.wait_seconds
    async with store.watch(key) as watch:
        record: Record | None = None
        for _ in range(wait_rounds(job.wait_seconds, _POLL)):
            if record is None or record.expired:
                try:
                    claim = await store.claim_lease(
                        key,
                        fingerprint,
                        retention_seconds=job.retention_seconds,
                        lease_seconds=job.lease_seconds,
                    )
                except ClaimTimeout:
                    claim = None  # a transaction is claiming the key (or it kept changing)
                if isinstance(claim, Claimed):
                    return await _execute(job, key, claim.generation, claim.epoch, args, kwargs)
                assert not isinstance(claim, TokenRefused)  # a job's key is never a token
                record = None if claim is None else claim.record
            # Whether to wait (without a connection) before the next look: the run is in
            # flight, or another session holds the key or the record.
            busy = record is None
            if record is not None:
                answer = job.answer(record, fingerprint)
                if answer is not UNSETTLED:
                    return answer
                if record.retry_allowed or (
                    record.lease_expired and job.on_lease_expiry is LeaseExpiry.TAKEOVER
                ):
                    try:
                        generation = await store.takeover(
                            key, record.generation, State.PENDING, job.lease_seconds
                        )
                    except ClaimBusy:
                        # A run past its lease still in its fenced transaction, or a
                        # transaction taking a released record over.
                        busy = True
                    else:
                        if generation is not None:
                            return await _execute(job, key, generation, record.epoch, args, kwargs)
                elif record.lease_expired:
                    try:
                        await store.expire_lease(key, record.generation)
                    except ClaimBusy:
                        busy = True  # a run past its lease still in its fenced transaction
                else:
                    busy = True  # in flight: wait for its outcome
            if busy:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise JobInProgress(f"{job.operation}: another run holds this key")
                await watch.wait(min(remaining, _POLL))
            try:  # (bounded by the wait, as a request's duplicate's read is)
                async with asyncio.timeout(lock_wait(deadline - loop.time())):
                    record = await store.get(key)
            except TimeoutError:
                raise JobInProgress(f"{job.operation}: another run holds this key") from None
    raise RuntimeError("the record kept changing; giving up")  # pragma: no cover


async def _execute(
    job: JobSpec, key: RecordKey, generation: int, epoch: int | None, args: Any, kwargs: Any
) -> Any:
    store = job.store
    fence = Fence(store, key, generation, State.PENDING)
    context = job.context(key, generation, epoch, None, fence.connection)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    renewing = keep_lease(
        store,
        context,
        job.lease_seconds,
        stop,
        held_until=loop.time() + job.lease_seconds,
        renew_now=False,
        settling=lambda: fence.settling,
    )
    heartbeat = loop.create_task(renewing)
    try:
        try:
            body = await job.run(context, args, kwargs)
        except BaseException as exc:
            if isinstance(exc, StaleGeneration) and context.lease_lost.is_set():
                # This run's own claim was lost (its fenced connection refused, or its renewals
                # found the record gone): nothing of its own can be settled. Another run's (a
                # lease-mode job it called lost its claim) is its error like any other, below.
                await fence.seal()
                raise
            # Whatever the function did outside the database may have happened: unknown,
            # unless it declared that it did nothing (sent again on a blip). To its end, however
            # cancelled meanwhile (an anyio cancel scope's too): see `to_the_end`.
            gone = fence.lost(exc) if isinstance(exc, Exception) else None
            third = job.lease_seconds / 3
            await to_the_end(
                fence.seal,
                partial(unresolve_after, exc, store, key, generation, context, seconds=third),
            )
            if gone is not None:
                raise gone from exc  # its fenced connection lost: the store failed (a 503's)
            raise
        # (Renewals go on while it settles: its statement may wait for a pooled connection past
        # the lease. The finally stops them once it returns.)
        outcome = context.declared or Outcome.SUCCEEDED
        settlement = settlement_for(outcome, lambda: StoredResponse(200, JSON_HEADERS, body))
        third = job.lease_seconds / 3
        try:
            try:
                settled = await fence.record(settlement)
            except StoreError as exc:
                if fence.committing or not blip(exc):
                    # The fenced COMMIT took the function's writes with it (or the database
                    # refused it): what it did elsewhere may have happened. Unless the COMMIT
                    # landed and only its answer was lost: the record then says so (`holds`).
                    with contextlib.suppress(StoreError):
                        await unresolve(store, key, generation, context, seconds=third)
                    if (
                        not blip(exc)
                        or settlement is None
                        or settlement.state is State.UNKNOWN
                        or not await landed(
                            store, key, generation, settlement.state, settlement.response
                        )
                    ):
                        raise
                    settled = True
                else:
                    settled = await send_again(
                        store,
                        key,
                        generation,
                        settlement,
                        seconds=third,
                        error=exc,
                        over_unknown=fence.over_unknown,
                    )
        except asyncio.CancelledError as exc:
            # (A shutdown, the settlement in flight, or sent again after a blip.) The function
            # ran: `unknown`, as for one cancelled while it ran, not `pending` until the lease
            # lapses (a takeover would run it again). One that committed stands: no change.
            await to_the_end(
                fence.seal,
                partial(unresolve_after, exc, store, key, generation, context, seconds=third),
            )
            raise
    finally:
        stop.set()
        # Stopped by the event, never cancelled mid-write (shielded: a cancellation of this
        # task is this task's, not passed on to the heartbeat, where Python 3.11 could lose it).
        await asyncio.shield(heartbeat)
    if not settled:
        raise StaleGeneration(
            f"{job.operation}: generation {generation} lost its claim; nothing was recorded"
        )
    return orjson.loads(body)
