"""The pure-ASGI Idempotency-Key middleware: request buffering, response capture, settling.

No SQL here and no FastAPI: the store does the former, `fastapi.py` the latter.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Collection, Mapping, Sequence
from typing import Any
from urllib.parse import urlencode

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .context import (
    SCOPE_KEY,
    key_digest,
    token_hash,
)
from .errors import ConfigurationError, ProblemKind, RequestRejected, StoreError
from .fingerprint import compute_fingerprint
from .keys import parse_idempotency_key
from .keysource import take_key
from .lease import LeaseRun
from .observe import Event, Observer, combine, timed
from .policy import (
    MIDDLEWARE_ACTIVE,
    Mode,
    Policy,
    RouteMatch,
    endpoint_policy,
    names,
    operation_name,
)
from .responses import (
    DEFAULT_PROBLEM_BASE,
    send_accepted,
    send_problem,
    send_replay,
)
from .routing import Unresolved, match_route, routes_of
from .startup import SAFE_METHODS, check_app
from .store.base import (
    Record,
    RecordKey,
    State,
    Store,
    StoredResponse,
)
from .tenant import TenantResolver as TenantResolver
from .tenant import Tenants
from .tenant import authenticated_user_tenant as authenticated_user_tenant
from .transactional import ClientGone, run_transactional
from .waiting import TenantSlots, Waiters

logger = logging.getLogger("idem_middleware")

#: Setting this environment variable to 1/true/yes turns the middleware into a pass-through.
KILL_SWITCH_ENV = "IDEM_MIDDLEWARE_DISABLED"

_DEFAULT_METHODS = frozenset({"POST", "PATCH"})
_PROBLEM_EVENTS = {
    ProblemKind.KEY_REUSED: Event.MISMATCH,
    ProblemKind.IN_FLIGHT: Event.IN_FLIGHT,
    ProblemKind.OUTCOME_UNKNOWN: Event.UNKNOWN,
    ProblemKind.STORE_UNAVAILABLE: Event.ERROR,
}


def _kill_switch_on() -> bool:
    return os.environ.get(KILL_SWITCH_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


def _named_route(template: str) -> bool:
    """ "/path", or "host/path" for a route under a Host."""
    return template.startswith("/") or (
        "/" in template and not template.startswith(" ") and " " not in template.split("/")[0]
    )


class IdempotencyMiddleware:
    """Guards POST and PATCH (`methods`), and every route with an explicit policy whatever its
    method (safe methods never), with Idempotency-Key. `methods=()` guards only routes with a
    policy of their own (`@idempotent` or `policies`).

    Add it *inside* authentication, so the tenant resolver sees the authenticated user. Before it
    serves (at lifespan startup, or at the first request without one) it checks the app's routes
    once: see `startup.check_app`.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        store: Store,
        default_policy: Policy | None = None,
        policies: Mapping[str, Policy] | None = None,
        methods: Collection[str] = _DEFAULT_METHODS,
        tenant_resolver: TenantResolver = authenticated_user_tenant,
        problem_base: str = DEFAULT_PROBLEM_BASE,
        acquire_timeout: float = 10.0,
        enabled: bool | None = None,
        status_path: str = "/idempotency/status",
        observers: Observer | Sequence[Observer] | None = None,
        max_waiters: int = 1024,
        max_tenant_connections: int | None = None,
    ) -> None:
        self.app = app
        self.store = store
        self.default_policy = default_policy or Policy()
        self.methods = frozenset(m.upper() for m in names(methods, "methods"))
        if self.methods & SAFE_METHODS:
            raise ConfigurationError("safe methods are never guarded")
        if policies is not None and not isinstance(policies, Mapping):
            raise ConfigurationError('policies must map "METHOD /template" to a Policy')
        self.policies: dict[str, Policy] = {}
        for name, policy in (policies or {}).items():
            method, _, template = str(name).partition(" ")
            if not _named_route(template) or method.upper() != method or not method:
                raise ConfigurationError(f"policy key {name!r} is not 'METHOD /template'")
            if method in SAFE_METHODS:
                raise ConfigurationError(f"policy key {name!r}: {method} is never guarded")
            if not isinstance(policy, Policy):
                raise ConfigurationError(f"policies[{name!r}] is not a Policy")
            self.policies[name] = policy
        self.tenant_resolver = tenant_resolver
        self.problem_base = problem_base
        self.acquire_timeout = acquire_timeout
        self.status_path = status_path
        self.observer = combine(observers)
        #: Duplicates waiting (with no connection) for a key held elsewhere, in this process.
        self.waiters = Waiters(max_waiters)
        #: Guarded requests of one tenant holding a store connection at once, in this process.
        self.tenant_slots = TenantSlots(max_tenant_connections)
        self.enabled = (not _kill_switch_on()) if enabled is None else enabled
        self.tenants = Tenants(tenant_resolver)
        # The startup check runs once; a failed one fails every request after it too.
        self._checked = False
        self._check_error: ConfigurationError | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(scope, receive, send)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if not self._checked:
            self._check(scope.get("app"))
        if self._check_error is not None:
            raise self._check_error
        # Decorated endpoints refuse to run unless this is set (see policy.idempotent).
        active = MIDDLEWARE_ACTIVE.set(True)
        try:
            await self._http(scope, receive, send)
        finally:
            MIDDLEWARE_ACTIVE.reset(active)

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        method = scope["method"]
        if method in SAFE_METHODS or not self.enabled or SCOPE_KEY in scope:
            # (SCOPE_KEY: an outer IdempotencyMiddleware guards this request already.)
            await self.app(scope, receive, send)
            return
        app = scope.get("app")
        routes = routes_of(app if app is not None else self.app)
        match = match_route(routes, scope) if routes is not None else None
        if isinstance(match, Unresolved):
            policy = endpoint_policy(match.endpoint)
            if policy is None and method in self.methods:
                policy = self.default_policy
            if policy is not None and policy.guard:
                logger.error(
                    "idempotency: refused %s to %s: the middleware cannot name its route",
                    method,
                    match.where,
                )
                await self._misconfigured(send, "This operation cannot be guarded.")
                return
            match = None
        policy = self.policy_for(method, match) if match is not None else None
        if match is None or policy is None:
            await self.app(scope, receive, send)
            return
        if self.tenants.unidentifiable(scope, allow_anonymous=policy.allow_anonymous):
            await self._misconfigured(send, "The server cannot identify the caller.")
            return
        await _Exchange(self, scope, receive, send, match, policy).run()

    def policy_for(self, method: str, route: RouteMatch | Any) -> Policy | None:
        """The policy guarding `method` on `route` (anything with `template` and `endpoint`):
        the endpoint's own, else `policies`, else the default for `methods`; None if unguarded."""
        policy = endpoint_policy(route.endpoint) or self.policies.get(
            operation_name(method, route.template)
        )
        if policy is None and method in self.methods:
            policy = self.default_policy
        return policy if policy is not None and policy.guard else None

    async def _misconfigured(self, send: Send, detail: str) -> None:
        await send_problem(
            send,
            ProblemKind.MISCONFIGURED,
            f"{detail} The server is misconfigured; the request was not processed.",
            base=self.problem_base,
        )

    def _check(self, app: Any) -> None:
        self._checked = True
        try:
            check_app(self, app)
        except ConfigurationError as exc:
            logger.error("idempotency: %s", exc)
            self._check_error = exc

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Check the app when the server starts it; a failed check fails the startup."""
        failed = False

        async def checked_receive() -> Message:
            nonlocal failed
            message = await receive()
            if message["type"] == "lifespan.startup" and not self._checked:
                self._check(scope.get("app"))
                if self._check_error is not None:
                    failed = True
                    await send(
                        {
                            "type": "lifespan.startup.failed",
                            "message": f"idem_middleware: {self._check_error}",
                        }
                    )
                    raise self._check_error
            return message

        async def quiet_send(message: Message) -> None:
            # After our startup.failed, the app's own report of the same failure is not sent.
            if not (failed and message["type"].startswith("lifespan.startup")):
                await send(message)

        await self.app(scope, checked_receive, quiet_send)


class _Exchange:
    """One guarded request: everything per-request lives here, never on the middleware."""

    def __init__(
        self,
        mw: IdempotencyMiddleware,
        scope: Scope,
        receive: Receive,
        send: Send,
        match: RouteMatch,
        policy: Policy,
    ) -> None:
        self.mw = mw
        self.scope = scope
        self.receive = receive
        self.send = send
        self.match = match
        self.policy = policy
        self.operation = operation_name(scope["method"], match.template)
        self.body = b""
        self.started = False  # whether anything reached the client
        self.disconnected: asyncio.Event | None = None
        self.body_delivered = False
        self.record_key: RecordKey | None = None
        self.fingerprint = b""
        self.token_hash: bytes | None = None

    @property
    def app(self) -> ASGIApp:
        return self.mw.app

    @property
    def store(self) -> Store:
        return self.mw.store

    @property
    def waiters(self) -> Waiters:
        return self.mw.waiters

    @property
    def tenant_slots(self) -> TenantSlots:
        return self.mw.tenant_slots

    @property
    def app_receive(self) -> Receive:
        return self._app_receive

    async def answer_in_flight(self, record_key: RecordKey) -> None:
        """The wait ran out: 409 + Retry-After, or 202 + Location if the policy says so."""
        if self.policy.accept_while_in_flight:
            query = urlencode({"operation": record_key.operation, "key": record_key.key})
            # Under the app's root path (a proxy's prefix), as the client addressed it.
            location = f"{self.scope.get('root_path', '')}{self.mw.status_path}?{query}"
            self.started = True
            self.emit(Event.IN_FLIGHT)
            await send_accepted(self.send, location, self.policy.retry_after_seconds)
            return
        await self.problem(
            ProblemKind.IN_FLIGHT,
            "The original request is still being processed; retry later.",
            retry_after=self.policy.retry_after_seconds,
        )

    def emit(self, event: Event, generation: int | None = None) -> None:
        observer = self.mw.observer
        if observer is None:
            return
        attributes: dict[str, Any] = {"operation": self.operation}
        if self.record_key is not None:
            attributes["tenant"] = self.record_key.tenant
            attributes["key_digest"] = key_digest(self.record_key.key)
        if generation is not None:
            attributes["generation"] = generation
        observer.event(event, attributes)

    def timed(self, name: str) -> Any:
        return timed(self.mw.observer, name, {"operation": self.operation})

    async def replay(self, response: StoredResponse) -> None:
        self.started = True
        self.emit(Event.REPLAYED)
        with self.timed("replay"):
            await send_replay(self.send, response, self.policy.replay_hook, self.scope)

    async def tenant_busy(self) -> None:
        """This tenant's guarded requests hold all the connections it may have: nothing claimed."""
        await self.problem(
            ProblemKind.TENANT_BUSY,
            "Too many of your requests are being processed at once; retry shortly.",
            retry_after=self.policy.retry_after_seconds,
        )

    async def refuse_token(self, record_key: RecordKey) -> None:
        """The key is not a live token of this tenant, operation and request: nothing claimed."""
        assert self.token_hash is not None
        detail = await self.mw.store.token_problem(record_key, self.token_hash, self.fingerprint)
        await self.problem(ProblemKind.TOKEN_INVALID, detail or "This token cannot be used.")

    async def problem(self, kind: ProblemKind, detail: str, retry_after: int | None = None) -> None:
        self.started = True
        self.emit(_PROBLEM_EVENTS.get(kind, Event.REJECTED))
        await send_problem(
            self.send, kind, detail, base=self.mw.problem_base, retry_after=retry_after
        )

    async def run(self) -> None:
        policy = self.policy
        try:
            if policy.key_source is None:
                key = parse_idempotency_key(self.scope["headers"])
            else:
                key = await take_key(self, policy.key_source)
            key_error = None
        except RequestRejected as exc:
            key, key_error = None, exc
        if key is None and key_error is None and not policy.key_required:
            await self.mw.app(self.scope, self.receive, self.send)
            return
        tenant = await self._tenant()
        if tenant is None:
            await self.problem(
                ProblemKind.UNAUTHENTICATED, "This operation needs an authenticated caller."
            )
            return
        if key_error is not None:
            await self.problem(key_error.kind, key_error.detail)
            return
        if key is None:
            await self.problem(
                ProblemKind.MISSING_KEY, "Send an Idempotency-Key header with this request."
            )
            return
        try:
            body = await self._read_body()
            if body is None:
                return  # the client left before sending its body: nothing was claimed
            self.body = body
            fingerprint = compute_fingerprint(
                operation=self.operation,
                path_params=self.match.path_params,
                query_string=self.scope.get("query_string", b""),
                headers=self.scope["headers"],
                include_headers=policy.include_headers,
                content_type=self._header(b"content-type"),
                body=body,
                exclude_fields=policy.exclude_fields,
                include_fields=policy.include_fields,
                max_fields=policy.max_fields,
                max_json_values=policy.max_json_values,
            )
        except RequestRejected as exc:
            await self.problem(exc.kind, exc.detail)
            return
        record_key = self.record_key = RecordKey(tenant, self.operation, key)
        self.fingerprint = fingerprint
        self.token_hash = token_hash(key) if policy.require_token else None
        try:
            if policy.mode is Mode.TRANSACTIONAL:
                await run_transactional(self, record_key, fingerprint)
            else:
                await LeaseRun(self, record_key, fingerprint).run()
        except StoreError:
            logger.warning(
                "idempotency store unavailable",
                extra={
                    "tenant": tenant,
                    "operation": self.operation,
                    "key_digest": key_digest(key),
                },
                exc_info=True,
            )
            if not self.started:
                await self.problem(
                    ProblemKind.STORE_UNAVAILABLE,
                    "The request was not processed, or its outcome is not yet known; retry it "
                    "with the same Idempotency-Key.",
                    retry_after=1,
                )
        except ClientGone:
            logger.debug("client disconnected; the claim was rolled back")

    async def _tenant(self) -> str | None:
        return await self.mw.tenants.resolve(
            self.scope, allow_anonymous=self.policy.allow_anonymous
        )

    def _header(self, name: bytes) -> bytes | None:
        for key, value in self.scope["headers"]:
            if key == name:
                return value  # type: ignore[no-any-return]
        return None

    async def _read_body(self) -> bytes | None:
        cap = self.policy.max_body_bytes
        declared = self._header(b"content-length")
        if declared is not None:
            # HTTP's 1*DIGIT, nothing else (int() would also take "+5", " 7" or "1_000").
            if not declared.isdigit():
                raise RequestRejected(ProblemKind.BODY_INVALID, "Content-Length is not a number.")
            if int(declared) > cap:
                raise RequestRejected(
                    ProblemKind.BODY_TOO_LARGE, f"The body may be at most {cap} bytes."
                )
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > cap:
                raise RequestRejected(
                    ProblemKind.BODY_TOO_LARGE, f"The body may be at most {cap} bytes."
                )
            if chunk:
                chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def _app_receive(self) -> Message:
        if not self.body_delivered:
            self.body_delivered = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        if self.disconnected is not None:
            await self.disconnected.wait()
            return {"type": "http.disconnect"}
        return await self.receive()

    async def answer_record(self, record: Record, fingerprint: bytes) -> None:
        """What a duplicate gets (PROTOCOL §3); the fingerprint is compared first, in any state."""
        if record.fingerprint != fingerprint:
            await self.problem(
                ProblemKind.KEY_REUSED,
                "This Idempotency-Key was used for a different request; use a new key for a new "
                "request.",
            )
        elif record.state in (State.SUCCEEDED, State.FAILED_FINAL) and record.response is not None:
            await self.replay(record.response)
        elif record.state is State.UNKNOWN:
            await self.problem(
                ProblemKind.OUTCOME_UNKNOWN,
                "The original request's outcome is not known yet; it will not be run again "
                "until it is resolved.",
            )
        else:
            await self.problem(
                ProblemKind.IN_FLIGHT,
                "The original request is still being processed; retry later.",
                retry_after=self.policy.retry_after_seconds,
            )
