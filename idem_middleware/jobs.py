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

import functools
import hashlib
import inspect
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Concatenate, Literal, ParamSpec, TypeVar

import orjson

from .context import IdempotencyContext
from .errors import ConfigurationError
from .errors import JobInProgress as JobInProgress
from .errors import JobKeyReused as JobKeyReused
from .errors import JobOutcomeUnknown as JobOutcomeUnknown
from .jobs_lease import run_leased
from .jobs_spec import JobResultUnreadable as JobResultUnreadable
from .jobs_spec import JobSpec, check_settings, not_plain
from .jobs_spec import KeyOf as KeyOf
from .jobs_transactional import run_transactional
from .jsonvalues import changed_part, non_finite
from .keys import MAX_KEY_LENGTH
from .policy import (
    MAX_OPERATION_BYTES,
    LeaseExpiry,
    Mode,
    Policy,
    plainly_sync,
    seconds_option,
    storable_operation,
)
from .storable import storable_text
from .store.base import RecordKey, Store
from .tenant import MAX_TENANT_BYTES, storable_tenant

__all__ = [
    "JobInProgress",
    "JobKeyReused",
    "JobOutcomeUnknown",
    "JobResultUnreadable",
    "idempotent_job",
]

R = TypeVar("R")
P = ParamSpec("P")


def _json_ok(value: Any) -> bool:
    try:
        orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except TypeError:
        return False
    return True


def _fingerprint(operation: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    try:
        payload = orjson.dumps([args, kwargs], option=orjson.OPT_SORT_KEYS)
    except TypeError as exc:
        named = [*(f"argument {n}" for n in range(1, len(args) + 1)), *kwargs]
        values = [*args, *kwargs.values()]
        which = next(
            (n for n, v in zip(named, values, strict=True) if not _json_ok(v)), "an argument"
        )
        raise ConfigurationError(
            f"{operation}: the job's arguments must be JSON-serialisable to be fingerprinted; "
            f"{which} is not ({exc}: pass it as a str, say)"
        ) from exc
    # orjson writes NaN and the infinities as null: refused, or `v=inf` and `v=-inf` would be
    # the same call. (Looked for only where a null was written.)
    if b"null" in payload and non_finite([args, kwargs]):
        raise ConfigurationError(
            f"{operation}: the job's arguments hold NaN or an infinity, which JSON cannot tell "
            "apart from null: pass them as strings"
        )
    # Nor does JSON hold a dataclass's "_" attributes, or a datetime's offset to the second:
    # refused, or calls differing only there would be one call, the second answered with the
    # first one's result.
    if (changed := changed_part([args, kwargs])) is not None:
        what, fix = changed
        raise ConfigurationError(
            f"{operation}: the job's arguments hold {what}, so calls that differ in it could "
            f"not be told apart: {fix}"
        )
    return hashlib.sha256(operation.encode() + b"\x00" + payload).digest()


def _signature(fn: Callable[..., Any]) -> inspect.Signature | None:
    # The function's own, not one it wraps (`functools.wraps`): a wrapper may take other
    # arguments than the function it wraps (one it supplies itself, say).
    try:
        return inspect.signature(fn, follow_wrapped=False)
    except (TypeError, ValueError):  # (a callable whose signature cannot be read: not checked)
        return None


def _takes_keyword(signature: inspect.Signature | None, name: str) -> bool:
    """Whether a call can pass `name` by keyword (unknown without a signature to read)."""
    if signature is None:
        return True
    parameter = signature.parameters.get(name)
    if parameter is not None:
        return parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)
    return any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())


