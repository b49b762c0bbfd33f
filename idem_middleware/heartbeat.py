"""Renewing a lease while its handler (a request's or a job's) runs, and knowing when it is gone.

A renewal that finds the generation gone (taken over, or marked `unknown`) ends the lease. So
does a lease that renewals could not reach the store to renew for as long as it lasts (the
database restarting, failing over, or out of connections): past its end another execution may
take the record over at any moment, so the execution stops believing it holds it. Either way
`lease_lost` is set and the renewals stop; the settlement's compare-and-set decides what is
recorded. A renewal that finds the store closed (the app's lifespan ended first) ends it at once:
no renewal can reach it again, nor any settlement.

While the execution's own fenced transaction holds the record's row lock, a renewal does not
wait for it (nor hold a second connection meanwhile) and renews nothing: the lock keeps every
takeover and expiry out, however long the lease has lapsed. If that transaction ends without a
settlement (its connection died), the next renewal renews the lease again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from .context import IdempotencyContext, key_digest
from .errors import StoreClosed
from .store.base import RecordKey

logger = logging.getLogger("idem_middleware")


async def keep_lease(
    store: Any,
    context: IdempotencyContext,
    lease_seconds: float,
    stop: asyncio.Event,
    *,
    held_until: float,
    renew_now: bool,
) -> None:
    """Renew `context`'s lease every third of `lease_seconds` until `stop` is set (first at once
    when `renew_now`). `held_until`: when, on the event loop's clock, the lease last granted
    ends at the earliest. A renewal that fails (the store unreachable) is tried again at the
    next one, or when the lease ends if that is sooner; then the lease is lost."""
    loop = asyncio.get_running_loop()
    interval = lease_seconds / 3
    key = RecordKey(context.tenant, context.operation, context.key)
    pause = 0.0 if renew_now else interval
    failures = 0
    while True:
        if pause > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), pause)
        if stop.is_set():
            return
        sent = loop.time()
        try:
            alive = await store.heartbeat(key, context.generation, lease_seconds)
        except StoreClosed as exc:
            # (Asking again cannot help: the app's lifespan closed it, and nothing this
            # execution does can be recorded now. Its record stays pending until its lease lapses.)
            return _lost(context, stop, "the store is closed", exc)
        except Exception as exc:
            failures += 1
            if loop.time() >= held_until:
                return _lost(context, stop, "its renewals failed for the whole lease", exc)
            # (One warning with the traceback per outage, not one per renewal.)
            logger.warning(
                "lease renewal failed; trying again",
                exc_info=failures == 1,
                extra=_extra(context, "renewal-failed"),
            )
            pause = max(min(interval, held_until - loop.time()), 0.0)
            continue
        if not alive:
            if not stop.is_set():  # (settled while this renewal ran)
                _lost(context, stop, "its generation no longer holds the record")
            return
        failures = 0
        held_until = sent + lease_seconds
        pause = interval


def _lost(
    context: IdempotencyContext, stop: asyncio.Event, why: str, error: Exception | None = None
) -> None:
    if stop.is_set():
        return
    context.lease_lost.set()
    logger.warning(
        "lease lost: %s; this execution no longer holds its claim%s",
        why,
        "" if error is None else f" (last error: {error!r})",
        extra=_extra(context, "lease-lost"),
    )


def _extra(context: IdempotencyContext, outcome: str) -> dict[str, object]:
    """A renewal's log fields: never the raw key."""
    return {
        "tenant": context.tenant,
        "operation": context.operation,
        "key_digest": key_digest(context.key),
        "generation": context.generation,
        "outcome": outcome,
    }
