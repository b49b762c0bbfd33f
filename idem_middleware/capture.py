"""Holding a handler's response until its outcome is recorded, or streaming it past a cap."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, Protocol

from starlette.types import Message, Scope, Send

from .answers import Answer
from .responses import storable_headers
from .sendable import final_status
from .store.base import StoredResponse

#: Messages that go straight through, the response held or not: early hints (103), HTTP/2
#: push promises, and the test client's debug information (Starlette's templates send it first).
#: The final HTTP statuses (an int's membership is tested in C, quicker than `199 < s < 600`).
_FINAL_STATUSES = range(200, 600)
_ASIDE = frozenset({"http.response.early_hint", "http.response.push", "http.response.debug"})
#: The first bytes a `text/event-stream` Content-Type may start with (OWS before it).
_STREAM_FIRST = b"Tt \t"


#: Ways of sending a body that the server reads itself (a file by path, by descriptor). Hidden
#: from a guarded handler's scope, so that its response is held and stored like any other
#: (Starlette's FileResponse then sends the file's bytes): with them the body could not be held,
#: and a retry would get the status without the file, on one server and not another.
_SENT_BY_SERVER = ("http.response.pathsend", "http.response.zerocopysend")


def hide_sent_by_server(scope: Scope) -> None:
    """Take the server's own ways of sending a body out of `scope`'s extensions (in place, as
    the claim's context is put there: middleware outside sees what the handler saw)."""
    extensions = scope["extensions"]
    if extensions and any(name in extensions for name in _SENT_BY_SERVER):
        scope["extensions"] = {
            name: value for name, value in extensions.items() if name not in _SENT_BY_SERVER
        }


def _content_type(headers: Any) -> Any:
    """The last Content-Type of `headers` named as servers take it (in capitals, as a
    bytearray or a memoryview; a str under h11), or b"" (the capture's test for the lower-case
    bytes name found none)."""
    found: Any = b""
    for name, value in headers:
        if _as_bytes(name).lower() == b"content-type":
            found = value
    return found


def _as_bytes(value: object) -> bytes:
    """A header name or value servers take, as bytes: a bytearray's or memoryview's, a str's (h11
    takes one) as Latin-1; b"" for anything else (the server refuses it, not the capture)."""
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    if isinstance(value, str):
        return value.encode("latin-1", "replace")
    return b""


class SettlesEarly(Protocol):
    """What a capture's owner does before the first byte of a response it cannot hold."""

    async def settle_early(self, reason: str) -> None: ...


class _RequestOver:
    async def settle_early(self, reason: str) -> None:
        raise RuntimeError("the response was sent after the request ended")


_REQUEST_OVER = _RequestOver()


class ResponseCapture(Answer):
    """The `send` a claimed handler gets.

    The response is held (a client must never see an outcome that was not recorded). A response
    over `cap` bytes, a `text/event-stream` one, or an ASGI extension message cannot be held: then
    `settle_early(reason)` records the outcome before the first byte leaves, and the rest streams
    straight through. That is the owner's (the owner, not a callback: a bound method would be one
    more object per request for the garbage collector to pass over while the handler runs), or a
    subclass's own: the transactional attempt is its handler's capture, one object per request
    fewer, and no cycle between the two to break.
    """

    __slots__ = (
        "_cap",
        "_owner",
        "_send",
        "body",
        "chunks",
        "complete",
        "last",
        "passthrough",
        "size",
        "start",
    )

    def __init__(self, send: Send, cap: int, owner: SettlesEarly | None = None) -> None:
        self._send = send
        self._cap = cap
        self._owner = owner
        self.start: Message | None = None
        # The body held: its first chunk, and all of them in a list made with the second. Most
        # handlers send their body in one message, which is then sent on as it came (`last`):
        # no list and no message of the capture's own, objects the collector would pass over.
        self.body = b""
        self.chunks: list[bytes] | None = None
        #: The message that completed the body.
        self.last: Message | None = None
        self.size = 0
        self.complete = False
        self.passthrough = False

    @property
    def status(self) -> int:
        assert self.start is not None
        status: int = self.start["status"]
        return status

    async def __call__(self, message: Message) -> None:
        if self.passthrough:
            await self._send(message)
            return
        kind = message["type"]
        if kind == "http.response.start":
            if self.start is not None:
                raise RuntimeError("http.response.start sent twice")
            headers = message.get("headers", ())
            if type(headers) is not list and type(headers) is not tuple:
                # Any iterable, a generator too: read once here, kept for the server and the record.
                headers = list(headers)
                message = {**message, "headers": headers}
            status = message["status"]
            if type(status) is not int or status not in _FINAL_STATUSES:
                # (`HTTPStatus.CREATED`, say: recorded and sent as the int it is; anything else
                # refused as the server would, before any outcome is recorded)
                message = {**message, "status": final_status(status)}
            self.start = message
            content_type = b""
            for name, value in headers:
                if name == b"content-type":
                    content_type = value  # the last one
            if not content_type:  # (one named in capitals, `Content-Type`, or not as bytes)
                content_type = _content_type(headers)
            # (A media type's case means nothing: `Text/Event-Stream` streams as well. The first
            # byte first: most responses are `application/...`, and are done with in one test.)
            # (`find`, not `in`: bytes' `in` tries its operand as an integer first, and formats
            # the TypeError it then discards; `find` refuses a str as `in` does.)
            try:
                streams = _STREAM_FIRST.find(content_type[:1]) >= 0 and (
                    content_type.lstrip(b" \t")[:17].lower() == b"text/event-stream"
                )
            except (TypeError, AttributeError):  # (a str under h11, a memoryview: sent too)
                streams = _as_bytes(content_type).lstrip(b" \t")[:17].lower() == (
                    b"text/event-stream"
                )
            if streams:
                await self._go_passthrough("streaming", more_body=True)
            return
        if kind != "http.response.body":
            if kind in _ASIDE:  # a 103's links, a push promise, debug info: not the response
                await self._send(message)
                return
            # Trailers, pathsend and the like cannot be held faithfully. (A body the handler
            # completed before its trailers is sent completed.)
            await self._go_passthrough("streaming", more_body=not self.complete)
            await self._send(message)
            return
        if self.start is None or self.complete:  # (as servers refuse them, not stored)
            raise RuntimeError(
                "response body sent before http.response.start"
                if self.start is None
                else "response body sent after the response was complete"
            )
        chunk = message.get("body", b"")
        if type(chunk) is not bytes:
            # A view of the app's buffer (Starlette streams memoryviews as they come), which the
            # app may refill once this send returns: what is held must be a copy.
            chunk = bytes(chunk)
        more = message.get("more_body", False)
        self.size += len(chunk)
        if chunk:
            if not self.body:
                self.body = chunk
            elif self.chunks is None:
                self.chunks = [self.body, chunk]
            else:
                self.chunks.append(chunk)
        if self.size > self._cap:
            await self._go_passthrough("too-large", more_body=more)
            return
        if not more:
            self.complete = True
            self.last = message

    def settle_early(self, reason: str) -> Awaitable[None]:
        """Record the outcome before the first byte of a response that cannot be held: the
        owner's work (a subclass without one overrides this)."""
        if self._owner is None:
            raise TypeError("a ResponseCapture without an owner must override settle_early")
        return self._owner.settle_early(reason)

    def close(self) -> None:
        """Let go of the owner once the request is over. The owner holds the capture: left in
        place, that cycle (and the ASGI scope hanging off it) would wait for the cyclic garbage
        collector, whose extra passes cost more CPU than anything else the middleware does."""
        self._owner = _REQUEST_OVER

    async def _go_passthrough(self, reason: str, *, more_body: bool) -> None:
        if self.start is None:
            raise RuntimeError("response body sent before http.response.start")
        await self.settle_early(reason)
        self.passthrough = True
        await self.flush(more_body=more_body)

    def stored(self, omitted: str | None = None) -> StoredResponse:
        assert self.start is not None
        return StoredResponse(  # (status, headers, body, body_omitted: positional is quicker)
            self.start["status"],
            storable_headers(self.start.get("headers", ())),
            b"" if omitted else self.body if self.chunks is None else b"".join(self.chunks),
            omitted,
        )

    async def flush(self, *, more_body: bool = False) -> None:
        """Send the held response (start and the body so far)."""
        start, body = self.held(more_body)
        await self._send(start)
        if body is not None:
            await self._send(body)

    def held(self, more_body: bool = False) -> tuple[Message, Message | None]:
        """The held response's messages, let go of here: its start, and a message with the body
        so far (None: nothing held before more body, and servers refuse an empty body before a
        pathsend). The exchange sends a complete one itself (no coroutine of `flush`'s)."""
        start = self.start
        assert start is not None
        if more_body and not self.size:
            return start, None
        chunks, body, last = self.chunks, self.body, self.last
        self.chunks, self.body, self.last = None, b"", None
        if chunks is None and last is not None and not more_body and last.get("body", b"") is body:
            return start, last  # the whole body, in the handler's own message
        if chunks is not None:
            body = b"".join(chunks)
        return start, {"type": "http.response.body", "body": body, "more_body": more_body}
