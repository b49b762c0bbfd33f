"""A tenant resolver is called with the ASGI scope: a FastAPI dependency given as one (its
parameters `Header()`, `Depends(...)`), or a function that cannot take one argument, is refused
when the middleware (or the status or token route) is made, not at every guarded request."""

from __future__ import annotations

import functools
from typing import Annotated, Any

import pytest
from fastapi import Depends, FastAPI, Header, Request
from fastapi.security import APIKeyHeader, HTTPBearer, OAuth2PasswordBearer
from starlette.requests import HTTPConnection

from idem_middleware import IdempotencyMiddleware, MemoryStore
from idem_middleware.errors import ConfigurationError
from idem_middleware.fastapi import install
from idem_middleware.status import status_route


async def header_dependency(authorization: Annotated[str, Header()] = "") -> str:
    return authorization


def depends_default(user: str = Depends(lambda: "u")) -> str:
    return user


def two_arguments(scope: Any, user: Any) -> str:
    return "t"


def no_argument() -> str:
    return "t"


@pytest.mark.parametrize(
    ("resolver", "said"),
    [
        (header_dependency, "parameter 'authorization' is a Header()"),
        (depends_default, "parameter 'user' is a Depends()"),
        (two_arguments, "cannot be called as resolver(scope)"),
        (no_argument, "cannot be called as resolver(scope)"),
    ],
)
def test_a_resolver_that_cannot_take_the_scope_is_refused_when_made(
    resolver: Any, said: str
) -> None:
    with pytest.raises(ConfigurationError, match="ASGI scope") as refused:
        IdempotencyMiddleware(FastAPI(), store=MemoryStore(), tenant_resolver=resolver)
    assert said in str(refused.value)
    with pytest.raises(ConfigurationError, match="ASGI scope"):  # (at once, not at the
        install(FastAPI(), store=MemoryStore(), tenant_resolver=resolver)  # lifespan's call)
    with pytest.raises(ConfigurationError, match="ASGI scope"):
        status_route(MemoryStore(), tenant_resolver=resolver)


async def reads_a_request(request: Request) -> str:
    return request.headers.get("x-tenant", "")


async def reads_a_connection(conn: HTTPConnection) -> str:
    return "t"


@pytest.mark.parametrize(
    ("resolver", "said"),
    [
        (HTTPBearer(), "FastAPI security scheme (HTTPBearer)"),
        (OAuth2PasswordBearer(tokenUrl="token"), "(OAuth2PasswordBearer)"),
        (APIKeyHeader(name="x-api-key"), "(APIKeyHeader)"),
        (reads_a_request, "parameter 'request' is annotated as a request"),
        (reads_a_connection, "parameter 'conn' is annotated as a request"),
    ],
)
def test_a_resolver_that_reads_a_request_is_refused_when_made(resolver: Any, said: str) -> None:
    """Found by probing: each was taken, and given the scope (a dict) failed every guarded
    request with an AttributeError from inside FastAPI or the app: a bare 500."""
    with pytest.raises(ConfigurationError, match="ASGI scope") as refused:
        IdempotencyMiddleware(FastAPI(), store=MemoryStore(), tenant_resolver=resolver)
    assert said in str(refused.value)
    with pytest.raises(ConfigurationError, match="ASGI scope"):
        status_route(MemoryStore(), tenant_resolver=resolver)


def with_settings(resolve: Any) -> Any:
    """A decorator that hands the resolver its settings, the function's name kept."""

    @functools.wraps(resolve)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return resolve(*args, settings={"issuer": "x"}, **kwargs)

    return wrapper


@with_settings
def configured(scope: Any, settings: dict[str, str]) -> str:
    return "t"


class Resolver:
    def __call__(self, scope: Any) -> str:
        return "t"


@pytest.mark.parametrize(
    "resolver",
    [
        lambda scope: "t",
        Resolver(),
        functools.partial(two_arguments, user=None),
        functools.partial(two_arguments, None),  # (its scope given positionally as `user`)
        configured,  # (what is called is the wrapper, not the function it wraps)
    ],
)
def test_a_resolver_of_the_scope_is_accepted(resolver: Any) -> None:
    IdempotencyMiddleware(FastAPI(), store=MemoryStore(), tenant_resolver=resolver)


@pytest.mark.parametrize("resolver", ["tenant-a", None, 42])
def test_a_resolver_that_is_not_a_function_is_refused_when_made(resolver: Any) -> None:
    with pytest.raises(ConfigurationError, match="tenant_resolver must be a function"):
        IdempotencyMiddleware(FastAPI(), store=MemoryStore(), tenant_resolver=resolver)
    with pytest.raises(ConfigurationError, match="tenant_resolver must be a function"):
        status_route(MemoryStore(), tenant_resolver=resolver)
