"""Per-route idempotency policy, and finding the route (and its template) a request matches."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Unpack

from .errors import ConfigurationError
from .frozen import quick_init
from .keysource import FIELD_NAME, KeyFunction, KeySource, as_key_source
from .options import PolicyOptions  # (at run time too: typing.get_type_hints reads it)
from .policy_values import (
    COUNTS,
    DURATIONS,
    FLAGS,
    MIN_LEASE_SECONDS,
    ReplayHook,
    count,
    fields,
    flag,
    member,
    names,
)
from .policy_values import MAX_SECONDS as MAX_SECONDS
from .policy_values import seconds_option as seconds_option
from .reconcile import Reconciler
from .storable import storable_text


class Mode(StrEnum):
    """Where a route's effects live, and so how its record is settled."""

    #: Effects are in the same PostgreSQL database: one transaction for claim, writes and outcome.
    TRANSACTIONAL = "transactional"
    #: Effects may live elsewhere: the claim commits first, under a lease and a generation.
    LEASE = "lease"


class LeaseExpiry(StrEnum):
    """What a lapsed lease turns into."""

    UNKNOWN = "unknown"
    TAKEOVER = "takeover"


# An operation is `METHOD /template`, or `METHOD host/template` under a `Host` route
# (`operation_name`), or a name pinned in that shape; its method any upper-case token the
# middleware may guard (HTTP's tchar: `methods=("VERSION-CONTROL",)`, say); the bounds keep a
# probe of the status route cheap.
_METHOD_AND_HOST = r"[!#$%&'*+.^_`|~0-9A-Z-]{1,255} [^/\x00-\x20\x7f]{0,255}/"
OPERATION_SHAPE = re.compile(_METHOD_AND_HOST + r"[^\x00-\x1f\x7f]{0,2000}")
#: The names the status resource looks up: a path the mounts took may hold a control character
#: (a client's decoded `%09`, under a mount the router above cannot see into: routed_above).
LOOKED_UP_SHAPE = re.compile(_METHOD_AND_HOST + r"[^\x00]{0,2000}")

#: The most bytes of UTF-8 an operation's name may have (a job's, or one a policy pins): with
#: a tenant (up to MAX_TENANT_BYTES) and a key (up to 255) it is the record's primary key, a
#: btree entry PostgreSQL refuses past 2704 bytes. A longer one failed every run: the claim with
#: the driver's error (lease mode) or the completion after the function ran (transactional).
MAX_OPERATION_BYTES = 1024


def storable_operation(name: object) -> bool:
    """Whether `name` can name a record's operation: a str PostgreSQL text can hold, of at most
    `MAX_OPERATION_BYTES` bytes of UTF-8."""
    if not isinstance(name, str) or not storable_text(name):
        return False
    return len(name.encode()) <= MAX_OPERATION_BYTES


