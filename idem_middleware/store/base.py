"""The store protocol the middleware talks to, and the value types that cross it."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from ..errors import IdempotencyError


class State(StrEnum):
    PENDING = "pending"
    SUCCEEDED = "succeeded"
    FAILED_FINAL = "failed_final"
    UNKNOWN = "unknown"


FINAL_STATES = frozenset({State.SUCCEEDED, State.FAILED_FINAL})


@dataclass(frozen=True, slots=True)
class RecordKey:
    """The key space: tenant first, so the table can be distributed by tenant."""

    tenant: str
    operation: str
    key: str


@dataclass(frozen=True, slots=True)
class StoredResponse:
    status: int
    headers: Sequence[tuple[bytes, bytes]]
    body: bytes
    #: Why the body was not kept ("too-large", "streaming"), or None when it was.
    body_omitted: str | None = None


@dataclass(frozen=True, slots=True)
class Record:
    """A key's record as the store last committed it."""

    key: RecordKey
    fingerprint: bytes
    state: State
    generation: int
    response: StoredResponse | None
    #: A final record whose retention is over: it no longer protects anything.
    expired: bool = False
    #: A pending record whose lease has lapsed (lease mode).
    lease_expired: bool = False


@dataclass(frozen=True, slots=True)
class Claim:
    """The result of a claim: either this caller owns `generation`, or `record` is what exists."""

    claimed: bool
    generation: int
    record: Record | None


@dataclass(frozen=True, slots=True)
class StoreStats:
    """Counts per state and the age in seconds of the oldest record in each (None if empty)."""

    counts: dict[str, int]
    oldest_age_seconds: dict[str, float | None]

    @property
    def oldest_unresolved_age_seconds(self) -> float | None:
        """The age of the oldest pending or unknown record: the number an alert watches."""
        ages = [
            age
            for state in (State.PENDING.value, State.UNKNOWN.value)
            if (age := self.oldest_age_seconds.get(state)) is not None
        ]
        return max(ages) if ages else None


class ClaimTimeout(IdempotencyError):
    """The wait for another transaction's claim on the same key ran out."""


class RetryableConflict(IdempotencyError):
    """A serialization failure or deadlock: the transaction can be run again from the start."""


class TransactionSession(Protocol):
    """One connection in one transaction: the claim, the handler's writes and the outcome."""

    @property
    def connection(self) -> Any:
        """The driver connection the handler does its business writes on (None for memory)."""

    async def claim(
        self,
        key: RecordKey,
        fingerprint: bytes,
        *,
        retention_seconds: float,
        wait_seconds: float,
    ) -> Claim:
        """Insert a pending record, waiting at most `wait_seconds` on a concurrent claim.

        Raises ClaimTimeout when the wait runs out and RetryableConflict on 40001/40P01; either
        way the transaction is finished and must be rolled back.
        """

    async def complete(
        self, key: RecordKey, generation: int, state: State, response: StoredResponse
    ) -> None:
        """Record the outcome of the claim this transaction holds."""

    async def commit(self) -> None: ...

    async def rollback(self) -> None: ...

    async def begin(self) -> None:
        """Start a new transaction on the same connection (after an early commit)."""


class Store(Protocol):
    """What the middleware needs of a store. The PostgreSQL store is the real one."""

    def transaction(
        self, *, acquire_timeout: float
    ) -> AbstractAsyncContextManager[TransactionSession]:
        """Acquire a connection and begin a transaction; roll back on exit unless committed."""

    async def get(self, key: RecordKey) -> Record | None:
        """The committed record, if any."""
