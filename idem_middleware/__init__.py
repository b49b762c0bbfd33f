"""idem_middleware: Idempotency-Key middleware for Starlette and FastAPI on PostgreSQL.

The names below are imported when first used (PEP 562), not when the package is: the pytest
plugin (`pytest_plugin.py`, a `pytest11` entry point) loads in every pytest run of a project
that has the package installed, and importing the middleware, the store and their frameworks
there cost every such run about half a second.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .context import IdempotencyContext, Outcome, derive_downstream_key, get_context
    from .endpoints import idempotent, not_idempotent
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
    from .policy import LeaseExpiry, Mode, Policy
    from .responses import ReplayHook
    from .store import store_lifespan
    from .store.base import Record, RecordKey, State, StoredResponse
    from .store.memory import MemoryStore
    from .store.postgres import PostgresStore

#: Each public name, and the module it comes from.
_SOURCES = {
    "IdempotencyContext": ".context",
    "Outcome": ".context",
    "derive_downstream_key": ".context",
    "get_context": ".context",
    "ConfigurationError": ".errors",
    "IdempotencyError": ".errors",
    "ProblemKind": ".errors",
    "RequestRejected": ".errors",
    "StaleGeneration": ".errors",
    "StoreError": ".errors",
    "KeyFromBody": ".keysource",
    "KeyFromFunction": ".keysource",
    "KeyFromHeader": ".keysource",
    "KeySource": ".keysource",
    "KILL_SWITCH_ENV": ".middleware",
    "IdempotencyMiddleware": ".middleware",
    "authenticated_user_tenant": ".middleware",
    "LeaseExpiry": ".policy",
    "Mode": ".policy",
    "Policy": ".policy",
    "idempotent": ".endpoints",
    "not_idempotent": ".endpoints",
    "ReplayHook": ".responses",
    "store_lifespan": ".store",
    "Record": ".store.base",
    "RecordKey": ".store.base",
    "State": ".store.base",
    "StoredResponse": ".store.base",
    "MemoryStore": ".store.memory",
    "PostgresStore": ".store.postgres",
}

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


if not TYPE_CHECKING:  # (hidden from type checkers: they see the imports above, and a name
    # the package lacks stays an error there, not a silent `Any`)

    def __getattr__(name: str) -> Any:
        source = _SOURCES.get(name)
        if source is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(source, __name__), name)
        globals()[name] = value  # (looked up here once: the next use finds it as any global)
        return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_SOURCES})