#: `Policy.max_body_bytes` when not set: a route's own `max_body_size` replaces it (body_limits).
DEFAULT_MAX_BODY_BYTES = 1024 * 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class Policy:
    """How one route is guarded. Immutable; build variants with `dataclasses.replace`."""

    #: False turns the route into a plain pass-through.
    guard: bool = True
    #: A missing `Idempotency-Key` is a 400; when False the request runs unprotected.
    key_required: bool = True
    #: Accept requests with no authenticated tenant; they share one anonymous key space.
    allow_anonymous: bool = False
    #: JSON members left out of the fingerprint: top-level names, or JSON Pointers ("/a/b").
    exclude_fields: tuple[str, ...] = ()
    #: When set, the only JSON members the fingerprint covers (names or pointers, as above; a
    #: missing member counts as absent, not as null), less any that exclude_fields removes.
    include_fields: tuple[str, ...] = ()
    #: Request headers that are part of the fingerprint (an API version, say).
    include_headers: tuple[str, ...] = ()
    #: Largest request body accepted, in bytes (inclusive); larger is a 413 before any claim.
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    #: Most fields of the query string, of a form body and parts of a multipart body (each),
    #: and most JSON values (members and elements) the fingerprint reads; more is a 400.
    max_fields: int = 1000
    max_json_values: int = 10_000
    #: Largest response stored for replay, in bytes (inclusive). See the README on larger ones.
    max_response_bytes: int = 1024 * 1024
    #: How long a duplicate waits for the original to finish before it gets a 409.
    wait_seconds: float = 5.0
    #: The `Retry-After` sent with a 409 for a request still in flight.
    retry_after_seconds: int = 1
    #: How long a finished outcome is kept and replayed.
    retention_seconds: float = 24 * 3600.0
    mode: Mode = Mode.TRANSACTIONAL
    #: Lease mode: how long a claim is held without a heartbeat.
    lease_seconds: float = 30.0
    #: Lease mode: what a lapsed lease becomes.
    on_lease_expiry: LeaseExpiry = LeaseExpiry.UNKNOWN
    #: Transactional mode: how many times a serialization failure or deadlock is retried.
    max_serialization_retries: int = 3
    #: Lease mode: asks the downstream system about an unknown outcome (see reconcile.py).
    reconciler: Reconciler | None = None
    #: Lease mode: the bound on one reconciler call made for a waiting retry.
    reconcile_timeout_seconds: float = 5.0
    #: Lease mode: when the wait runs out, answer 202 + Location of the status resource
    #: instead of 409 + Retry-After.
    accept_while_in_flight: bool = False
    #: Accept only one-time tokens issued by a TokenIssuer as this route's Idempotency-Key.
    require_token: bool = False
    #: Where the key is read: None for the Idempotency-Key header; KeyFromHeader("X-Request-Id"),
    #: KeyFromBody("/event/id"), or a function `(scope, body) -> str | None` (sync or async).
    key_source: KeySource | KeyFunction | None = None
    #: Called on every replay (never on a first execution) with the stored response and the
    #: scope; returns the response to send, or None for unchanged. See responses.hooked_response.
    replay_hook: ReplayHook | None = None
    #: The name the route's records are kept under, `METHOD /name` (None: the route's method and
    #: template, `POST /payments/{pid}`). Pinned, a route keeps its keys when its path changes:
    #: a retry that reaches the renamed route replays the outcome instead of running again.
    operation: str | None = None

    if TYPE_CHECKING:  # (the generated one's, as a type checker reads it: see options.py)

        def __init__(self, **options: Unpack[PolicyOptions]) -> None: ...

    def __post_init__(self) -> None:
        # Values from a config file arrive as strings and floats: each option is checked (and an
        # enum's value turned into its member) here, so a mistake fails now, not on a request.
        for option in FLAGS:
            flag(self, option)
        object.__setattr__(self, "mode", member(Mode, self.mode, "mode"))
        object.__setattr__(
            self, "on_lease_expiry", member(LeaseExpiry, self.on_lease_expiry, "on_lease_expiry")
        )
        for option, low, high in COUNTS:
            object.__setattr__(self, option, count(getattr(self, option), option, low, high))
        for option, positive in DURATIONS:
            object.__setattr__(
                self, option, seconds_option(getattr(self, option), option, positive=positive)
            )
        if self.lease_seconds < MIN_LEASE_SECONDS:
            raise ConfigurationError(
                f"lease_seconds must be at least {MIN_LEASE_SECONDS} seconds, not "
                f"{self.lease_seconds!r}: a lease is renewed every third of it (a round trip "
                "each), so a shorter one lapses under a running handler. The default is 30"
            )
        if self.reconciler is not None:
            if not callable(self.reconciler):
                raise ConfigurationError(
                    f"reconciler must be an async function of a ReconcileContext, "
                    f"not {self.reconciler!r}"
                )
            if plainly_sync(self.reconciler):
                raise ConfigurationError(
                    f"reconciler must be an async function of a ReconcileContext; "
                    f"{self.reconciler!r} is a plain function, and every call of it would fail "
                    "(it is awaited, within reconcile_timeout_seconds). Define it with "
                    "`async def`; for blocking work, `await asyncio.to_thread(...)` inside it"
                )
            if self.mode is not Mode.LEASE:
                raise ConfigurationError(
                    "reconciler is a lease-mode option, and this policy is transactional: a "
                    "transactional request's outcome is never unknown (its writes commit or roll "
                    "back with the claim), so there is nothing to reconcile. Set "
                    "mode=Mode.LEASE for effects outside the database, or drop the reconciler"
                )
        if self.reconciler is not None and not _takes(self.reconciler, 1):
            raise ConfigurationError(
                f"reconciler must take one argument (a ReconcileContext): {self.reconciler!r} "
                "cannot, and every call of it would fail"
            )
        if self.on_lease_expiry is LeaseExpiry.TAKEOVER and self.mode is not Mode.LEASE:
            raise ConfigurationError(
                "on_lease_expiry is a lease-mode option, and this policy is transactional (no "
                "lease, nothing taken over): set mode=Mode.LEASE, or drop on_lease_expiry"
            )
        if self.require_token and not self.key_required:
            raise ConfigurationError(
                "require_token=True with key_required=False: a request without a key would run "
                "unguarded, skipping the token"
            )
        if self.require_token and self.allow_anonymous:
            raise ConfigurationError(  # (each anonymous request was told 400 token-invalid)
                "require_token=True with allow_anonymous=True: tokens go to authenticated callers"
            )
        object.__setattr__(self, "exclude_fields", fields(self.exclude_fields, "exclude_fields"))
        object.__setattr__(self, "include_fields", fields(self.include_fields, "include_fields"))
        object.__setattr__(self, "key_source", as_key_source(self.key_source))
        if getattr(self.key_source, "reads_body", False) and self.max_body_bytes == 0:
            raise ConfigurationError(  # (no key ever found: 400s, or unguarded runs without one)
                f"key_source={self.key_source!r} reads the body, and max_body_bytes=0 refuses any"
            )
        if self.replay_hook is not None and not (
            callable(self.replay_hook) and _takes(self.replay_hook, 2)
        ):
            # (one that cannot take them failed at every replay, logged, the replay unchanged)
            raise ConfigurationError(
                f"replay_hook must be callable with (response, scope), not {self.replay_hook!r}"
            )
        # Header names are compared in lower case, as ASGI delivers them.
        headers = names(self.include_headers, "include_headers")
        if bad := [h for h in headers if FIELD_NAME.fullmatch(h) is None]:
            # (a name no header has, "X-Api-Version " or "x-api-version:", covered nothing)
            raise ConfigurationError(f"include_headers: {bad[0]!r} is not a header's name")
        object.__setattr__(self, "include_headers", tuple(h.lower() for h in headers))
        if isinstance(self.operation, str):  # (its text: a str enum's member writes `Op.PAY`)
            object.__setattr__(self, "operation", str.__str__(self.operation))
        if self.operation is not None and (
            not storable_operation(self.operation)
            or OPERATION_SHAPE.fullmatch(self.operation) is None
        ):
            # (Text PostgreSQL cannot hold, or a key too long for its index, failed every
            # request to the route.)
            raise ConfigurationError(
                f"operation must be a name like 'POST /payments' (the route's method, a space "
                f"and a path-like name, as the status route and tokens take it; at most "
                f"{MAX_OPERATION_BYTES} bytes of UTF-8, no NUL or unpaired surrogate), not "
                f"{repr(self.operation)[:120]}"
            )

    def replace(self, **changes: Unpack[PolicyOptions]) -> Policy:
        checked_anew: Any = changes  # (`__post_init__` takes them as the constructor does)
        return dataclasses.replace(self, **checked_anew)


