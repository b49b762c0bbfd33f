"""The pure-ASGI Idempotency-Key middleware: request buffering, response capture, settling.

No SQL here and no FastAPI: the store does the former, `fastapi.py` the latter.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from typing import Any
from urllib.parse import urlencode

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .capture import ResponseCapture
from .context import (
    IdempotencyContext,
    Outcome,
    derive_downstream_key,
    enter_context,
    key_digest,
    leave_context,
    outcome_for_status,
    token_hash,
)
from .errors import ConfigurationError, ProblemKind, RequestRejected, StoreError
from .fingerprint import compute_fingerprint
from .keys import parse_idempotency_key
from .lease import LeaseRun
from .observe import SETTLED_EVENTS, Event, Observer, combine, timed
from .policy import Mode, Policy, RouteMatch, endpoint_policy, match_route, operation_name
from .responses import (
    DEFAULT_PROBLEM_BASE,
    send_accepted,
    send_problem,
    send_replay,
)
from .store.base import (
    ClaimTimeout,
    Record,
    RecordKey,
    RetryableConflict,
    State,
    Store,
    StoredResponse,
)

logger = logging.getLogger("idem_middleware")

TenantResolver = Callable[[Scope], "Awaitable[str | None] | str | None"]

#: Setting this environment variable to 1/true/yes turns the middleware into a pass-through.
KILL_SWITCH_ENV = "IDEM_MIDDLEWARE_DISABLED"

_DEFAULT_METHODS = frozenset({"POST", "PATCH"})
# Methods a route may opt into with an explicit policy; safe methods are never guarded.
_OPT_IN_METHODS = frozenset({"PUT", "DELETE"})
_RETRYABLE_SQLSTATES = frozenset({"40001", "40P01"})
#: How long a transactional handler runs before the middleware watches for its client leaving.
DISCONNECT_WATCH_AFTER = 0.05
_STORED = {Outcome.SUCCEEDED: State.SUCCEEDED, Outcome.FAILED_FINAL: State.FAILED_FINAL}
_PROBLEM_EVENTS = {
    ProblemKind.KEY_REUSED: Event.MISMATCH,
    ProblemKind.IN_FLIGHT: Event.IN_FLIGHT,
    ProblemKind.OUTCOME_UNKNOWN: Event.UNKNOWN,
    ProblemKind.STORE_UNAVAILABLE: Event.ERROR,
}


def authenticated_user_tenant(scope: Scope) -> str | None:
    """The default tenant: the identity of the user Starlette's AuthenticationMiddleware set."""
    user = scope.get("user")
    if user is None or not getattr(user, "is_authenticated", False):
        return None
    try:
        identity = user.identity
    except NotImplementedError:
        identity = user.display_name
    return str(identity) or None


