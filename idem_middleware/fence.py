"""Fenced transitions of a record: an executor's fenced transaction, and a reconciler's run."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from .context import derive_downstream_key, key_digest, outcome_for_status
from .errors import FenceRollback, StaleGeneration
from .policy import Mode
from .reconcile import Happened, NotHappened, ReconcileContext, Reconciler, StillUnknown
from .store.base import RecordKey, Settlement, State, Store, StoredResponse

logger = logging.getLogger("idem_middleware")


class Fence:
    """The fenced transaction of one execution or reconciliation, opened on first use."""

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

    async def connection(self) -> Any:
        if self._session is None:
            fenced = self.store.fenced(self.key, self.generation, self.expected)
            self._session = await fenced.__aenter__()
            self._fenced = fenced  # (only once entered: `close` leaves what was entered)
        return self._session.connection

    async def settle(self, settlement: Settlement) -> bool:
        """Record the outcome: inside the fenced transaction if one is open, then commit."""
        if self._session is None:
            return await self.store.settle(self.key, self.generation, self.expected, settlement)
        try:
            settled: bool = await self._session.settle(settlement)
        except BaseException:
            # Never leave the transaction open: it holds the record's row lock (every later
            # request on the key would wait on it) and a pooled connection.
            await self.close()
            raise
        await self.close(commit=settled)
        return settled

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
    #: The reconciler raised or ran out of time.
    FAILED = "failed"
    #: The record moved on meanwhile (someone else resolved it).
    CHANGED = "changed"


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
) -> ReconcileResult:
    """Run one reconciler, bounded by `seconds`, on an unknown record under `generation`.

    `epoch` is the record's (`Record.epoch`): the reconciler asks about the downstream key the
    executors of this life of the record sent.

    A `Happened` answer is settled in the reconciler's fenced transaction, together with any
    writes it made there. `NotHappened` changes nothing: the caller takes the record over.
    """
    fence = Fence(store, key, generation, State.UNKNOWN)
    context = ReconcileContext(
        tenant=key.tenant,
        operation=key.operation,
        key=key.key,
        downstream_key=derive_downstream_key(key.tenant, key.operation, key.key, epoch),
        generation=generation,
        _fence=fence.connection,
    )
    log = {"operation": key.operation, "key_digest": key_digest(key.key), "generation": generation}
    try:
        async with asyncio.timeout(seconds):
            result = await reconciler(context)
    except StaleGeneration:
        await fence.close()
        return ReconcileResult(Verdict.CHANGED)
    except Exception:
        await fence.close()
        logger.warning("reconciler failed", extra=log, exc_info=True)
        return ReconcileResult(Verdict.FAILED, "Asking the downstream system failed; retry later.")
    except BaseException:
        await fence.close()
        raise
    if isinstance(result, StillUnknown):
        await fence.close()
        return ReconcileResult(
            Verdict.STILL_UNKNOWN, result.reason or "The downstream system cannot tell yet."
        )
    if isinstance(result, NotHappened):
        await fence.close()
        return ReconcileResult(Verdict.NOT_HAPPENED)
    if not isinstance(result, Happened):
        await fence.close()
        raise TypeError(f"a reconciler returned {result!r}")
    state = {"succeeded": State.SUCCEEDED, "failed_final": State.FAILED_FINAL}.get(
        outcome_for_status(result.status, Mode.LEASE).value
    )
    if state is None:
        await fence.close()
        raise ValueError(f"a reconciler cannot answer Happened({result.status})")
    stored = StoredResponse(result.status, list(result.headers), result.body)
    if not await fence.settle(Settlement(state, stored, note="reconciled")):
        return ReconcileResult(Verdict.CHANGED)
    logger.info("reconciled as happened", extra={**log, "outcome": state.value})
    return ReconcileResult(Verdict.SETTLED)
