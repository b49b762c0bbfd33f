"""Responses the library writes itself: problem+json refusals (for the middleware and for its
own routes) and stored-response replays."""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING
from urllib.parse import quote, urlencode

import orjson
from starlette.responses import Response
from starlette.types import Scope, Send

from .errors import ProblemKind
from .observe import Event, shown
from .policy_values import ReplayHook as ReplayHook
from .sendable import bytes_pairs, head_problem, header_problem, sendable_headers
from .store.base import StoredResponse

if TYPE_CHECKING:
    from .exchange import Exchange

#: The `type` URIs are this prefix plus the kind (see ProblemKind); they never change.
DEFAULT_PROBLEM_BASE = "urn:idem-middleware:problem:"

_TITLES: dict[ProblemKind, tuple[int, str]] = {
    ProblemKind.MISSING_KEY: (400, "Idempotency-Key is missing"),
    ProblemKind.INVALID_KEY: (400, "Idempotency-Key is invalid"),
    ProblemKind.KEY_REUSED: (422, "Idempotency-Key is already used for a different request"),
    ProblemKind.IN_FLIGHT: (409, "A request is outstanding for this Idempotency-Key"),
    ProblemKind.OUTCOME_UNKNOWN: (409, "The outcome of the original request is unknown"),
    ProblemKind.BODY_INVALID: (400, "The request body is invalid"),
    ProblemKind.BODY_TOO_LARGE: (413, "The request body is too large"),
    ProblemKind.TOO_MANY_FIELDS: (400, "The request has more fields than this operation accepts"),
    ProblemKind.UNAUTHENTICATED: (401, "Authentication is required"),
    ProblemKind.STORE_UNAVAILABLE: (503, "The idempotency store is unavailable"),
    ProblemKind.RECORD_NOT_FOUND: (404, "No request with this Idempotency-Key is known"),
    ProblemKind.TOKEN_INVALID: (400, "The Idempotency-Key is not a valid token for this request"),
    ProblemKind.MISCONFIGURED: (500, "The server is misconfigured"),
    ProblemKind.TENANT_BUSY: (429, "Too many of this caller's requests are in progress"),
    ProblemKind.TOKEN_CONFLICT: (409, "This intent's token cannot be issued"),
    ProblemKind.CANCELLED: (503, "The request was cut short before it was answered"),
    ProblemKind.METHOD_NOT_ALLOWED: (405, "This method is not allowed here"),
    ProblemKind.OPERATION_INVALID: (400, "The request names no operation that can be recorded"),
}

# Never stored or replayed: per-connection (hop-by-hop), per-response (Date, Server, and how long
# the first response took: a replay's would be false), framing that is recomputed
# (Content-Length), and credentials (Set-Cookie).
_DROPPED_HEADERS = frozenset(
    {
        b"connection",
        b"proxy-connection",  # (HTTP/2 stacks refuse it as connection-specific)
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"set-cookie",
        b"date",
        b"server",
        b"server-timing",
        b"x-response-time",
        b"x-process-time",  # (FastAPI's documentation's example middleware sets it)
        b"x-runtime",
        b"content-length",
        b"idempotent-replayed",
    }
)

REPLAYED_HEADER = (b"idempotent-replayed", b"true")


# Framing and the replay marker are the middleware's: a hook's copies of them are dropped.
_HOOK_DROPPED = frozenset({b"content-length", b"transfer-encoding", b"idempotent-replayed"})

logger = logging.getLogger("idem_middleware")


def problem_status(kind: ProblemKind) -> int:
    return _TITLES[kind][0]


def problem_title(kind: ProblemKind) -> str:
    return _TITLES[kind][1]


