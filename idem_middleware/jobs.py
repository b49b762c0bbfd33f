"""Idempotency outside HTTP: background jobs and queue consumers.

The same store, key space `(tenant, operation, key)` and state machine as the middleware, around
an async function instead of a request. A repeat with the same key gets the stored JSON result
and the function does not run again (Powertools' `idempotent_function`, on PostgreSQL):

    @idempotent_job(store, operation="invoices.send", key="invoice_id")
    async def send_invoice(job: IdempotencyContext, invoice_id: str) -> dict[str, Any]:
        await job.connection.execute("INSERT ...")  # transactional mode: the claim's connection
        return {"sent": invoice_id}

    await send_invoice(invoice_id="inv-1")  # runs; again: {"sent": "inv-1"} from the record

The function's first parameter receives the IdempotencyContext (the claim's `connection` in
transactional mode, `await job.fenced_connection()` in lease mode); the context is also the
task's current one, so `idem_middleware.sqla.open_claim_session()` works inside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import orjson

from .context import (
    IdempotencyContext,
    Outcome,
    enter_context,
    key_digest,
    leave_context,
)
from .errors import ConfigurationError, StaleGeneration
from .errors import JobInProgress as JobInProgress
from .errors import JobKeyReused as JobKeyReused
from .errors import JobOutcomeUnknown as JobOutcomeUnknown
from .fence import Fence
from .keys import MAX_KEY_LENGTH
from .policy import LeaseExpiry, Mode
from .store.base import (
    ClaimBusy,
    ClaimTimeout,
    Record,
    RecordKey,
    RetryableConflict,
    Settlement,
    State,
    Store,
    StoredResponse,
)

__all__ = [
    "JobInProgress",
    "JobKeyReused",
    "JobOutcomeUnknown",
    "idempotent_job",
]

logger = logging.getLogger("idem_middleware")

_RETRYABLE_SQLSTATES = frozenset({"40001", "40P01"})
_JSON_HEADERS = ((b"content-type", b"application/json"),)
_STORED = {Outcome.SUCCEEDED: State.SUCCEEDED, Outcome.FAILED_FINAL: State.FAILED_FINAL}
_MAX_ROUNDS = 10_000
# A run that finds the key busy claims again after this long, backing off (no connection held).
_FIRST_BUSY_POLL = 0.02
_MAX_BUSY_POLL = 0.5
R = TypeVar("R")


KeyOf = Callable[..., str]


def _fingerprint(operation: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    try:
        payload = orjson.dumps([args, kwargs], option=orjson.OPT_SORT_KEYS)
    except TypeError as exc:
        raise ConfigurationError(
            f"{operation}: the job's arguments must be JSON-serialisable to be fingerprinted"
        ) from exc
    return hashlib.sha256(operation.encode() + b"\x00" + payload).digest()


def _key_function(key: str | KeyOf) -> KeyOf:
    if callable(key):
        return key
    name = key

    def by_name(*args: Any, **kwargs: Any) -> str:
        if name not in kwargs:
            raise TypeError(f"pass the idempotency key argument {name!r} by keyword")
        return str(kwargs[name])

    return by_name


class _Job:
    """One decorated function and its settings (immutable after the decorator ran)."""

    def __init__(
        self,
        fn: Callable[..., Awaitable[Any]],
        store: Store,
        *,
        operation: str,
        key: str | KeyOf,
        tenant: str | KeyOf,
        mode: Mode,
        retention_seconds: float,
        wait_seconds: float,
        lease_seconds: float,
        on_lease_expiry: LeaseExpiry,
        acquire_timeout: float,
        max_serialization_retries: int,
    ) -> None:
        self.fn = fn
        self.store = store
        self.operation = operation
        self.key_of = _key_function(key)
        self.tenant_of: KeyOf = tenant if callable(tenant) else (lambda *a, **k: tenant)
        self.mode = mode
        self.retention_seconds = retention_seconds
        self.wait_seconds = wait_seconds
        self.lease_seconds = lease_seconds
        self.on_lease_expiry = on_lease_expiry
        self.acquire_timeout = acquire_timeout
        self.max_serialization_retries = max_serialization_retries

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        key = self.key_of(*args, **kwargs)
        if not isinstance(key, str) or not 0 < len(key) <= MAX_KEY_LENGTH:
            raise ValueError(f"an idempotency key is 1 to {MAX_KEY_LENGTH} characters: {key!r}")
        record_key = RecordKey(str(self.tenant_of(*args, **kwargs)), self.operation, key)
        fingerprint = _fingerprint(self.operation, args, kwargs)
        if self.mode is Mode.TRANSACTIONAL:
            return await self._transactional(record_key, fingerprint, args, kwargs)
        return await self._lease(record_key, fingerprint, args, kwargs)

    def _context(
        self, key: RecordKey, generation: int, epoch: int | None, connection: Any, fence: Any
    ) -> Any:
        return IdempotencyContext(
            tenant=key.tenant,
            operation=key.operation,
            key=key.key,
            generation=generation,
            mode=self.mode,
            connection=connection,
            epoch=epoch,
            _fence=fence,
        )

    async def _run(self, context: IdempotencyContext, args: Any, kwargs: Any) -> bytes:
        scope: dict[str, Any] = {}
        token = enter_context(scope, context)
        try:
            result = await self.fn(context, *args, **kwargs)
        finally:
            leave_context(scope, token)
        try:
            return orjson.dumps(result)
        except TypeError as exc:
            raise ConfigurationError(
                f"{self.operation}: a job's result is stored as JSON; {type(result)!r} is not"
            ) from exc

    def _answer(self, record: Record, fingerprint: bytes) -> Any:
        """What a repeat gets from a record it cannot claim (None: wait and look again)."""
        if record.fingerprint != fingerprint:
            raise JobKeyReused(f"{self.operation}: this key was used with different arguments")
        if record.state in (State.SUCCEEDED, State.FAILED_FINAL) and record.response is not None:
            return orjson.loads(record.response.body)
        if record.state is State.UNKNOWN:
            raise JobOutcomeUnknown(
                f"{self.operation}: an earlier run's outcome is unknown; resolve it first"
            )
        return None

    # -- transactional mode: claim, function and outcome in one transaction ----------------------

    async def _transactional(
        self, key: RecordKey, fingerprint: bytes, args: Any, kwargs: Any
    ) -> Any:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_seconds
        poll = _FIRST_BUSY_POLL
        attempt = 0
        for _ in range(_MAX_ROUNDS):
            try:
                return await self._transaction(key, fingerprint, args, kwargs)
            except ClaimBusy:
                # Another run holds the key: wait with no connection held, then claim again.
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise JobInProgress(f"{self.operation}: another run holds this key") from None
                await asyncio.sleep(min(remaining, poll))
                poll = min(poll * 2, _MAX_BUSY_POLL)
                continue
            except RetryableConflict:
                if attempt == self.max_serialization_retries:
                    raise
            except BaseException as exc:
                sqlstate = getattr(exc, "sqlstate", None)
                if (
                    sqlstate not in _RETRYABLE_SQLSTATES
                    or attempt == self.max_serialization_retries
                ):
                    raise
            attempt += 1
            logger.debug("serialization failure; running the job's transaction again")
        raise AssertionError("unreachable")  # pragma: no cover

    async def _transaction(self, key: RecordKey, fingerprint: bytes, args: Any, kwargs: Any) -> Any:
        async with self.store.transaction(acquire_timeout=self.acquire_timeout, begin=False) as tx:
            try:
                claim = await tx.claim(
                    key,
                    fingerprint,
                    retention_seconds=self.retention_seconds,
                    wait_seconds=self.wait_seconds,
                )
            except ClaimTimeout:
                await tx.rollback()
                raise JobInProgress(f"{self.operation}: another run holds this key") from None
            if not claim.claimed:
                await tx.rollback()
                assert claim.record is not None
                answer = self._answer(claim.record, fingerprint)
                if answer is None:  # pragma: no cover - a committed transactional record is final
                    raise JobInProgress(f"{self.operation}: another run holds this key")
                return answer
            epoch = claim.generation if claim.epoch is None else claim.epoch
            context = self._context(key, claim.generation, epoch, tx.connection, None)
            try:
                body = await self._run(context, args, kwargs)
            except BaseException:
                await tx.rollback()  # clean up, then re-raise: the key is free again
                raise
            state = _STORED.get(context.declared or Outcome.SUCCEEDED)
            if state is None:
                await tx.rollback()
            else:
                await tx.complete_and_commit(
                    key, claim.generation, state, StoredResponse(200, _JSON_HEADERS, body)
                )
        return orjson.loads(body)

    # -- lease mode: the claim commits first; the outcome is a compare-and-set -------------------

    async def _lease(self, key: RecordKey, fingerprint: bytes, args: Any, kwargs: Any) -> Any:
        store = self.store
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_seconds
        async with store.watch(key) as watch:
            record: Record | None = None
            for _ in range(_MAX_ROUNDS):
                if record is None or record.expired:
                    claim = await store.claim_lease(
                        key,
                        fingerprint,
                        retention_seconds=self.retention_seconds,
                        lease_seconds=self.lease_seconds,
                    )
                    if claim.claimed:
                        return await self._execute(key, claim.generation, claim.epoch, args, kwargs)
                    record = claim.record
                    assert record is not None
                answer = self._answer(record, fingerprint)
                if answer is not None:
                    return answer
                if record.retry_allowed or (
                    record.lease_expired and self.on_lease_expiry is LeaseExpiry.TAKEOVER
                ):
                    generation = await store.takeover(
                        key, record.generation, State.PENDING, self.lease_seconds
                    )
                    if generation is not None:
                        return await self._execute(key, generation, record.epoch, args, kwargs)
                elif record.lease_expired:
                    await store.expire_lease(key, record.generation)
                else:
                    remaining = deadline - loop.time()
                    if remaining <= 0:
                        raise JobInProgress(f"{self.operation}: another run holds this key")
                    await watch.wait(min(remaining, 0.5))
                record = await store.get(key)
        raise RuntimeError("the record kept changing; giving up")  # pragma: no cover

    async def _execute(
        self, key: RecordKey, generation: int, epoch: int | None, args: Any, kwargs: Any
    ) -> Any:
        store = self.store
        fence = Fence(store, key, generation, State.PENDING)
        context = self._context(key, generation, epoch, None, fence.connection)
        stop = asyncio.Event()
        heartbeat = asyncio.get_running_loop().create_task(self._heartbeat(context, stop))
        try:
            try:
                body = await self._run(context, args, kwargs)
            except StaleGeneration:
                await fence.close()
                raise
            except BaseException:
                # Whatever the function did outside the database may have happened: unknown,
                # unless it declared that it did nothing.
                await fence.close()
                if context.declared is Outcome.RELEASE:
                    await store.release(key, generation)
                else:
                    await store.settle(key, generation, State.PENDING, Settlement(State.UNKNOWN))
                raise
            stop.set()
            outcome = context.declared or Outcome.SUCCEEDED
            state = _STORED.get(outcome)
            if state is not None:
                settled = await fence.settle(
                    Settlement(state, StoredResponse(200, _JSON_HEADERS, body))
                )
            else:
                await fence.close()
                if outcome is Outcome.RELEASE:
                    settled = await store.release(key, generation)
                else:
                    settled = await store.settle(
                        key, generation, State.PENDING, Settlement(State.UNKNOWN)
                    )
        finally:
            stop.set()
            await heartbeat  # stopped by the event, never cancelled mid-write
        if not settled:
            raise StaleGeneration(
                f"{self.operation}: generation {generation} lost its claim; nothing was recorded"
            )
        return orjson.loads(body)

    async def _heartbeat(self, context: IdempotencyContext, stop: asyncio.Event) -> None:
        interval = self.lease_seconds / 3
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)
            if stop.is_set():
                return
            try:
                alive = await self.store.heartbeat(
                    RecordKey(context.tenant, context.operation, context.key),
                    context.generation,
                    self.lease_seconds,
                )
            except Exception:
                logger.warning("job heartbeat failed", exc_info=True)
                continue
            if not alive:
                context.lease_lost.set()
                logger.warning(
                    "job lease lost",
                    extra={"operation": context.operation, "key_digest": key_digest(context.key)},
                )
                return


def idempotent_job(
    store: Store,
    *,
    operation: str,
    key: str | KeyOf,
    tenant: str | KeyOf = "",
    mode: Mode = Mode.TRANSACTIONAL,
    retention_seconds: float = 24 * 3600.0,
    wait_seconds: float = 5.0,
    lease_seconds: float = 30.0,
    on_lease_expiry: LeaseExpiry = LeaseExpiry.UNKNOWN,
    acquire_timeout: float = 10.0,
    max_serialization_retries: int = 3,
) -> Callable[[Callable[..., Awaitable[R]]], Callable[..., Awaitable[Any]]]:
    """Make an async function idempotent by key (see the module's docstring).

    `key`: the name of a keyword argument holding the key, or a function of the call's arguments.
    `tenant`: a fixed tenant or a function of the arguments (a queue message's account, say).
    The arguments (as JSON) are the fingerprint: the same key with other arguments raises
    JobKeyReused. The result must be JSON-serialisable; every call, first or repeat, returns it as
    decoded JSON.
    """
    if not operation:
        raise ConfigurationError("a job needs an operation name")
    if mode is Mode.LEASE and lease_seconds <= 0:
        raise ConfigurationError("lease_seconds must be positive")

    def decorate(fn: Callable[..., Awaitable[R]]) -> Callable[..., Awaitable[Any]]:
        job = _Job(
            fn,
            store,
            operation=operation,
            key=key,
            tenant=tenant,
            mode=mode,
            retention_seconds=retention_seconds,
            wait_seconds=wait_seconds,
            lease_seconds=lease_seconds,
            on_lease_expiry=on_lease_expiry,
            acquire_timeout=acquire_timeout,
            max_serialization_retries=max_serialization_retries,
        )

        @functools.wraps(fn)
        async def run(*args: Any, **kwargs: Any) -> Any:
            return await job(*args, **kwargs)

        return run

    return decorate