def _key_text(value: Any, what: str, option: str = "key") -> str:
    """A job's key (or tenant) as text: a str, an int's digits, a UUID's text: what says the
    same on every delivery. An object's str() may hold its address, a dict's its order: each
    delivery another key, each run again. `what`: where the value came from, for the error."""
    if value is None:  # (as str, "None": every call without a key would share one)
        raise ValueError(f"{what} is None")
    if isinstance(value, str):  # (its text: a str enum's str() may be `Kind.A`)
        return str.__str__(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return int.__repr__(value)  # (an IntEnum's too: its digits)
    if isinstance(value, uuid.UUID):
        return str(value)
    raise ValueError(
        f"{what} is a str, an int or a UUID, not {type(value).__name__}: pass {option}= a"
        " function that makes one of its fields"
    )


def _key_function(key: str | Callable[..., Any]) -> Callable[..., Any]:
    if callable(key):
        return key
    name = key

    def by_name(*args: Any, **kwargs: Any) -> str:
        if name not in kwargs:
            raise TypeError(f"pass the idempotency key argument {name!r} by keyword")
        return _key_text(kwargs[name], f"the idempotency key argument {name!r}")

    return by_name


def _answer(job: JobSpec, name: str, args: Any, kwargs: Any) -> Any:
    """The key or tenant function's answer; an awaitable one is refused (a lambda answering a
    coroutine: `check_settings` cannot tell it from a plain function)."""
    answer = (job.key_of if name == "key" else job.tenant_of)(*args, **kwargs)
    if inspect.isawaitable(answer):
        raise not_plain(job.operation, name, answer)
    return answer


async def _call(job: JobSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    job.check_arguments(args, kwargs)
    # (A key function's answer taken as a key argument's is: an int or a UUID as its text.)
    key = _key_text(_answer(job, "key", args, kwargs), "the key function's answer")
    # (Counted in UTF-8 bytes, as the database counts them: 128 "é" are 256.)
    if not 0 < (size := len(key.encode("utf-8", "surrogatepass"))) <= MAX_KEY_LENGTH:
        raise ValueError(
            f"an idempotency key is 1 to {MAX_KEY_LENGTH} bytes of UTF-8, not {size} bytes"
        )
    # (An account number: its digits; an account's UUID: its text. As `str`, an object's repr
    # made another tenant each call.)
    tenant = _key_text(
        _answer(job, "tenant", args, kwargs), f"{job.operation}: the job's tenant", "tenant"
    )
    # (PostgreSQL text holds neither, and the driver refuses them with an error of its own:
    # refused here, on either store.)
    if not (storable_text(key) and storable_tenant(tenant)):
        raise ValueError(
            f"{job.operation}: a job's key or tenant holds a NUL character or an unpaired "
            f"surrogate, or its tenant is over {MAX_TENANT_BYTES} bytes of UTF-8 (the record's "
            "primary key holds it)"
        )
    record_key = RecordKey(tenant, job.operation, key)
    fingerprint = _fingerprint(job.operation, args, kwargs)
    if job.mode is Mode.TRANSACTIONAL:
        return await run_transactional(job, record_key, fingerprint, args, kwargs)
    return await run_leased(job, record_key, fingerprint, args, kwargs)


def idempotent_job(
    store: Store,
    *,
    operation: str,
    key: str | KeyOf,
    tenant: str | KeyOf = "",
    mode: Mode | Literal["transactional", "lease"] = Mode.TRANSACTIONAL,
    retention_seconds: float = 24 * 3600.0,
    wait_seconds: float = 5.0,
    lease_seconds: float = 30.0,
    on_lease_expiry: LeaseExpiry | Literal["unknown", "takeover"] = LeaseExpiry.UNKNOWN,
    acquire_timeout: float = 10.0,
    max_serialization_retries: int = 3,
) -> Callable[
    [Callable[Concatenate[IdempotencyContext, P], Awaitable[R]]], Callable[P, Awaitable[Any]]
]:
    """Make an async function idempotent by key (see the module's docstring).

    `key`: the name of a keyword argument holding the key, or a function of the call's arguments;
    either a str, an int (its digits) or a UUID (its text).
    `tenant`: a fixed tenant or a function of the arguments (a queue message's account, say).
    The arguments (as JSON) are the fingerprint: the same key with other arguments raises
    JobKeyReused. The result must be JSON-serialisable; every call, first or repeat, returns it as
    decoded JSON.
    """
    if not operation:
        raise ConfigurationError("a job needs an operation name")
    if not storable_operation(operation):
        raise ConfigurationError(
            f"a job's operation is a str of at most {MAX_OPERATION_BYTES} bytes of UTF-8 without"
            f" NUL or unpaired surrogates, not {operation!r:.100}"
        )
    if not callable(key) and not (isinstance(key, str) and key):
        raise ConfigurationError(f"{operation}: key= is an argument's name or a function")
    if not callable(tenant) and not isinstance(tenant, str):
        raise ConfigurationError(f"{operation}: tenant= is a str or a function, not {tenant!r}")
    check_settings(store, operation, key, tenant)
    # The options a Policy shares with a job are checked (and a mode given as a string turned
    # into its member) as a Policy checks them.
    checked = Policy(
        mode=mode,
        retention_seconds=retention_seconds,
        wait_seconds=wait_seconds,
        lease_seconds=lease_seconds,
        on_lease_expiry=on_lease_expiry,
        max_serialization_retries=max_serialization_retries,
    )
    acquire_timeout = seconds_option(acquire_timeout, "acquire_timeout", positive=True)

    def decorate(
        fn: Callable[Concatenate[IdempotencyContext, P], Awaitable[R]],
    ) -> Callable[P, Awaitable[Any]]:
        if plainly_sync(fn):  # (its body would run, effects and all, before the await failed)
            raise ConfigurationError(
                f"{operation}: a job is an async function (`async def`), not {fn!r}: a plain "
                "function or a generator would run before the middleware could record it"
            )
        # A lease-mode run's checkouts (its claim, fence and settlement) are the store's own:
        # they wait no longer than the job's bound, as a middleware gives the store its own.
        bound_checkouts = getattr(store, "bound_checkouts", None)
        if checked.mode is Mode.LEASE and callable(bound_checkouts):
            bound_checkouts(acquire_timeout)
        signature = _signature(fn)
        try:
            if signature is not None:
                signature.bind_partial(None)  # (the context's place)
        except TypeError:
            raise ConfigurationError(
                f"{operation}: a job's first parameter receives its IdempotencyContext, and "
                f"{fn!r} takes no positional argument"
            ) from None
        if isinstance(key, str) and not _takes_keyword(signature, key):
            raise ConfigurationError(
                f"{operation}: key={key!r} names no parameter of {fn!r} that a keyword can pass"
            )
        job = JobSpec(
            fn=fn,
            store=store,
            operation=operation,
            key_of=_key_function(key),
            tenant_of=tenant if callable(tenant) else (lambda *a, **k: tenant),
            mode=checked.mode,
            retention_seconds=checked.retention_seconds,
            wait_seconds=checked.wait_seconds,
            lease_seconds=checked.lease_seconds,
            on_lease_expiry=checked.on_lease_expiry,
            acquire_timeout=acquire_timeout,
            max_serialization_retries=checked.max_serialization_retries,
            signature=signature,
        )

        @functools.wraps(fn)
        async def run(*args: P.args, **kwargs: P.kwargs) -> Any:
            return await _call(job, args, kwargs)

        return run

    return decorate
