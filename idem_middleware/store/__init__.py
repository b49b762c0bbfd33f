"""Stores: the protocol, the PostgreSQL store and its in-memory twin."""

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from typing import Any

from .base import (
    Claim,
    ClaimBusy,
    Claimed,
    ClaimTimeout,
    Existing,
    Record,
    RecordKey,
    RetryableConflict,
    State,
    Store,
    StoredResponse,
    TokenRefused,
    TransactionSession,
)
from .memory import MemoryStore


def store_lifespan(*stores: Any) -> Callable[[Any], AbstractAsyncContextManager[None]]:
    """A Starlette/FastAPI `lifespan` that opens the stores at startup and closes them at
    shutdown: `Starlette(..., lifespan=store_lifespan(store))`."""

    @asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:
            for store in stores:
                await stack.enter_async_context(store)
            yield

    return lifespan


__all__ = [
    "Claim",
    "ClaimBusy",
    "ClaimTimeout",
    "Claimed",
    "Existing",
    "MemoryStore",
    "Record",
    "RecordKey",
    "RetryableConflict",
    "State",
    "Store",
    "StoredResponse",
    "TokenRefused",
    "TransactionSession",
    "store_lifespan",
]
