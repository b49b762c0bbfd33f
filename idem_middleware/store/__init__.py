"""Stores: the protocol, the PostgreSQL store and its in-memory twin."""

from .base import (
    Claim,
    ClaimTimeout,
    Record,
    RecordKey,
    RetryableConflict,
    State,
    Store,
    StoredResponse,
    TransactionSession,
)
from .memory import MemoryStore

__all__ = [
    "Claim",
    "ClaimTimeout",
    "MemoryStore",
    "Record",
    "RecordKey",
    "RetryableConflict",
    "State",
    "Store",
    "StoredResponse",
    "TransactionSession",
]