def build_problem(
    kind: ProblemKind,
    detail: str,
    *,
    base: str = DEFAULT_PROBLEM_BASE,
    retry_after: int | None = None,
    instance: str | None = None,
    challenge: bytes | None = None,
) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """The status, headers and body of an RFC 9457 problem+json response: the one place
    refusals are built, whether the middleware sends them or one of the library's routes.
    `challenge`: the `WWW-Authenticate` value a 401 carries (`tenant.www_authenticate`)."""
    status, title = _TITLES[kind]
    problem: dict[str, object] = {
        "type": base + kind.value,
        "title": title,
        "status": status,
        "detail": detail,
    }
    if instance is not None:
        problem["instance"] = instance
    body = orjson.dumps(problem)
    headers = [
        (b"content-type", b"application/problem+json"),
        (b"content-length", str(len(body)).encode()),
    ]
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode()))
    if challenge is not None and status == 401:
        headers.append((b"www-authenticate", challenge))
    return status, headers, body


async def send_problem(
    send: Send,
    kind: ProblemKind,
    detail: str,
    *,
    base: str = DEFAULT_PROBLEM_BASE,
    retry_after: int | None = None,
    instance: str | None = None,
    challenge: bytes | None = None,
) -> None:
    """Send the problem `build_problem` builds."""
    status, headers, body = build_problem(
        kind, detail, base=base, retry_after=retry_after, instance=instance, challenge=challenge
    )
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


_CANCELLED = (
    "The server stopped this request before answering it (it is shutting down). Retry it with "
    "the same Idempotency-Key: the retry runs it, replays its outcome or says what is known of it."
)


#: How long the answer to a cancelled request may take to be sent (`answer_cancelled`).
CANCELLED_SEND_SECONDS = 1.0


async def answer_cancelled(ex: Exchange) -> None:
    """What a guarded request the server cancelled (its shutdown's graceful timeout) says
    before its cancellation goes on, unless its response has started: `503 request-cancelled`
    + Retry-After, instead of the server's plain 500. What it held was let go as the
    cancellation unwound (a transaction rolled back, a lease marked `unknown`, a waiting place
    given back). Behind a `BaseHTTPMiddleware` nothing gets through: its cancel scope cancels
    this send too, and the server answers as before. Not when a middleware before this one may
    answer it itself (`middleware_order.check_outer_middleware`): a timeout's own 504 would
    come second, refused by the server.

    Not a CancelledError the handler raised itself (it awaited a task cancelled elsewhere) while
    nobody cancels the request: that is an error of the handler's, answered as any other (the
    server's 500), not "shutting down, retry in a second", which had its clients retry it at
    once, for ever."""
    task = asyncio.current_task()
    if task is None or not task.cancelling():
        return
    if getattr(ex, "counted", None) is None:  # (nothing decided: a duplicate that waited, say)
        ex.emit(Event.CANCELLED)
    if ex.started or not ex.mw.answers_cancelled:
        return
    ex.started = True
    try:
        # Bounded: a server past its graceful timeout may never take the message (hypercorn's
        # HTTP/2 stream, its sender cancelled already), and the cancellation waited on it.
        async with asyncio.timeout(CANCELLED_SEND_SECONDS):
            await ex.mw.send_problem(ex.send, ProblemKind.CANCELLED, _CANCELLED, retry_after=1)
    except Exception as exc:  # the client gone, or a server that takes no more
        logger.debug("the answer to a cancelled request was not sent: %r", exc)


def problem_response(
    kind: ProblemKind,
    detail: str,
    *,
    base: str = DEFAULT_PROBLEM_BASE,
    retry_after: int | None = None,
    challenge: bytes | None = None,
) -> Response:
    """The problem `build_problem` builds, as a Starlette Response for the library's routes."""
    status, headers, body = build_problem(
        kind, detail, base=base, retry_after=retry_after, challenge=challenge
    )
    # Given every header (content type and length included), Starlette adds none of its own.
    fields = {name.decode("latin-1"): value.decode("latin-1") for name, value in headers}
    return Response(body, status, headers=fields)