def _kill_switch_on() -> bool:
    return os.environ.get(KILL_SWITCH_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


class _ClientGone(Exception):
    """The client disconnected while a transactional handler ran; its work was rolled back."""


class IdempotencyMiddleware:
    """Guards POST and PATCH (and PUT/DELETE routes with an explicit policy) with Idempotency-Key.

    Add it *inside* authentication, so the tenant resolver sees the authenticated user.
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
    ) -> None:
        self.app = app
        self.store = store
        self.default_policy = default_policy or Policy()
        self.methods = frozenset(m.upper() for m in methods)
        if self.methods & {"GET", "HEAD", "OPTIONS", "TRACE"}:
            raise ConfigurationError("safe methods are never guarded")
        self.policies: dict[str, Policy] = {}
        for name, policy in (policies or {}).items():
            method, _, template = name.partition(" ")
            if not template.startswith("/") or method.upper() != method:
                raise ConfigurationError(f"policy key {name!r} is not 'METHOD /template'")
            self.policies[name] = policy
        self._candidate_methods = self.methods | _OPT_IN_METHODS
        self.tenant_resolver = tenant_resolver
        self.problem_base = problem_base
        self.acquire_timeout = acquire_timeout
        self.status_path = status_path
        self.observer = combine(observers)
        self.enabled = (not _kill_switch_on()) if enabled is None else enabled

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] not in self._candidate_methods
            or not self.enabled
        ):
            await self.app(scope, receive, send)
            return
        router = getattr(scope.get("app"), "router", None)
        match = match_route(router.routes, scope) if router is not None else None
        policy = self._policy_for(scope["method"], match) if match is not None else None
        if match is None or policy is None:
            await self.app(scope, receive, send)
            return
        await _Exchange(self, scope, receive, send, match, policy).run()

    def _policy_for(self, method: str, match: RouteMatch) -> Policy | None:
        policy = endpoint_policy(match.endpoint) or self.policies.get(
            operation_name(method, match.template)
        )
        if policy is None and method in self.methods:
            policy = self.default_policy
        return policy if policy is not None and policy.guard else None


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
            await send_replay(self.send, response)

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
            key = parse_idempotency_key(self.scope["headers"])
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
                await self._run_transactional(record_key, fingerprint)
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
        except _ClientGone:
            logger.debug("client disconnected; the claim was rolled back")

    async def _tenant(self) -> str | None:
        resolved = self.mw.tenant_resolver(self.scope)
        if inspect.isawaitable(resolved):
            resolved = await resolved
        if resolved:
            return resolved
        return "" if self.policy.allow_anonymous else None

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

    async def _answer(self, record: Record, fingerprint: bytes) -> None:
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

    # -- transactional mode --------------------------------------------------------------------

    async def _run_transactional(self, record_key: RecordKey, fingerprint: bytes) -> None:
        retries = self.policy.max_serialization_retries
        for attempt in range(retries + 1):
            try:
                await _TransactionalAttempt(self, record_key, fingerprint).run()
                return
            except RetryableConflict:
                if attempt == retries or self.started:
                    await self.problem(
                        ProblemKind.IN_FLIGHT,
                        "A concurrent request conflicted with this one; retry it.",
                        retry_after=self.policy.retry_after_seconds,
                    )
                    return
            except BaseException as exc:
                if getattr(exc, "sqlstate", None) not in _RETRYABLE_SQLSTATES:
                    raise
                if attempt == retries or self.started:
                    raise
            logger.debug("serialization failure; running the transaction again")
            self.body_delivered = False


class _TransactionalAttempt:
    """One run of claim, handler and outcome inside one database transaction."""

    def __init__(self, ex: _Exchange, record_key: RecordKey, fingerprint: bytes) -> None:
        self.ex = ex
        self.record_key = record_key
        self.fingerprint = fingerprint
        self.tx: Any = None
        self.context: IdempotencyContext | None = None
        self.capture = ResponseCapture(ex.send, ex.policy.max_response_bytes, self._settle_early)

    async def run(self) -> None:
        try:
            await self._run()
        finally:
            self.capture.close()  # it holds self._settle_early, a cycle otherwise

    async def _run(self) -> None:
        ex = self.ex
        policy = ex.policy
        async with ex.mw.store.transaction(
            acquire_timeout=ex.mw.acquire_timeout, begin=False
        ) as tx:
            self.tx = tx
            try:
                with ex.timed("claim"):
                    claim = await tx.claim(
                        self.record_key,
                        self.fingerprint,
                        retention_seconds=policy.retention_seconds,
                        wait_seconds=policy.wait_seconds,
                        token_hash=ex.token_hash,
                    )
            except ClaimTimeout:
                await tx.rollback()
                await ex.answer_in_flight(self.record_key)
                return
            if not claim.claimed:
                await tx.rollback()  # give the connection back before writing to the client
                if claim.record is None:
                    await ex.refuse_token(self.record_key)
                else:
                    await ex._answer(claim.record, self.fingerprint)
                return
            self.context = IdempotencyContext(
                tenant=self.record_key.tenant,
                operation=self.record_key.operation,
                key=self.record_key.key,
                generation=claim.generation,
                mode=Mode.TRANSACTIONAL,
                connection=tx.connection,
                downstream_key=derive_downstream_key(
                    self.record_key.tenant, self.record_key.operation, self.record_key.key
                ),
            )
            ex.emit(Event.CLAIMED, claim.generation)
            token = enter_context(ex.scope, self.context)
            try:
                await self._run_handler()
            except BaseException:
                # Clean up, then re-raise: the rollback releases the key.
                await tx.rollback()
                ex.emit(Event.RELEASED, claim.generation)
                raise
            finally:
                leave_context(ex.scope, token)
            capture = self.capture
            if capture.passthrough:
                return
            if capture.start is None or not capture.complete:
                await tx.rollback()
                raise RuntimeError("the application returned without a complete response")
            await self._settle()
            ex.started = True
            await capture.flush()

    async def _run_handler(self) -> None:
        """Run the app in this task. A client that disconnects while it runs cancels it (its
        writes roll back with the claim).

        The client is watched only once the handler has run `DISCONNECT_WATCH_AFTER` seconds:
        a watch is a task of its own, and most handlers are done sooner. A client that leaves a
        quicker handler finds its outcome committed, and replayed to its retry.
        """
        ex = self.ex
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        watch: asyncio.Task[None] | None = None
        running = True
        gone = False

        def client_left(watched: asyncio.Task[None]) -> None:
            nonlocal gone
            if running and not watched.cancelled() and watched.exception() is None:
                gone = True
                if ex.disconnected is not None:
                    ex.disconnected.set()  # the app's own receive() reports it too
                task.cancel()

        def start_watch() -> None:
            nonlocal watch
            watch = loop.create_task(self._until_disconnect())
            watch.add_done_callback(client_left)

        ex.disconnected = asyncio.Event()
        timer = loop.call_later(DISCONNECT_WATCH_AFTER, start_watch)
        uncancelled = False
        try:
            await ex.mw.app(ex.scope, ex._app_receive, self.capture)
        except asyncio.CancelledError:
            # Ours (the client left) unless someone else cancelled too (server shutdown).
            if not gone:
                raise
            uncancelled = True
            if task.uncancel() > 0:
                raise
        finally:
            running = False
            timer.cancel()
            if watch is not None:
                watch.cancel()
        ex.disconnected = None
        if not gone:
            return
        if not uncancelled:
            task.uncancel()  # the handler swallowed our cancellation and returned
        if self.capture.passthrough:
            return  # it was already streaming: the outcome is settled
        raise _ClientGone

    async def _until_disconnect(self) -> None:
        # After the body, an ASGI server's receive() yields only http.disconnect; anything else
        # is skipped (boundedly), never taken for a departed client.
        for _ in range(100):
            if (await self.ex.receive())["type"] == "http.disconnect":
                return
        await asyncio.Event().wait()  # a server that keeps talking: never a disconnect

    async def _settle_early(self, reason: str) -> None:
        await self._settle(omitted=reason)
        # Writes the handler makes while streaming must not commit outside the claim: they run
        # in a transaction that is rolled back when the request ends.
        await self.tx.begin()

    async def _settle(self, omitted: str | None = None) -> None:
        assert self.context is not None
        capture = self.capture
        outcome = self.context.declared or outcome_for_status(capture.status, Mode.TRANSACTIONAL)
        state = _STORED.get(outcome)
        with self.ex.timed("complete"):
            if state is None:
                await self.tx.rollback()
                outcome = Outcome.RELEASE
            else:
                await self.tx.complete_and_commit(
                    self.record_key, self.context.generation, state, capture.stored(omitted)
                )
        self.ex.emit(SETTLED_EVENTS[outcome], self.context.generation)
