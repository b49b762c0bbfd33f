"""One decorated job's settings, and what a run does in either mode: build the job's context,
run the function inside it, and judge a record the run could not claim."""

from __future__ import annotations

import functools
import inspect
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson

from .answers import Replay
from .context import IdempotencyContext, claimed_context, enter_context, leave_context
from .errors import ConfigurationError, JobKeyReused, JobOutcomeUnknown
from .jsonvalues import non_finite
from .outcomes import settled_answer
from .policy import LeaseExpiry, Mode
from .store.base import Record, RecordKey, State, Store
from .tenant import MAX_TENANT_BYTES, storable_tenant

JSON_HEADERS = ((b"content-type", b"application/json"),)

#: `JobSpec.answer` for a record not settled yet. (Not None: a job that returned None stored
#: `null`, and a repeat's answer is that None.)
UNSETTLED: Any = object()

#: A function of a job's arguments naming its key or tenant: a str, an int (its digits) or a UUID.
KeyOf = Callable[..., str | int | uuid.UUID]


#: What a run calls on its store, in either mode (a PostgresStore's and a MemoryStore's methods).
_STORE_METHODS = ("transaction", "claim_lease", "watch", "get", "takeover", "expire_lease")


def check_settings(store: Any, operation: str, key: Any, tenant: Any) -> None:
    """What the decorator can tell would fail every call, told when decorated
    (ConfigurationError): an asyncpg connection (it has a `transaction` method) or a store's
    class, taken as a store, failed each call with a TypeError or an AttributeError naming
    neither; an async key or tenant function each call with "not coroutine" (and a "never
    awaited" warning); a fixed tenant no store can key each call with a ValueError."""
    if isinstance(store, type) or not all(
        callable(getattr(store, name, None)) for name in _STORE_METHODS
    ):
        raise ConfigurationError(
            f"a job's store is a PostgresStore or MemoryStore instance, not {store!r:.100}"
        )
    for name, value in (("key", key), ("tenant", tenant)):
        if callable(value) and _async(value):
            raise not_plain(operation, name)
    if isinstance(tenant, str) and not storable_tenant(tenant):
        raise ConfigurationError(
            f"{operation}: tenant= holds a NUL character or an unpaired surrogate, or is over "
            f"{MAX_TENANT_BYTES} bytes of UTF-8 (the record's primary key holds it)"
        )


def _async(function: Any) -> bool:
    """An `async def` function (through partials, or as an object's `__call__`)."""
    while isinstance(function, functools.partial):
        function = function.func
    if not (inspect.isfunction(function) or inspect.ismethod(function)):
        function = inspect.getattr_static(type(function), "__call__", None)
    return inspect.iscoroutinefunction(function) or inspect.isasyncgenfunction(function)


def not_plain(operation: str, name: str, answer: Any = None) -> ConfigurationError:
    """The error for a key or tenant function that answers an awaitable (`answer`, closed if it
    is a coroutine: it is never awaited)."""
    if inspect.iscoroutine(answer):
        answer.close()
    return ConfigurationError(
        f"{operation}: {name}= is a plain function of the call's arguments (`def`, not "
        "`async def`): its answer is the key or tenant itself, never awaited"
    )


class JobResultUnreadable(JobOutcomeUnknown):
    """The key's record was settled (by hand: `idem-middleware resolve`, `ops.resolve`) with a
    body that is not JSON, so no result can be returned from it. Like an unknown outcome, it
    waits for an operator: resolve it again with a JSON body."""


@dataclass(frozen=True, slots=True, kw_only=True)
class JobSpec:
    """One decorated function and its settings (immutable after the decorator ran)."""

    fn: Callable[..., Awaitable[Any]]
    store: Store
    operation: str
    key_of: KeyOf
    tenant_of: KeyOf
    mode: Mode
    retention_seconds: float
    wait_seconds: float
    lease_seconds: float
    on_lease_expiry: LeaseExpiry
    acquire_timeout: float
    max_serialization_retries: int
    #: The function's parameters, the context's first (None: it has no signature to read).
    signature: inspect.Signature | None

    def check_arguments(self, args: Any, kwargs: Any) -> None:
        """Raise the TypeError a call with these arguments would, before anything is claimed:
        once the claim is made, a call that never ran the function was `unknown` (lease mode)."""
        if self.signature is None:
            return
        try:
            self.signature.bind(None, *args, **kwargs)  # (None: the context's place)
        except TypeError as exc:
            raise TypeError(f"{self.operation}: {exc}") from None

    def context(
        self, key: RecordKey, generation: int, epoch: int | None, connection: Any, fence: Any
    ) -> Any:
        return claimed_context(
            key.tenant, key.operation, key.key, generation, self.mode, connection, epoch, fence
        )

    async def run(self, context: IdempotencyContext, args: Any, kwargs: Any) -> bytes:
        scope: dict[str, Any] = {}
        token = enter_context(scope, context)
        try:
            result = await self.fn(context, *args, **kwargs)
        finally:
            leave_context(scope, token, context)
        try:
            body = orjson.dumps(result)
        except TypeError as exc:
            raise ConfigurationError(
                f"{self.operation}: a job's result is stored as JSON; {type(result)!r} is not"
            ) from exc
        # orjson writes NaN and the infinities as null: the result returned would not be the
        # one stored (refused, as in the arguments).
        if b"null" in body and non_finite(result):
            raise ConfigurationError(
                f"{self.operation}: a job's result holds NaN or an infinity, which JSON stores "
                "as null: return them as strings"
            )
        return body

    def answer(self, record: Record, fingerprint: bytes) -> Any:
        """What a repeat gets from a record it cannot claim (UNSETTLED: wait and look again):
        the same rules as an HTTP duplicate's (outcomes.settled_answer), as values or errors."""
        settled = settled_answer(record, fingerprint, http=False)  # (a job reads the body)
        if isinstance(settled, Replay):
            body = settled.response.body
            if not body:
                return None  # settled by hand with no body (a 204, say): the job returns None
            try:
                return orjson.loads(body)
            except orjson.JSONDecodeError:
                # Settled by hand with a body the job never stored (plain text): not the raw
                # decoder's error on every call, but what to do about it. (The operation only:
                # the key may be sensitive, and is the caller's to log.)
                raise JobResultUnreadable(
                    f"{self.operation}: this key's record was settled with a response the job "
                    "cannot decode (its body is not JSON); resolve it again with a JSON body "
                    "(idem-middleware resolve --again --body '<json>', with its --to and --note)"
                ) from None
        if settled is not None:
            raise JobKeyReused(f"{self.operation}: this key was used with different arguments")
        if record.state is State.UNKNOWN:
            raise JobOutcomeUnknown(
                f"{self.operation}: an earlier run's outcome is unknown; resolve it first"
            )
        return UNSETTLED
