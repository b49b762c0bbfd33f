"""A transactional request's waits and retries, after its first attempt (`transactional.Attempt`,
awaited by the exchange itself) raised: a key another request holds is waited for, with no
connection held, then claimed again; a serialization failure runs the attempt again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

from .answers import WAITERS_FULL, Answer, InFlight, Problem
from .errors import ClaimBusy, ClaimTimeout, ProblemKind, RetryableConflict
from .store.base import RecordKey
from .transactional import RETRIED, Attempt
from .waiting import Held, wait_rounds

if TYPE_CHECKING:
    from .exchange import Exchange

logger = logging.getLogger("idem_middleware")

# A waiting duplicate claims again when the holder in this process ends, or after this long:
# quick at first, then backing off (the holder may be in another process). Every wait is bounded:
# by its polls, and a key changing hands more than `waiting.MAX_ROUNDS` times is a bug, not load.
_FIRST_POLL = 0.02
_MAX_POLL = 0.5

_CONFLICT = "A concurrent request conflicted with this one; retry it."


async def run_transactional(
    ex: Exchange, record_key: RecordKey, fingerprint: bytes, failed: Exception
) -> Answer | None:
    """After a first attempt that raised `failed` (one of `RETRIED`): wait for a busy key, run
    again after a serialization failure, and claim again after the wait. Returns what the client
    is to be told (None: the response was streamed already)."""
    policy = ex.policy
    waiters = ex.mw.waiters
    retries = policy.max_serialization_retries
    conflicts = 0
    deadline = 0.0  # (set when it first waits)
    poll = _FIRST_POLL
    # The claim is timed once per request (its first), the wait for a busy key as a whole.
    waiting: contextlib.ExitStack | None = None
    exc: Exception | None = failed
    del failed  # (kept only as `exc`, dropped once retried: see exchange.py's)
    # One of the process's waiting places (`max_waiters`): given back when the attempt after the
    # wait claims (`Attempt.run` closes `waiting`), taken again if the request waits again.
    place: Held | None = None
    try:
        for _ in range(wait_rounds(policy.wait_seconds, _MAX_POLL)):
            if exc is None:
                try:
                    return await Attempt(ex, record_key, fingerprint, waiting).run()
                except RETRIED as raised:
                    # (without its traceback, which holds this frame: kept, a cycle)
                    exc = raised.with_traceback(None)
            if isinstance(exc, ClaimBusy):
                exc = None
                now = asyncio.get_running_loop().time()
                if waiting is None:
                    waiting = contextlib.ExitStack()
                    waiting.enter_context(ex.timed("wait"))
                    deadline = now + policy.wait_seconds
                if place is None or not place.held:
                    if (place := waiters.place()) is None:
                        return Problem(
                            ProblemKind.IN_FLIGHT, WAITERS_FULL, policy.retry_after_seconds
                        )
                    waiting.callback(place.give_back)
                remaining = deadline - now
                if remaining <= 0:
                    return InFlight(fingerprint=fingerprint)
                await ex.wait_present(waiters.wait(record_key, min(remaining, poll)))
                poll = min(poll * 2, _MAX_POLL)
                continue
            if isinstance(exc, ClaimTimeout):
                return InFlight(fingerprint=fingerprint)
            assert isinstance(exc, RetryableConflict)
            if ex.started or conflicts == retries:
                cause = exc.__cause__
                if exc.from_handler and cause is not None:
                    raise cause from cause.__cause__  # the handler's error, as it raised it
                if ex.started:
                    raise exc  # the response has started: nothing more can be said to it
                return Problem(ProblemKind.IN_FLIGHT, _CONFLICT, policy.retry_after_seconds)
            exc = None
            conflicts += 1
            logger.debug("serialization failure; running the transaction again")
            ex.body_delivered = False
            ex.counted = None  # (the next attempt's claim is counted anew: see exchange's)
        raise RuntimeError("the key kept changing hands; giving up")  # pragma: no cover
    finally:
        if waiting is not None:
            waiting.close()
