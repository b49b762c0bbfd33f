"""FastAPI wiring: dependencies that hand a handler its claim's connection and context."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, TypeAlias

import asyncpg
from fastapi import Depends, Request

from .context import IdempotencyContext, get_context
from .policy import idempotent, not_idempotent

if TYPE_CHECKING:
    Connection: TypeAlias = asyncpg.Connection[Any]
else:  # asyncpg's Connection is generic only in its type stubs
    Connection = asyncpg.Connection

__all__ = [
    "Idempotency",
    "IdempotencyConnection",
    "idempotency_context",
    "idempotent",
    "not_idempotent",
    "transaction_connection",
]


def idempotency_context(request: Request) -> IdempotencyContext:
    try:
        return get_context(request)
    except LookupError:
        raise RuntimeError(
            "this endpoint depends on an idempotency claim, but none is active: is "
            "IdempotencyMiddleware installed, the route guarded and its key required?"
        ) from None


def transaction_connection(
    context: Annotated[IdempotencyContext, Depends(idempotency_context)],
) -> Connection:
    if context.connection is None:
        raise RuntimeError("this claim has no database connection (an in-memory store?)")
    connection: Connection = context.connection
    return connection


#: The idempotency context of the running request (key, generation, downstream key, declare()).
Idempotency = Annotated[IdempotencyContext, Depends(idempotency_context)]
#: The connection whose transaction commits together with the request's idempotency outcome.
IdempotencyConnection = Annotated[Connection, Depends(transaction_connection)]
