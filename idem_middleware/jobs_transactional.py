"""A job in transactional mode: the claim, the function and the outcome in one transaction."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson

from .context import Outcome
from .errors import JobInProgress
from .jobs_spec import JSON_HEADERS, UNSETTLED, JobSpec
from .outcomes import FINAL_STATE
from .store.base import (
    ClaimBusy,
    Claimed,
    ClaimTimeout,
    Existing,
    RecordKey,
    RetryableConflict,
    StoredResponse,
)
from .waiting import wait_rounds

logger = logging.getLogger("idem_middleware")

# A run that finds the key busy claims again after this long, backing off (no connection held).
_FIRST_BUSY_POLL = 0.02
_MAX_BUSY_POLL = 0.5


async def run_transactional(
    job: JobSpec, key: RecordKey, fingerprint: bytes, args: Any, kwargs: Any
) -> Any:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + job.wait_seconds
    poll = _FIRST_BUSY_POLL
    attempt = 0
    for _ in range(wait_rounds(job.wait_seconds, _MAX_BUSY_POLL)):
        try:
            return await _transaction(job, key, fingerprint, args, kwargs)
        except ClaimBusy:
            # Another run holds the key: wait with no connection held, then claim again.
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise JobInProgress(f"{job.operation}: another run holds this key") from None
            await asyncio.sleep(min(remaining, poll))
            poll = min(poll * 2, _MAX_BUSY_POLL)
            continue
        except RetryableConflict as exc:
            if attempt == job.max_serialization_retries:
                cause = exc.__cause__
                if exc.from_handler and cause is not None:
                    raise cause from cause.__cause__  # the function's error, as it raised it
                raise
        attempt += 1
        logger.debug("serialization failure; running the job's transaction again")
    raise AssertionError("unreachable")  # pragma: no cover


async def _transaction(
    job: JobSpec, key: RecordKey, fingerprint: bytes, args: Any, kwargs: Any
) -> Any:
    async with job.store.transaction(acquire_timeout=job.acquire_timeout) as tx:
        try:
            claim = await tx.claim(
                key,
                fingerprint,
                retention_seconds=job.retention_seconds,
                wait_seconds=job.wait_seconds,
            )
        except ClaimBusy:
            raise  # another run's transaction holds the key: `run_transactional` waits for it
        except ClaimTimeout:
            raise JobInProgress(f"{job.operation}: another run holds this key") from None
        if not isinstance(claim, Claimed):
            assert isinstance(claim, Existing)  # a job's key is never a token
            answer = job.answer(claim.record, fingerprint)
            if answer is UNSETTLED:
                # A lease-mode run's live claim (the job was in lease mode until a deploy):
                # never run again here (its effect may have happened elsewhere); waited for as
                # a busy key is, then JobInProgress after `wait_seconds`.
                raise ClaimBusy(f"{job.operation}: a lease-mode run holds this key")
            return answer
        context = job.context(key, claim.generation, claim.epoch, tx.connection, None)
        try:
            body = await job.run(context, args, kwargs)
        except BaseException as exc:
            await tx.abandon()  # clean up, then re-raise: the key is free again
            if tx.conflict(exc):
                raise RetryableConflict(str(exc), from_handler=True) from exc
            if isinstance(exc, Exception) and (gone := tx.lost()) is not None:
                # Its connection gone (the server ended the session, say): nothing committed,
                # and the store failed, not the function (as for a request, a StoreError).
                raise gone from exc
            raise
        state = FINAL_STATE.get(context.declared or Outcome.SUCCEEDED)
        if state is None:
            await tx.abandon()
        else:
            await tx.finish(state, StoredResponse(200, JSON_HEADERS, body))
    return orjson.loads(body)
