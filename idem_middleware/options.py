"""The keyword options of `Policy`, `@idempotent` and `install` as typed dictionaries, so that a
type checker reads `@idempotent(wait_secnds=2)` or `install(app, store=s, www_authenticat=...)`
as the mistake it is, and takes what the options take at run time: a mode or a lease expiry as
its value (`"lease"`), field and header names in a set or a list, a `Fraction` of seconds.

(Checked against the options themselves by tests/unit/test_typed_options.py: a new option is
added here too.)
"""

from __future__ import annotations

from collections.abc import Collection, KeysView, Mapping, Sequence
from fractions import Fraction
from typing import TYPE_CHECKING, Literal, TypedDict

if TYPE_CHECKING:
    from .keysource import KeyFunction, KeySource
    from .observe import Observer
    from .policy import LeaseExpiry, Mode, Policy
    from .reconcile import Reconciler
    from .responses import ReplayHook
    from .tenant import TenantResolver

#: Names (of JSON members, pointers or headers): a tuple, a list, a set (sorted) or a dict's
#: keys; not a str.
Names = tuple[str, ...] | list[str] | set[str] | frozenset[str] | KeysView[str]
#: A number of seconds (another real number is kept as a float).
Seconds = float | Fraction


class PolicyOptions(TypedDict, total=False):
    """`Policy(...)`'s options, as `@idempotent(...)` and `Policy.replace(...)` take them too
    (what each means: the `Policy` class)."""

    guard: bool
    key_required: bool
    allow_anonymous: bool
    exclude_fields: Names
    include_fields: Names
    include_headers: Names
    max_body_bytes: int
    max_fields: int
    max_json_values: int
    max_response_bytes: int
    wait_seconds: Seconds
    retry_after_seconds: int
    retention_seconds: Seconds
    mode: Mode | Literal["transactional", "lease"]
    lease_seconds: Seconds
    on_lease_expiry: LeaseExpiry | Literal["unknown", "takeover"]
    max_serialization_retries: int
    reconciler: Reconciler | None
    reconcile_timeout_seconds: Seconds
    accept_while_in_flight: bool
    require_token: bool
    key_source: KeySource | KeyFunction | None
    replay_hook: ReplayHook | None
    operation: str | None


class MiddlewareOptions(TypedDict, total=False):
    """`IdempotencyMiddleware`'s options but its store, as `install(app, store=..., ...)` takes
    them (what each means: the middleware's)."""

    default_policy: Policy | None
    policies: Mapping[str, Policy] | None
    methods: Collection[str]
    tenant_resolver: TenantResolver
    problem_base: str
    acquire_timeout: float
    enabled: bool | None
    status_path: str
    observers: Observer | Sequence[Observer] | None
    max_waiters: int
    max_tenant_connections: int | None
    www_authenticate: str | None