def status_location(root_path: str, status_path: str, fields: list[tuple[str, str]]) -> str:
    """The status resource's URL for a 202: under the app's root path as the client sent it,
    percent-encoded again (the scope holds it decoded: `%0D%0A` is no line break), with one
    leading slash (`//x.example` would be another host)."""
    try:  # (a lone surrogate: the byte a server decoded with surrogateescape, as that byte)
        root = quote(root_path, "/", errors="surrogateescape")
    except UnicodeEncodeError:  # (one no byte decodes to: written as UTF-8 would, all the same)
        root = quote(root_path, "/", errors="surrogatepass")
    return "/" + f"{root}{status_path}?{urlencode(fields)}".lstrip("/")


async def send_accepted(send: Send, location: str, retry_after: int) -> None:
    """202: the original request is still running; its status is at `location`."""
    body = orjson.dumps({"status": "processing", "location": location})
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"location", location.encode("latin-1")),
        (b"retry-after", str(retry_after).encode()),
        # A state of the moment, as the status resource's own answers are: no cache keeps it.
        (b"cache-control", b"no-store"),
    ]
    await send({"type": "http.response.start", "status": 202, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def storable_headers(headers: Sequence[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The headers a replay may repeat, as tuples (an app's own tuples kept as they are: a loop,
    not a comprehension, which is a function call of its own on Python 3.11)."""
    kept = []
    listed: set[bytes] | None = None  # (made only for a response with a Connection header)
    try:
        for pair in headers:
            if pair[0].lower() not in _DROPPED_HEADERS:
                kept.append(pair if type(pair) is tuple else (pair[0], pair[1]))
            elif len(pair[0]) == 10 and pair[0].lower() == b"connection" and type(pair[1]) is bytes:
                listed = {*(listed or ()), *(part.strip().lower() for part in pair[1].split(b","))}
    except (TypeError, AttributeError, IndexError):  # (a name that is no `bytes`: a bytearray
        # failed the recording, every attempt a 500, a lease-mode record `unknown` for good)
        return storable_headers(bytes_pairs(headers))
    if listed:  # the headers `Connection` names are hop-by-hop too (RFC 9110, 7.6.1)
        kept = [pair for pair in kept if pair[0].lower() not in listed]
    return kept


async def hooked_response(
    hook: ReplayHook, response: StoredResponse, scope: Scope, operation: str = ""
) -> StoredResponse:
    """What `hook` makes of a stored response about to be replayed.

    The hook sees an immutable copy (headers as a tuple). A hook that raises, or returns
    something that is not a well-formed StoredResponse, is logged with its traceback and the
    stored response is sent unchanged: the replay is the record of an effect that happened, and
    a client that cannot read it may conclude the effect failed and try again under a new key.
    The request's cancellation is not caught; the hook's own CancelledError (it awaited a task
    cancelled elsewhere) is its failure, as in `fence.run_reconciler`.
    """
    view = StoredResponse(
        response.status, tuple(response.headers), response.body, response.body_omitted
    )
    task = asyncio.current_task()
    cancelling = 0 if task is None else task.cancelling()
    try:
        result = hook(view, scope)
        if inspect.isawaitable(result):
            result = await result
        if result is None:
            return response
        problem = _malformed(result)
        if problem is not None:
            raise TypeError(f"replay_hook returned {problem}")
    except (Exception, asyncio.CancelledError) as exc:
        if isinstance(exc, asyncio.CancelledError) and (
            task is None or task.cancelling() > cancelling
        ):
            raise  # the request's own cancellation (the server's shutdown, its client gone)
        # Named by the operation (its route template), not the path: the path is the client's,
        # and a `%0D%0A` in it is a line break once the server has decoded it (and an operation
        # named by a concrete path is shown escaped).
        logger.error(
            "idempotency: the replay hook failed on %s; the stored response was replayed unchanged",
            shown(operation),
            exc_info=True,
        )
        return response
    headers = [(n.lower(), v) for n, v in result.headers if n.lower() not in _HOOK_DROPPED]
    return StoredResponse(int(result.status), headers, result.body, result.body_omitted)


#: The header a replay of a response whose body was not kept carries, saying why.
BODY_OMITTED_HEADER = b"idempotency-body-omitted"


def _malformed(result: object) -> str | None:
    if not isinstance(result, StoredResponse):
        return f"{type(result).__name__}, not a StoredResponse or None"
    if head_problem(result.status, ()) is not None:
        return f"the status {result.status!r}"
    if not isinstance(result.body, bytes):
        return "a body that is not bytes"
    if result.body_omitted is not None:
        if not isinstance(result.body_omitted, str):
            return f"body_omitted={result.body_omitted!r}"
        # (sent as a header's value: one with a line break was a head no server sends, and
        # every replay of the record failed)
        try:
            value = result.body_omitted.encode()
        except UnicodeEncodeError:
            return "a body_omitted that is not UTF-8 text"
        if header_problem((BODY_OMITTED_HEADER, value)) is not None:
            return "a body_omitted no header value can hold (a control character, an edge space)"
    # Named, never quoted: a value may carry what the stored response does. The rule is the
    # one a handler's own response meets (sendable.py): what servers send.
    return head_problem(result.status, result.headers)


#: What a stored response's headers say of its body, dropped with the body itself: its type,
#: coding, range, language, checksums (RFC 3230, RFC 9530, Content-MD5: a client checking one
#: would reject the empty body as corrupt) and disposition (a browser saves the empty body as
#: the named file). ETag and Last-Modified stay: they name the resource's state, not the bytes.
_BODY_CLAIMS = frozenset(
    {
        b"content-type",
        b"content-encoding",
        b"content-range",
        b"content-language",
        b"content-disposition",
        b"content-md5",
        b"digest",
        b"content-digest",
        b"repr-digest",
    }
)


async def send_replay(
    send: Send,
    response: StoredResponse,
    hook: ReplayHook | None = None,
    scope: Scope | None = None,
    operation: str = "",
) -> None:
    """Replay a stored response, marked `Idempotent-Replayed: true`, through `hook` if any."""
    if len(kept := storable_headers(response.headers)) != len(response.headers):
        # A record the library did not write so (edited by hand, an older version's): framing
        # or hop-by-hop headers repeated beside the replay's own (a second Content-Length, a
        # Transfer-Encoding with it) are a response h11 refuses and httptools sends ambiguous.
        logger.warning(
            "idempotency: the stored response of %s has headers a replay never repeats "
            "(framing, hop-by-hop, per-response), left out of its replay",
            shown(operation),
        )
        response = StoredResponse(response.status, kept, response.body, response.body_omitted)
    if hook is not None:
        response = await hooked_response(
            hook, response, scope if scope is not None else {}, operation
        )
    # A record stored before handlers' heads were checked may hold one a server refuses: left
    # in, every retry would be dropped for the whole retention.
    headers, refused = sendable_headers(response.headers)
    if refused:
        logger.warning(
            "idempotency: the stored response of %s has headers no server sends, left out of "
            "its replay: %s",
            shown(operation),  # (the operation, not the path a client wrote: see observe.shown)
            shown("; ".join(refused)),
        )
    body = response.body
    if response.body_omitted is not None:
        # The original body was never kept (see the README, "Large and streaming responses"):
        # the status and headers say what happened; the empty body must not claim a type, nor
        # an encoding (an empty body is no gzip stream).
        headers = [(n, v) for n, v in headers if n.lower() not in _BODY_CLAIMS]
        omitted = response.body_omitted.encode()
        if header_problem((BODY_OMITTED_HEADER, omitted)) is not None:  # (edited by hand)
            omitted = b"omitted"  # (a line break in it was a head no server sends)
        headers.append((BODY_OMITTED_HEADER, omitted))
        body = b""
    if response.status < 200 or response.status in (204, 304):
        # No content, whatever the handler sent (servers sent the first client none, and refuse
        # a replay's). No Content-Length: never on a 204; on a 304 it describes the 200's body.
        body = b""
    else:
        headers.append((b"content-length", str(len(body)).encode()))
    headers.append(REPLAYED_HEADER)
    await send({"type": "http.response.start", "status": response.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
