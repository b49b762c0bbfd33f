"""idem_middleware: Idempotency-Key middleware for Starlette and FastAPI on PostgreSQL."""

from .context import IdempotencyContext, Outcome, derive_downstream_key, get_context
from .errors import (
    ConfigurationError,
    IdempotencyError,
    ProblemKind,
    RequestRejected,
    StaleGeneration,
    StoreError,
)
from .keysource import KeyFromBody, KeyFromFunction, KeyFromHeader, KeySource
from .middleware import KILL_SWITCH_ENV, IdempotencyMiddleware, authenticated_user_tenant
from .policy import LeaseExpiry, Mode, Policy, idempotent, not_idempotent
from .responses import ReplayHook
from .store import store_lifespan
from .store.base import Record, RecordKey, State, StoredResponse
from .store.memory import MemoryStore
from .store.postgres import PostgresStore

__all__ = [
    "KILL_SWITCH_ENV",
    "ConfigurationError",
    "IdempotencyContext",
    "IdempotencyError",
    "IdempotencyMiddleware",
    "KeyFromBody",
    "KeyFromFunction",
    "KeyFromHeader",
    "KeySource",
    "LeaseExpiry",
    "MemoryStore",
    "Mode",
    "Outcome",
    "Policy",
    "PostgresStore",
    "ProblemKind",
    "Record",
    "RecordKey",
    "ReplayHook",
    "RequestRejected",
    "StaleGeneration",
    "State",
    "StoreError",
    "StoredResponse",
    "authenticated_user_tenant",
    "derive_downstream_key",
    "get_context",
    "idempotent",
    "not_idempotent",
    "store_lifespan",
]