def _takes(function: Any, count: int) -> bool:
    """Whether `function` can be called with `count` positional arguments (yes when its
    signature cannot be read: some builtins)."""
    try:
        inspect.signature(function).bind(*([None] * count))
    except TypeError:
        return False
    except ValueError:
        return True
    return True


def plainly_sync(function: Any) -> bool:
    """Whether `function` is a `def` function or method (through partials, or as an object's
    `__call__`) that is not a coroutine function: awaiting what it returns fails at every call.
    A `lambda` that returns a coroutine is one too (the message says to write `async def`); a
    builtin or other callable is not judged here."""
    while isinstance(function, functools.partial):
        function = function.func
    if not (inspect.isfunction(function) or inspect.ismethod(function)):
        function = inspect.getattr_static(type(function), "__call__", None)
        if not inspect.isfunction(function):
            return False
    flags = function.__code__.co_flags
    return not flags & (inspect.CO_COROUTINE | inspect.CO_ITERABLE_COROUTINE)


@quick_init  # (built at each miss of the route cache: see frozen.py)
@dataclass(frozen=True, slots=True)
class RouteMatch:
    """The route a request matched: its template (with mount prefixes, and the host pattern of
    an enclosing `Host`) and path parameters. Found by `routing.match_route`."""

    template: str
    path_params: Mapping[str, Any]
    endpoint: Any
    #: The request-body limits declared below the middleware on the way to the route: the
    #: innermost, and the least (see body_limits); None: none declared.
    body_limit: int | None = None
    least_limit: int | None = None


def operation_name(method: str, template: str, policy: Policy | None = None) -> str:
    """The name of `method` on a route with `template` guarded by `policy`: the policy's pinned
    `operation`, else `METHOD /template`."""
    if policy is not None and policy.operation is not None:
        return policy.operation
    return f"{method} {template}"


def pinned_method_error(method: str, template: str, policy: Policy) -> str | None:
    """Why `policy`'s pinned operation cannot name `method` on `template`: it names another
    method (a policy on a route that serves POST and PUT, say: one name for both would replay
    a POST's response to a PUT)."""
    pinned = policy.operation
    if pinned is None or pinned.partition(" ")[0] == method:
        return None
    return (
        f"{method} {template} has operation={pinned!r}, which names another method: give "
        f"each method's route its own policy and name (or none)"
    )
