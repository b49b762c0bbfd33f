"""One guarded request: key, tenant, body and fingerprint; the mode that runs it; and the answer
the mode returns, which only this module writes to the client. The request path, in call order:
`middleware` (guarded? which policy) -> `exchange` -> `transactional` or `lease` (claim, wait,
run, settle; returns an `answers.Answer`) -> `exchange` sends it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

from starlette.exceptions import HTTPException
from starlette.types import Message, Receive, Scope, Send

from .answers import Answer, InFlight, Problem, Replay, Sent, request_digest
from .capture import ResponseCapture
from .client_watch import ClientWatch
from .context import key_digest, token_hash
from .endpoints import HANDLED, Handled
from .errors import ClientGone, ProblemKind, RequestRejected, StoreError, traceback_due
from .fingerprint import Fingerprinter, compressed_body_hint
from .keys import KEY_HEADER, parse_idempotency_key, parse_key_value
from .keysource import take_key
from .lease import LeaseRun
from .observe import PROBLEM_EVENTS, UNTIMED, Event, store_error_event
from .policy import Mode, Policy
from .refusals import is_refusal, send_refusal
from .responses import answer_cancelled, send_accepted, send_replay, status_location
from .store.base import RecordKey, Store, StoredResponse, new_record_key
from .transactional import RETRIED, Attempt
from .transactional_wait import run_transactional

if TYPE_CHECKING:
    from .middleware import IdempotencyMiddleware
    from .waiting import Held

logger = logging.getLogger("idem_middleware")

#: Every loop is bounded: a body's pieces at most its cap's bytes, those that bring none this many.
_MAX_EMPTY_MESSAGES = 1_000_000


async def _nothing() -> None: ...


class Exchange(ClientWatch):
    """Everything per request lives here, never on the middleware."""

    __slots__ = (
        "body",
        "body_delivered",
        "by_name",
        "counted",
        "fingerprinter",
        "message",
        "mw",
        "operation",
        "policy",
        "receive",
        "record_key",
        "scope",
        "send",
        "slot",
        "started",
        "token_hash",
        "watched",
    )

    def __init__(
        self,
        mw: IdempotencyMiddleware,
        scope: Scope,
        receive: Receive,
        send: Send,
        fingerprinter: Fingerprinter,
        policy: Policy,
        operation: str,
        by_name: dict[bytes, bytes] | None = None,
    ) -> None:
        self.mw = mw
        self.by_name = by_name  # the headers by name (`header_map`), or None: scan them
        self.scope = scope
        self.receive = receive
        self.send = send
        self.fingerprinter = fingerprinter  # the path's (the middleware's cache)
        self.policy = policy
        self.operation = operation  # the route's, named once per route (the middleware's cache)
        self.body = b""
        #: The server's message that brought the whole body, handed to the app as it is.
        self.message: Message | None = None
        self.started = False  # whether anything reached the client
        # While a transactional handler runs under the client watch: the app's receive() after
        # its body waits for `disconnected` (made when first needed) instead of the server's.
        self.watched = False
        self.disconnected: asyncio.Event | None = None
        self.client_watch: asyncio.Future[None] | None = None
        self.body_delivered = False
        self.record_key: RecordKey | None = None
        self.token_hash: bytes | None = None
        #: The tenant slot the attempt holds, with a cap (`max_tenant_connections`) only.
        self.slot: Held | None = None

    @property
    def store(self) -> Store:
        return self.mw.store

    async def run(self) -> None:
        policy = self.policy
        try:
            if policy.key_source is None:
                by_name = self.by_name
                if by_name is None:
                    key = parse_idempotency_key(self.scope["headers"])
                else:  # (its names are lower case: absent here is absent)
                    raw = by_name.get(KEY_HEADER)
                    key = None if raw is None else parse_key_value(raw)
            else:
                key = await take_key(self, policy.key_source)
            key_error: RequestRejected | HTTPException | None = None
        # (An error kept past its `except` loses its traceback, context and cause, which hold
        # this frame, on 3.12+ the last two too: a cycle. A refusal is answered, never raised on.)
        except RequestRejected as exc:
            key, key_error = None, exc.with_traceback(None)
            key_error.__context__ = None
        except HTTPException as exc:  # a key function's 4xx, answered after the tenant's 401
            if not is_refusal(exc):
                raise
            key, key_error = None, exc.with_traceback(None)
            key_error.__context__ = key_error.__cause__ = None
        if key is None and key_error is None and not policy.key_required:
            handled = HANDLED.set(Handled.YES)  # unguarded, but handled (endpoints.idempotent)
            try:
                await self.mw.app(self.scope, self.receive, self.send)
            finally:
                HANDLED.reset(handled)
            return
        try:
            tenant = self.mw.tenants.resolve(self.scope, allow_anonymous=policy.allow_anonymous)
            if tenant is not None and not isinstance(tenant, str):
                tenant = await tenant  # an asynchronous resolver's
        except RequestRejected as exc:  # a resolver that names no one (500, never unscoped)
            await self.problem(exc.kind, exc.detail)
            return
        except HTTPException as exc:  # the resolver's own 4xx (refusals.py); a 5xx goes on
            if not is_refusal(exc):
                raise
            await self.refused(exc.with_traceback(None), "tenant resolver")
            return
        if tenant is None:
            await self.problem(
                ProblemKind.UNAUTHENTICATED, "This operation needs an authenticated caller."
            )
            return
        if key_error is not None:
            if isinstance(key_error, RequestRejected):
                await self.problem(key_error.kind, key_error.detail)
            else:
                await self.refused(key_error, "key source")
            return
        if key is None:
            await self.problem(
                ProblemKind.MISSING_KEY, "Send an Idempotency-Key header with this request."
            )
            return
        try:
            content_type = self.body_headers()
            # Read here, not in a coroutine of its own: most bodies come in one message.
            message = await self.receive()
            body = message.get("body", b"")
            if (
                message.get("more_body", False)
                or message["type"] != "http.request"
                or len(body) > policy.max_body_bytes
            ):
                body = await self.read_rest(message)
                if body is None:
                    return  # the client left before sending its body: nothing was claimed
            else:
                self.message = message  # the whole body in one message: the app gets it
            self.body = body
            scope = self.scope
            fingerprint = self.fingerprinter(
                scope.get("query_string", b""), scope["headers"], content_type, body
            )
        except RequestRejected as exc:
            await self.problem(exc.kind, exc.detail + compressed_body_hint(exc, self.scope))
            return
        record_key = self.record_key = new_record_key((tenant, self.operation, key))
        self.token_hash = token_hash(key) if policy.require_token else None
        try:
            if policy.mode is Mode.TRANSACTIONAL:
                failed: Exception | None = None
                try:
                    # The first attempt, awaited here (not under the retry loop): a frame fewer.
                    answer = await Attempt(self, record_key, fingerprint, None).run()
                except RETRIED as exc:
                    failed = exc.with_traceback(None)  # (see key_error's)
                if failed is not None:  # (outside the except: a retried handler sees no error)
                    try:
                        answer = await run_transactional(self, record_key, fingerprint, failed)
                    finally:
                        failed = None  # (its cause's frames reach this frame on 3.12+: a cycle)
            else:
                answer = await LeaseRun(self, record_key, fingerprint).run()
            if isinstance(answer, ResponseCapture):  # the handler's response, held till recorded
                self.started = True
                start, body = answer.held()  # (complete: a body message)
                await self.send(start)
                await self.send(body)  # type: ignore[arg-type]
            elif answer is not None:
                await self.answer(answer)
        except StoreError as exc:  # (what the client is told, and how it is logged: the error's)
            logger.log(
                exc.log_level,
                exc.log_message,
                extra={
                    "tenant": tenant,
                    "operation": self.operation,
                    "key_digest": key_digest(key),
                },
                exc_info=traceback_due(exc),  # (once a minute per kind: an outage's are many)
            )
            if not self.started:
                await self.store_failed(exc)
        except ClientGone as exc:
            logger.debug("client disconnected: %s", exc)
            if getattr(self, "counted", None) is None:  # (a duplicate that left while it waited)
                self.emit(Event.CANCELLED)
        except asyncio.CancelledError:  # (the server's shutdown, past its graceful timeout)
            await answer_cancelled(self)
            raise
        finally:
            if self.client_watch is not None:  # (let go of: its coroutine refers to the exchange)
                self.client_watch.cancel()
                self.client_watch = None

    # -- what the client is told ---------------------------------------------------------------

    def answer(self, answer: Answer) -> Awaitable[None]:
        """Send what a mode decided, but for the handler's own held response (`run` flushes
        it). Modes never write to the client themselves, except the stream of a response that
        could not be held (settled before its first byte). Returns the sending's own coroutine
        (no second one wraps it)."""
        match answer:
            case Replay(response=response):
                return self.replay(response)
            case Problem(kind=kind, detail=detail, retry_after=retry_after, counted=counted):
                return self.problem(kind, detail, retry_after, counted)
            case InFlight(detail=detail, fingerprint=fingerprint):
                return self._in_flight(detail, fingerprint)
            case Sent():
                return _nothing()  # streamed already
            case _:  # pragma: no cover - every other Answer is handled above
                raise TypeError(f"not an answer: {answer!r}")

    async def problem(
        self, kind: ProblemKind, detail: str, retry_after: int | None = None, counted: bool = False
    ) -> None:
        self.started = True
        if not counted:
            self.emit(PROBLEM_EVENTS.get(kind, Event.REJECTED))
        await self.mw.send_problem(self.send, kind, detail, retry_after=retry_after)

    async def store_failed(self, exc: StoreError) -> None:  # (see `store_error_event`)
        self.started = True
        if (event := store_error_event(exc.problem, getattr(self, "counted", None))) is not None:
            self.emit(event)
        await self.mw.send_problem(self.send, exc.problem, exc.detail, retry_after=exc.retry_after)

    async def refused(self, exc: HTTPException, source: str) -> None:
        self.started = True
        self.emit(Event.REJECTED)
        mw = self.mw
        challenge = mw.tenants.challenge
        await send_refusal(self.send, exc, base=mw.problem_base, challenge=challenge, source=source)

    async def replay(self, response: StoredResponse) -> None:
        self.started = True
        self.emit(Event.REPLAYED)
        with self.timed("replay"):
            hook = self.policy.replay_hook
            await send_replay(self.send, response, hook, self.scope, self.operation)

    async def _in_flight(self, detail: str, fingerprint: bytes | None) -> None:
        """409 + Retry-After, or 202 + Location of the status resource if the policy says so
        (not to an anonymous caller: the status resource answers authenticated callers only)."""
        record_key = self.record_key
        if not self.policy.accept_while_in_flight or record_key is None or not record_key.tenant:
            await self.problem(ProblemKind.IN_FLIGHT, detail, self.policy.retry_after_seconds)
            return
        fields = [("operation", record_key.operation)]  # (a token stays out of URLs: logged)
        fields += [] if self.policy.require_token else [("key", record_key.key)]
        fields += [] if fingerprint is None else [("request", request_digest(fingerprint))]
        root = self.mw.root_path_below or self.scope.get("root_path", "")
        location = status_location(root, self.mw.status_path, fields)
        self.started = True
        self.emit(Event.IN_FLIGHT)
        await send_accepted(self.send, location, self.policy.retry_after_seconds)

    # -- observing -------------------------------------------------------------------------------

    def emit(self, event: Event, generation: int | None = None) -> None:
        observer = self.mw.observer
        if observer is None:
            return
        self.counted: Event | None = event  # (the last: unset until then; see `store_failed`)
        attributes: dict[str, Any] = {"operation": self.operation}
        if self.record_key is not None:
            attributes["tenant"] = self.record_key.tenant
            attributes["key_digest"] = key_digest(self.record_key.key)
        if generation is not None:
            attributes["generation"] = generation
        observer.event(event, attributes)

    def timed(self, name: str) -> Any:
        observer = self.mw.observer
        if observer is None:
            return UNTIMED  # (no attributes built for nobody)
        return observer.timed(name, {"operation": self.operation})

    # -- the request ---------------------------------------------------------------------------

    def body_headers(self) -> bytes | None:
        """The request's Content-Type; a Content-Length that is not a number, or is over the
        policy's cap, is refused before a byte of the body is read."""
        by_name = self.by_name
        if by_name is not None:
            content_type = by_name.get(b"content-type")
            declared = by_name.get(b"content-length")
        else:
            content_type = declared = None
            for name, value in self.scope["headers"]:  # the first of each
                if name == b"content-type":
                    if content_type is None:
                        content_type = value
                elif name == b"content-length" and declared is None:
                    declared = value
        if declared is not None:
            if not declared.isdigit():  # HTTP's 1*DIGIT (int() takes "+5", " 7", "1_000" too)
                raise RequestRejected(ProblemKind.BODY_INVALID, "Content-Length is not a number.")
            cap = self.policy.max_body_bytes  # (a number of 6 digits is under a cap of 999,999 or
            # more: no int() made; leading zeros say nothing, and 31 digits are over any cap)
            if (len(declared) > 6 or cap < 999_999) and int(declared.lstrip(b"0")[:31] or 0) > cap:
                raise self._too_large()
        return content_type

    async def read_body(self) -> tuple[bytes | None, bytes | None]:
        """The Content-Type, and the whole body (capped); None for the body if the client left."""
        return self.body_headers(), await self.read_rest(await self.receive())

    async def read_rest(self, message: Message) -> bytes | None:
        """The whole body from its first message (received already); None if the client left."""
        cap = self.policy.max_body_bytes
        chunks: list[bytes] = []
        size = empty = 0
        # (Bytes are bounded by the cap, a byte a message or not; a type no server sends is passed
        # by, as Starlette's reader does: taken for an empty body, the handler ran on nothing.)
        for _ in range(cap + _MAX_EMPTY_MESSAGES + 2):
            kind = message["type"]
            if kind == "http.disconnect":
                return None
            chunk = message.get("body", b"") if kind == "http.request" else b""
            size += len(chunk)
            if size > cap:
                raise self._too_large()
            if chunk:
                chunks.append(chunk)
            elif (empty := empty + 1) > _MAX_EMPTY_MESSAGES:
                break
            if kind == "http.request" and not message.get("more_body", False):
                return b"".join(chunks)  # (one chunk: that very object)
            message = await self.receive()
        raise RequestRejected(ProblemKind.BODY_INVALID, "The body came in too many empty pieces.")

    def _too_large(self) -> RequestRejected:
        cap = self.policy.max_body_bytes
        return RequestRejected(ProblemKind.BODY_TOO_LARGE, f"The body may be at most {cap} bytes.")

    async def __call__(self) -> Message:
        """The exchange is the `receive` the app gets (no bound method made per request): the
        buffered body, then the client's disconnect."""
        if not self.body_delivered:
            self.body_delivered = True
            message = self.message
            if message is not None:
                self.message = None  # as it came, once: a second run gets a message of its own
                return message
            return {"type": "http.request", "body": self.body, "more_body": False}
        if self.watched:
            await self.disconnect_event().wait()
            return {"type": "http.disconnect"}
        # (One read of the server's receive(), shared with any watch: its verdict is kept.)
        await self.until_disconnect()
        return {"type": "http.disconnect"}
