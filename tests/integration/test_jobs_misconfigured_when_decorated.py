"""A job's decorator refuses what would fail every call of the job: told when decorated (a
ConfigurationError naming what is wrong), not at each delivery as an unrelated TypeError,
AttributeError or ValueError (with a "coroutine was never awaited" warning)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest

from idem_middleware import IdempotencyContext, MemoryStore, Mode, PostgresStore
from idem_middleware.errors import ConfigurationError
from idem_middleware.jobs import idempotent_job
from idem_middleware.tenant import MAX_TENANT_BYTES

MODES = [Mode.TRANSACTIONAL, Mode.LEASE]


async def _job(ctx: IdempotencyContext, *, k: str) -> int:
    return 1


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("which", ["asyncpg connection", "PostgresStore class", "MemoryStore"])
async def test_what_is_no_store_instance_is_refused_when_decorated(
    pool: Any, which: str, mode: Mode
) -> None:
    """An asyncpg connection (it has a `transaction` method) or a store's class passed the
    decorator, then every call failed: `Connection.transaction() got an unexpected keyword
    argument 'acquire_timeout'`, `'Connection' object has no attribute 'watch'`, `missing 1
    required positional argument: 'self'`."""
    async with pool.acquire() as conn:
        store = {
            "asyncpg connection": conn,
            "PostgresStore class": PostgresStore,
            "MemoryStore": MemoryStore,
        }[which]
        with pytest.raises(ConfigurationError, match="a job's store is a PostgresStore"):
            idempotent_job(store, operation="op", key="k", mode=mode)(_job)


async def test_a_store_instance_is_still_taken(pg_store: PostgresStore) -> None:
    for store in (pg_store, MemoryStore()):
        for mode in MODES:
            job = idempotent_job(store, operation=f"op-{mode.value}", key="k", mode=mode)(_job)
            assert await job(k="x") == 1


@pytest.mark.parametrize(
    "tenant", ["a\x00b", "\ud800", "t" * (MAX_TENANT_BYTES + 1)], ids=["nul", "surrogate", "long"]
)
def test_a_fixed_tenant_no_store_can_key_is_refused_when_decorated(tenant: str) -> None:
    """A fixed tenant is the same at every call: one the store cannot key failed each call
    (ValueError) instead of the decorator."""
    with pytest.raises(ConfigurationError, match="tenant"):
        idempotent_job(MemoryStore(), operation="op", key="k", tenant=tenant)


async def _async_key(**kwargs: Any) -> str:
    return str(kwargs["k"])


class _AsyncCall:
    async def __call__(self, **kwargs: Any) -> str:
        return str(kwargs["k"])


@pytest.mark.parametrize("option", ["key", "tenant"])
@pytest.mark.parametrize("function", [_async_key, _AsyncCall()], ids=["async def", "__call__"])
def test_an_async_key_or_tenant_function_is_refused_when_decorated(
    option: str, function: Any
) -> None:
    """Its answer is a coroutine: each call was refused as "not coroutine" (ValueError), with a
    "coroutine was never awaited" warning, instead of the decorator saying so."""
    options: dict[str, Any] = {"key": "k", option: function}
    with pytest.raises(ConfigurationError, match=f"{option}= is a plain function"):
        idempotent_job(MemoryStore(), operation="op", **options)


@pytest.mark.parametrize("option", ["key", "tenant"])
async def test_a_key_function_answering_an_awaitable_is_refused_without_a_warning(
    option: str,
) -> None:
    """A plain function (a lambda) answering a coroutine is refused at the call as a
    misconfiguration, the coroutine closed: no "never awaited" warning."""
    options: dict[str, Any] = {"key": "k", option: lambda **kw: _async_key(**kw)}
    job = idempotent_job(MemoryStore(), operation="op", **options)(_job)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ConfigurationError, match=f"{option}= is a plain function"):
            await job(k="x")
