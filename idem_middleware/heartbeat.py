"""Renewing a lease while its handler (a request's or a job's) runs, and knowing when it is gone.

A renewal that finds the generation gone (taken over, or marked `unknown`) ends the lease. So
does a lease that renewals could not reach the store to renew for as long as it lasts (the
database restarting, failing over, or out of connections): past its end another execution may
take the record over at any moment, so the execution stops believing it holds it. Either way
`lease_lost` is set and the renewals stop; the settlement's compare-and-set decides what is
recorded. A renewal that finds the store closed (the app's lifespan ended first) ends it at once:
no renewal can reach it again, nor any settlement.

Renewals go on while the outcome settles (its statement may wait for a pooled connection, or be
sent again after a blip, for longer than the lease), and stop once it returns. Meanwhile the
lease ends quietly (`settling`): a renewal that finds the record no longer pending may have met
that very settlement, and its compare-and-set says whether the execution still held the record.

While the execution's own fenced transaction holds the record's row lock, a renewal does not
wait for it (nor hold a second connection meanwhile) and renews nothing: the lock keeps every
takeover and expiry out, however long the lease has lapsed. If that transaction ends without a
settlement (its connection died), the next renewal renews the lease again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from .context import IdempotencyContext, key_digest
from .errors import StoreClosed
from .store.base import RecordKey
from .waiting import wait_at_most

logger = logging.getLogger("idem_middleware")


async def keep_lease(
    store: Any,
    context: IdempotencyContext,
    lease_seconds: float,
    stop: asyncio.Event,
    *,
    held_until: float,
    renew_now: bool,
    settling: Callable[[], bool] | None = None,
) -> None:
    """Renew `context`'s lease every third of `lease_seconds` until `stop` is set (first at once
    when `renew_now`, else a third of the lease after it was granted: a task that starts late,
    its loop blocked by the code it guards, renews at once). `held_until`: when, on the event
    loop's clock, the lease last granted ends at the earliest. A renewal that fails (the store
    unreachable) is tried again at the next one, or when the lease ends if that is sooner; then
    the lease is lost. `settling`: whether the execution's settlement has begun (the lease then
    ends without being lost)."""
    loop = asyncio.get_running_loop()
    interval = lease_seconds / 3
    key = RecordKey(context.tenant, context.operation, context.key)
    pause = 0.0 if renew_now else held_until - lease_seconds + interval - loop.time()
    failures = 0
    while True:
        if pause > 0:
            await wait_at_most(stop, pause)
        if stop.is_set():
            return
        sent = loop.time()
        try:
            alive = await store.heartbeat(key, context.generation, lease_seconds)
        except StoreClosed as exc:
            # (Asking again cannot help: the app's lifespan closed it, and nothing this
            # execution does can be recorded now. Its record stays pending until its lease lapses.)
            return _lost(context, stop, settling, "the store is closed", exc)
        except Exception as exc:
            failures += 1
            if loop.time() >= held_until:
                return _lost(
                    context, stop, settling, "its renewals failed for the whole lease", exc
                )
            # (One warning with the traceback per outage, not one per renewal.)
            logger.warning(
                "lease renewal failed; trying again",
                exc_info=failures == 1,
                extra=_extra(context, "renewal-failed"),
            )
            pause = max(min(interval, held_until - loop.time()), 0.0)
            continue
        if not alive:
            # (Settled while this renewal ran, maybe by this execution's own settlement.)
            return _lost(context, stop, settling, "its generation no longer holds the record")
        failures = 0
        held_until = sent + lease_seconds
        pause = interval


def _lost(
    context: IdempotencyContext,
    stop: asyncio.Event,
    settling: Callable[[], bool] | None,
    why: str,
    error: Exception | None = None,
) -> None:
    if stop.is_set() or (settling is not None and settling()):
        return  # (the settlement's compare-and-set decides, and says so)
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
