"""A refusal the app's own callbacks raise before any claim: a Starlette (or FastAPI)
`HTTPException` with a 4xx status, raised by the tenant resolver or a key source function.

A FastAPI app reuses its `get_current_user` logic in its resolver, and that logic raises
`HTTPException(401, headers={"WWW-Authenticate": "Bearer"})`. The middleware runs outside the
app's exception handlers, so the exception is answered here, as the app meant it: its status,
its detail, its headers, as problem+json. A 401 is `unauthenticated` (under `problem_base`, the
type of the middleware's own 401: to a client, a resolver that raises and one that returns None
say the same); any other 4xx is `about:blank` (RFC 9457 §4.2.1: nothing beyond what its status
says; the app's 403 or 429 is no idempotency problem). Nothing is claimed or stored. A 5xx, or any
other exception, is not answered here: it goes on to the server's error handling and to the
error trackers, as a handler's own exception does.
"""

from __future__ import annotations

import logging
from http import HTTPStatus

import orjson
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.types import Send

from .errors import ProblemKind
from .observe import shown
from .responses import build_problem
from .sendable import header_problem

logger = logging.getLogger("idem_middleware")

#: The answer's own: its body's type and framing (an app's copies are dropped).
_OURS = frozenset({b"content-type", b"content-length", b"transfer-encoding"})


def is_refusal(exc: HTTPException) -> bool:
    """Whether an HTTPException is a client error the middleware answers (a 4xx)."""
    status = exc.status_code
    return isinstance(status, int) and not isinstance(status, bool) and 400 <= status < 500


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Request refused"


def _headers(exc: HTTPException) -> list[tuple[bytes, bytes]]:
    """The exception's headers as a server sends them; one a server would refuse (a line break
    in its value, a name that is no token, a character beyond Latin-1) is left out and named in
    the logs."""
    kept, dropped = [], []
    for name, value in (exc.headers or {}).items():
        try:
            pair = (str(name).lower().encode("latin-1"), str(value).encode("latin-1"))
        except UnicodeEncodeError:
            dropped.append(repr(str(name).lower()[:64]))
            continue
        if pair[0] in _OURS:
            continue
        refused = header_problem(pair)
        if refused is None:
            kept.append(pair)
        else:
            dropped.append(refused)
    if dropped:
        logger.warning(
            "idempotency: an HTTPException raised before the claim had headers no server sends, "
            "left out of its answer: %s",
            shown("; ".join(dropped)),
        )
    return kept


def build_refusal(
    exc: HTTPException, *, base: str, challenge: bytes | None, source: str
) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """The status, headers and body answering a 4xx HTTPException that `source` (the tenant
    resolver, the key source) raised. Logged at DEBUG by its status only: its detail may echo
    the credential it refused."""
    status = int(exc.status_code)  # (an `HTTPStatus` member is an int too: sent as one)
    logger.debug("idempotency: the %s refused the request with %d", source, status)
    detail = exc.detail if isinstance(exc.detail, str) else _phrase(status)
    own = _headers(exc)
    if status == 401:
        # The app's challenge if it gave one, else the middleware's (RFC 9110 requires one).
        if any(name == b"www-authenticate" for name, _ in own):
            challenge = None
        status, headers, body = build_problem(
            ProblemKind.UNAUTHENTICATED, detail, base=base, challenge=challenge
        )
    else:
        problem = {"type": "about:blank", "title": _phrase(status), "status": status}
        body = orjson.dumps({**problem, "detail": detail})
        headers = [
            (b"content-type", b"application/problem+json"),
            (b"content-length", str(len(body)).encode()),
        ]
    headers.extend(own)
    return status, headers, body


async def send_refusal(
    send: Send, exc: HTTPException, *, base: str, challenge: bytes | None, source: str
) -> None:
    """Send the answer `build_refusal` builds (the middleware's)."""
    status, headers, body = build_refusal(exc, base=base, challenge=challenge, source=source)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def refusal_response(
    exc: HTTPException, *, base: str, challenge: bytes | None, source: str
) -> Response:
    """The answer `build_refusal` builds, as a Response (the library's own routes)."""
    status, headers, body = build_refusal(exc, base=base, challenge=challenge, source=source)
    response = Response(body, status)
    response.raw_headers = headers  # (every header given: Starlette adds none of its own)
    return response
