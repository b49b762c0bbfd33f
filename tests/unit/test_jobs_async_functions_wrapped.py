"""A job's key or tenant function that is `async` under a wrapper (a partial, a partial of a
named partial, a bound method, an async generator function) is refused when decorated, as a
bare `async def` is; a plain function answering an awaitable that is no coroutine (a Future)
is refused at the call. A store lacking any one method a run calls is refused when decorated."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator
from typing import Any

import pytest

from idem_middleware import IdempotencyContext, MemoryStore
from idem_middleware.errors import ConfigurationError
from idem_middleware.jobs import idempotent_job


async def _job(ctx: IdempotencyContext, *, k: str) -> int:
    return 1


async def _async_key(prefix: str = "", **kwargs: Any) -> str:
    return prefix + str(kwargs["k"])


async def _async_gen_key(**kwargs: Any) -> AsyncIterator[str]:
    yield str(kwargs["k"])


class _Keys:
    async def of(self, **kwargs: Any) -> str:
        return str(kwargs["k"])


def _named_partial() -> Any:
    """A partial of a partial that carries attributes (update_wrapper's): not flattened."""
    inner = functools.update_wrapper(functools.partial(_async_key, "p-"), _async_key)
    outer = functools.partial(inner)
    assert isinstance(outer.func, functools.partial)
    return outer


FUNCTIONS = {
    "partial": functools.partial(_async_key, "p-"),
    "partial of a named partial": _named_partial(),
    "bound method": _Keys().of,
    "async generator": _async_gen_key,
}


@pytest.mark.parametrize("option", ["key", "tenant"])
@pytest.mark.parametrize("function", list(FUNCTIONS.values()), ids=list(FUNCTIONS))
def test_a_wrapped_async_function_is_refused_when_decorated(option: str, function: Any) -> None:
    options: dict[str, Any] = {"key": "k", option: function}
    with pytest.raises(ConfigurationError, match=f"{option}= is a plain function"):
        idempotent_job(MemoryStore(), operation="op", **options)


@pytest.mark.parametrize("option", ["key", "tenant"])
async def test_a_function_answering_a_future_is_refused_at_the_call(option: str) -> None:
    futures: list[asyncio.Future[str]] = []

    def answer(**kwargs: Any) -> Any:
        futures.append(asyncio.get_running_loop().create_future())
        return futures[-1]

    options: dict[str, Any] = {"key": "k", option: answer}
    job = idempotent_job(MemoryStore(), operation="op", **options)(_job)
    with pytest.raises(ConfigurationError, match=f"{option}= is a plain function"):
        await job(k="x")
    assert futures


#: What a run calls on its store, in one mode or the other.
STORE_METHODS = ("transaction", "claim_lease", "watch", "get", "takeover", "expire_lease")


@pytest.mark.parametrize("missing", STORE_METHODS)
def test_a_store_lacking_one_method_a_run_calls_is_refused_when_decorated(missing: str) -> None:
    def method(self: Any, *args: Any, **kwargs: Any) -> None:
        return None

    methods = {name: method for name in STORE_METHODS if name != missing}
    store = type("AlmostAStore", (), methods)()
    with pytest.raises(ConfigurationError, match="a job's store is a PostgresStore"):
        idempotent_job(store, operation="op", key="k")
