"""A lease-mode settlement that failed on a blip (its connection lost, the server restarting or
out of connections), sent again, so the client gets the outcome its handler produced rather
than a 503 and a record left `unknown` (or `pending` until its lease lapses).

Only a settlement that is a compare-and-set of its own: when the handler opened no fenced
transaction, or a release or an `unknown` (sent once that transaction rolled back). A final
outcome sent in the fenced transaction is not: its failed COMMIT rolled the handler's writes
back, and what the compare-and-set would record is no longer what happened. Marking a record
`unknown` (the handler raised, or its settlement failed) is sent again the same way
(`unresolve`): left `pending`, every retry was told "in flight" until the lease lapsed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from anyio import CancelScope

from .context import IdempotencyContext
from .errors import StoreError, blip
from .observe import SETTLED_EVENTS, Event
from .outcomes import FINAL_STATE, Outcome, outcome_for_status, settlement_for
from .policy import Mode
from .store.base import FINAL_STATES, RecordKey, Settlement, State, Store, StoredResponse

if TYPE_CHECKING:
    from .capture import ResponseCapture
    from .fence import Fence
    from .lease_executor import LeaseExecution

logger = logging.getLogger("idem_middleware")

_FIRST_PAUSE = 0.05
_MAX_PAUSE = 1.0
#: However short the time allowed, the settlement is sent again at least this many times.
_MIN_ATTEMPTS = 2


#: How often a cleanup run `to_the_end` is started again where its own task's cancellation cut
#: it short (`asyncio.run` cancels every task left at its exit once), and how many cancellations
#: of its caller it outlasts (each takes an await: bounded, as every loop is).
_RESTARTS = 5
_MAX_CANCELLATIONS = 100

#: One step of a cleanup: called to start it (again, if a cancellation cut it short).
Step = Callable[[], Awaitable[Any]]


async def to_the_end(*steps: Step) -> Any:
    """Run a cleanup that must finish (a fenced transaction's rollback, then an `unknown` mark:
    each bounded, and each safe to start again) to its end, its steps in turn in a task of
    their own, even if this task is cancelled again meanwhile; then that cancellation goes on
    (over a step's error, which is chained to it). Shielded from anyio's cancel scopes too
    (BaseHTTPMiddleware's, at a shutdown, cancels every await until the task ends). The
    shield alone keeps out anyio's cancellations, not a second `task.cancel()` (an outer
    `asyncio.timeout`, `asyncio.run` cancelling every task left at its exit, the cleanup's own
    too, even before it started: its step then starts again): that cut the mark short, and the
    record stayed `pending`, taken over (`TAKEOVER`) and run again once its lease lapsed.
    Returns what the last step returned; past its bounds, the cancellation goes on with steps
    not run."""
    with CancelScope(shield=True):
        return await _to_the_end(steps)


async def _to_the_end(steps: tuple[Step, ...]) -> Any:
    progress: list[Any] = [0, None]  # the next step; the last one's answer
    cancelled: asyncio.CancelledError | None = None
    for _ in range(_RESTARTS):
        task = asyncio.ensure_future(_in_turn(steps, progress))
        for _ in range(_MAX_CANCELLATIONS):
            if task.done():
                break
            try:
                await asyncio.wait((task,))  # (cancelling the wait never cancels the task)
            except asyncio.CancelledError as exc:
                cancelled = exc
        if not task.done():
            task.cancel()  # (past the bound: given up)
            break
        if task.cancelled():
            continue  # its own task cancelled: started again where it stopped
        if (error := task.exception()) is not None:
            if isinstance(error, _StepCancelled):  # (a step's own: `unresolve_after`'s, say)
                raise error.cancelled
            if cancelled is not None:
                raise cancelled from error
            raise error
        break
    if cancelled is not None:
        raise cancelled
    if progress[0] < len(steps):
        raise asyncio.CancelledError("the cleanup was cancelled past its bound")
    return progress[1]


class _StepCancelled(Exception):
    """A step ended with a CancelledError of its own (not its task's cancellation: that
    starts it again), which `to_the_end` raises as it came."""

    def __init__(self, cancelled: asyncio.CancelledError) -> None:
        super().__init__()
        self.cancelled = cancelled


async def _in_turn(steps: tuple[Step, ...], progress: list[Any]) -> None:
    while progress[0] < len(steps):
        try:
            progress[1] = await steps[progress[0]]()
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # this task's own cancellation: started again where it stopped
            raise _StepCancelled(exc) from None
        progress[0] += 1


async def settle_again(
    execution: LeaseExecution,
    context: IdempotencyContext,
    capture: ResponseCapture,
    error: StoreError,
) -> bool:
    """The execution's settlement failed with `error`: sent again for up to a third of the lease
    (at least that much of it is left when settling starts, since renewals come every third;
    past it the compare-and-set still decides). True once recorded, False if the generation no
    longer holds the record (answered as a stale executor). If the store stays out of reach,
    the record is marked `unknown` if it can be, and the last error stands (a 503)."""
    try:
        return await _resend(execution, context, capture, error, None)
    except Exception:
        await execution._unresolved(context, seconds=0.0)  # (out of reach all along)
        raise


async def cut_short(
    execution: LeaseExecution, context: IdempotencyContext, fence: Fence, capture: ResponseCapture
) -> bool:
    """Record the outcome of a response its client's leaving cut short (the executor's `run`):
    its status, the body omitted, sent again on a blip as a stream's early settlement is."""
    try:
        return await execution._settle(context, fence, capture, omitted="streaming")
    except Exception as exc:
        try:
            return await settle_early_again(execution, context, capture, "streaming", exc)
        except Exception:
            await execution._unresolved(context)
            raise


