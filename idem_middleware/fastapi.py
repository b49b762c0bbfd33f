"""FastAPI wiring: dependencies that hand a handler its claim's connection and context."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, TypeAlias

import asyncpg
from fastapi import Depends, FastAPI, Request

from .context import IdempotencyContext, get_context
from .middleware import IdempotencyMiddleware
from .openapi import document_openapi
from .policy import idempotent, not_idempotent
from .store.base import Store

if TYPE_CHECKING:
    Connection: TypeAlias = asyncpg.Connection[Any]
else:  # asyncpg's Connection is generic only in its type stubs
    Connection = asyncpg.Connection

__all__ = [
    "Idempotency",
    "IdempotencyConnection",
    "document",
    "idempotency_context",
    "idempotent",
    "install",
    "not_idempotent",
    "transaction_connection",
]


# Dependencies are `async def` on purpose: FastAPI runs a plain `def` dependency in a worker
# thread, a hop that costs more than everything these do.
async def idempotency_context(request: Request) -> IdempotencyContext:
    return _claimed(request)


def _claimed(request: Request) -> IdempotencyContext:
    try:
        return get_context(request)
    except LookupError:
        raise RuntimeError(
            "this endpoint depends on an idempotency claim, but none is active: is "
            "IdempotencyMiddleware installed, the route guarded and its key required?"
        ) from None


async def transaction_connection(request: Request) -> Connection:
    # Reads the request itself rather than depending on `idempotency_context`: one dependency
    # to solve instead of two, on every request.
    context = _claimed(request)
    if context.connection is None:
        raise RuntimeError("this claim has no database connection (an in-memory store?)")
    connection: Connection = context.connection
    return connection


#: The idempotency context of the running request (key, generation, downstream key, declare()).
Idempotency = Annotated[IdempotencyContext, Depends(idempotency_context)]
#: The connection whose transaction commits together with the request's idempotency outcome.
IdempotencyConnection = Annotated[Connection, Depends(transaction_connection)]


def document(app: FastAPI) -> None:
    """Document every guarded operation in `app.openapi()`: the Idempotency-Key header, the
    problem responses (RFC 9457) and the replay header. Idempotent; `install` calls it."""
    if getattr(app.openapi, "__idem_documented__", False):
        return
    original = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = document_openapi(original(), app)
        return app.openapi_schema

    openapi.__idem_documented__ = True  # type: ignore[attr-defined]
    app.openapi = openapi  # type: ignore[method-assign]


def install(app: FastAPI, *, store: Store, **options: Any) -> None:
    """Add IdempotencyMiddleware to `app` (inside any authentication middleware added after it)
    and document it in OpenAPI. `options` are the middleware's keyword arguments."""
    app.add_middleware(IdempotencyMiddleware, store=store, **options)
    document(app)
