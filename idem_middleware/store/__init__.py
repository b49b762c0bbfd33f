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
    shutdown: `Starlette(..., lifespan=store_lifespan(store))`. Checked when called: no store
    at all, something that is no store (a list of them, a DSN, the app: `lifespan=store_lifespan`
    not called) or one store given twice is a TypeError or ValueError, not a startup that opens
    nothing or fails on an error from deep in a pool."""
    if not stores:
        raise TypeError("store_lifespan takes the stores to open: store_lifespan(store, ...)")
    for store in stores:
        if isinstance(store, type) or not (  # (the class itself: `store_lifespan(MemoryStore)`)
            callable(getattr(store, "transaction", None))
            and hasattr(store, "__aenter__")
            and hasattr(store, "__aexit__")
        ):
            raise TypeError(
                f"store_lifespan takes stores (PostgresStore, MemoryStore), each its own argument:"
                f" store_lifespan(store, ...), not a {type(store).__name__}"
            )
    if len({id(store) for store in stores}) != len(stores):
        raise ValueError("store_lifespan was given one store twice: it would be opened twice")

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