async def settle_early_again(
    execution: LeaseExecution,
    context: IdempotencyContext,
    capture: ResponseCapture,
    omitted: str,
    error: Exception,
) -> bool:
    """The early settlement of a response that cannot be held (`omitted` says why) failed with
    `error`, before the first byte: on a blip, sent again as `settle_again` does when it was a
    compare-and-set; sent in the fenced transaction, the record is read in case its COMMIT
    landed after all (`committed_after_all`). Otherwise, or if the store stays out of reach, `error`
    is raised: it reaches the handler through its `send`, and the execution marks the record
    `unknown` as when a handler raises (its client gets a 503)."""
    if not blip(error):
        raise error
    fence = execution.fence
    if fence is not None and fence.committing:
        if await committed_after_all(execution, context, capture, omitted):
            return True
        raise error
    return await _resend(execution, context, capture, error, omitted)


async def _resend(
    execution: LeaseExecution,
    context: IdempotencyContext,
    capture: ResponseCapture,
    error: StoreError,
    omitted: str | None,
) -> bool:
    outcome = context.declared or outcome_for_status(capture.status, Mode.LEASE)
    settlement = settlement_for(outcome, lambda: capture.stored(omitted))
    key, generation, fence = execution.key, execution.generation, execution.fence
    settled = await send_again(
        execution.store,
        key,
        generation,
        settlement,
        seconds=execution.policy.lease_seconds / 3,
        error=error,
        over_unknown=fence is not None and fence.over_unknown,
    )
    from .lease_executor import log_extra  # (it imports this module)

    extra = log_extra(key, generation, "settled-again" if settled else "stale")
    if settled:
        logger.info("a settlement that failed on a blip was recorded on a later try", extra=extra)
        execution.ex.emit(SETTLED_EVENTS[outcome], generation)
    else:
        logger.warning("a stale executor's completion was refused", extra=extra)
    return settled


async def committed_after_all(
    execution: LeaseExecution,
    context: IdempotencyContext,
    capture: ResponseCapture,
    omitted: str | None = None,
) -> bool:
    """A fenced settlement failed on a blip and the record was then marked `unknown` if it was
    still pending: whether its COMMIT landed after all (the connection lost after the server
    committed, before it answered). The record then holds this generation in the state and with
    the response the settlement sent, and the client gets its outcome, not a 503. (A reconciler
    settles under the same generation, after an `unknown`: its outcome is the record's, and a
    response other than this one is not this settlement's.)"""
    outcome = context.declared or outcome_for_status(capture.status, Mode.LEASE)
    state = FINAL_STATE.get(outcome)
    generation = execution.generation
    if state is None or not await landed(
        execution.store, execution.key, generation, state, capture.stored(omitted)
    ):
        return False
    execution.ex.emit(SETTLED_EVENTS[outcome], generation)
    return True


async def landed(
    store: Store, key: RecordKey, generation: int, state: State, response: StoredResponse | None
) -> bool:
    """Whether the record holds `generation` in `state` with `response`: read after a fenced
    settlement failed on a blip and the record was marked `unknown` if still pending, it says
    the settlement's COMMIT landed after all (see `committed_after_all`; logged then). False if
    it cannot be read."""
    try:
        record = await store.get(key)
    except StoreError:
        return False
    if record is None or record.generation != generation or record.state is not state:
        return False
    if not same_response(record.response, response):
        return False
    from .lease_executor import log_extra  # (it imports this module)

    logger.info(
        "a fenced settlement whose answer was lost had committed",
        extra=log_extra(key, generation, "settled-again"),
    )
    return True


async def unresolve(
    store: Store,
    key: RecordKey,
    generation: int,
    context: IdempotencyContext,
    *,
    seconds: float,
) -> tuple[bool, Event]:
    """Mark the pending record `unknown` (or release it, if the handler declared it did
    nothing): whether it moved, and the event that says so. On a blip, sent again for up to
    `seconds` (`send_again`); raises the last error if the store stayed out of reach, or the
    database refused the statement."""
    if context.declared is Outcome.RELEASE:
        settlement, event = None, Event.RELEASED
    else:
        settlement, event = Settlement(State.UNKNOWN), Event.UNRESOLVED
    try:
        if settlement is None:
            return await store.release(key, generation), event
        return await store.settle(key, generation, State.PENDING, settlement), event
    except StoreError as exc:
        if seconds <= 0 or not blip(exc):
            raise
        error = exc
    return await send_again(store, key, generation, settlement, seconds=seconds, error=error), event


async def unresolve_after(
    error: BaseException,
    store: Store,
    key: RecordKey,
    generation: int,
    context: IdempotencyContext,
    *,
    seconds: float,
) -> tuple[bool, Event]:
    """`unresolve`, for an execution that raised `error`. When `error` is a cancellation (a
    server's shutdown, a timeout around the app) and the mark fails, the cancellation goes on:
    a StoreError in its place made the cancelled task end as if it had not been (a request
    answered 503 instead), against every `asyncio.timeout` or task group around it. The record
    stays `pending` until its lease lapses, and a warning says so."""
    try:
        return await unresolve(store, key, generation, context, seconds=seconds)
    except Exception:
        if isinstance(error, Exception):
            raise
        from .lease_executor import log_extra  # (it imports this module)

        logger.warning(
            "a cancelled execution could not mark its record unknown; it stays pending until "
            "its lease lapses",
            exc_info=True,
            extra=log_extra(key, generation, "unsettled"),
        )
        raise error from None


async def send_again(
    store: Store,
    key: RecordKey,
    generation: int,
    settlement: Settlement | None,
    *,
    seconds: float,
    error: StoreError,
    over_unknown: bool = False,
) -> bool:
    """Send a settlement of a pending record that failed with `error` again, with backoff and
    no connection held between attempts, for up to `seconds` (and at least twice): True once
    it is recorded, False if the generation no longer holds the record. `settlement` None is a
    release. Raises the last error if the store could not be reached all along. `over_unknown`:
    a final outcome may be recorded over `unknown` under the generation (`Fence.over_unknown`).

    An attempt that failed may have committed (the connection lost after the server committed,
    before it answered): a later attempt then finds no pending record, and the record itself
    says whether the settlement was this one."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    pause = _FIRST_PAUSE
    for attempt in range(1_000):  # (bounded by the deadline long before)
        remaining = deadline - loop.time()
        if attempt >= _MIN_ATTEMPTS and remaining <= 0:
            break
        await asyncio.sleep(min(pause, max(remaining, 0.0)))
        pause = min(pause * 2, _MAX_PAUSE)
        try:
            if settlement is None:
                done = await store.release(key, generation)
            else:
                done = await store.settle(key, generation, State.PENDING, settlement)
            if done:
                return True
            record = await store.get(key)
            if (
                over_unknown
                and settlement is not None
                and settlement.state in FINAL_STATES
                and record is not None
                and (record.state, record.generation) == (State.UNKNOWN, generation)
            ):
                # Marked `unknown` under this generation meanwhile (a duplicate found its lease
                # lapsed), as `Fence.settle` records it then. (A reconciler's, first, stands.)
                if await store.settle(key, generation, State.UNKNOWN, settlement):
                    return True
                record = await store.get(key)
        except StoreError as exc:
            if not blip(exc):
                raise
            error = exc
            continue
        if settlement is None:
            return record is None  # (a record claimed since is answered as a stale one)
        return (
            record is not None
            and record.generation == generation
            and record.state is settlement.state
            and same_response(record.response, settlement.response)
        )
    raise error


def same_response(stored: StoredResponse | None, sent: StoredResponse | None) -> bool:
    """Whether a record's response is the one a settlement sent (headers compared as pairs,
    whatever sequences hold them): a reconciler that settled the same generation meanwhile
    stored its own."""
    if stored is None or sent is None:
        return stored is sent
    return (stored.status, stored.body, stored.body_omitted) == (
        sent.status,
        sent.body,
        sent.body_omitted,
    ) and [tuple(pair) for pair in stored.headers] == [tuple(pair) for pair in sent.headers]
