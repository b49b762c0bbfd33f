"""capture.py: a handler's response is held until its outcome is recorded, or settled early and
streamed when it cannot be held."""

from __future__ import annotations

from typing import Any

import pytest

from idem_middleware.capture import ResponseCapture

START = {"type": "http.response.start", "status": 201, "headers": [(b"content-type", b"a/b")]}


class Recorder:
    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.settled: list[str] = []

    async def send(self, message: Any) -> None:
        self.sent.append(message)

    async def settle_early(self, reason: str) -> None:
        assert not self.sent, "settled after a byte left"
        self.settled.append(reason)


def body(chunk: bytes, more: bool = False) -> dict[str, Any]:
    return {"type": "http.response.body", "body": chunk, "more_body": more}


async def test_a_small_response_is_held_whole_and_sent_on_flush() -> None:
    r = Recorder()
    capture = ResponseCapture(r.send, 100, r)
    await capture(START)
    await capture(body(b"ab", more=True))
    await capture(body(b"cd"))
    assert r.sent == []
    assert r.settled == []
    assert capture.complete
    assert not capture.passthrough
    assert capture.status == 201
    stored = capture.stored()
    assert (stored.status, stored.body, stored.body_omitted) == (201, b"abcd", None)
    assert stored.headers == [(b"content-type", b"a/b")]
    await capture.flush()
    assert r.sent == [START, body(b"abcd")]


async def test_a_response_over_the_cap_settles_then_streams_through() -> None:
    r = Recorder()
    capture = ResponseCapture(r.send, 3, r)
    await capture(START)
    await capture(body(b"ab", more=True))
    await capture(body(b"cd", more=True))
    assert r.settled == ["too-large"]
    assert capture.passthrough
    await capture(body(b"ef"))
    assert r.sent == [START, body(b"abcd", more=True), body(b"ef")]
    assert capture.stored("too-large").body == b""


@pytest.mark.parametrize(
    "second",
    [
        pytest.param(None, id="event-stream"),
        pytest.param({"type": "http.response.trailers", "headers": []}, id="extension"),
    ],
)
async def test_what_cannot_be_held_settles_as_streaming_before_its_first_byte(
    second: dict[str, Any] | None,
) -> None:
    r = Recorder()
    capture = ResponseCapture(r.send, 1000, r)
    if second is None:
        await capture({**START, "headers": [(b"content-type", b"text/event-stream")]})
    else:
        await capture(START)
        await capture(second)
    assert r.settled == ["streaming"]
    assert capture.passthrough
    assert r.sent[0]["type"] == "http.response.start"


async def test_a_body_before_the_start_is_an_error() -> None:
    r = Recorder()
    capture = ResponseCapture(r.send, 0, r)
    with pytest.raises(RuntimeError, match=r"before http\.response\.start"):
        await capture(body(b"x"))


async def test_after_close_a_late_settle_is_refused() -> None:
    r = Recorder()
    capture = ResponseCapture(r.send, 0, r)
    await capture(START)
    capture.close()
    with pytest.raises(RuntimeError, match="after the request ended"):
        await capture(body(b"too late"))
    assert r.settled == []


@pytest.mark.parametrize("as_list", [True, False])
async def test_the_last_content_type_decides_whether_a_response_streams(as_list: bool) -> None:
    """Response headers as a list are read through a dict (built in C), any other iterable by
    a scan: either way the last Content-Type counts, as a dict of the headers would have it."""
    for types, streams in (
        ((b"text/event-stream", b"a/b"), False),
        ((b"a/b", b"text/event-stream; charset=utf-8"), True),
        # A media type's case means nothing (RFC 9110): one held was a stream's connection held
        # to its end, with its transaction open.
        ((b"Text/Event-Stream",), True),
        ((b" TEXT/EVENT-STREAM;charset=utf-8",), True),
        ((b"text/event-streams",), True),  # (a prefix, as before)
        ((b"text/event",), False),
    ):
        headers = [(b"content-type", t) for t in types] + [(b"x-a", b"1")]
        r = Recorder()
        capture = ResponseCapture(r.send, 100, r)
        start = {**START, "headers": headers if as_list else tuple(headers)}
        await capture(start)
        assert capture.passthrough is streams
        assert r.settled == (["streaming"] if streams else [])


@pytest.mark.parametrize(
    ("name", "value", "streams"),
    [
        # A name in capitals, which servers send as well (Django's own handler keeps them): an
        # event stream held was a stream's first byte held to its end, its connection with it.
        (b"Content-Type", b"text/event-stream", True),
        (bytearray(b"CONTENT-TYPE"), b"text/event-stream", True),
        (b"Content-Typo", b"text/event-stream", False),
        (memoryview(b"Content-Type"), b"text/event-stream", True),
        ("Content-Type", b"text/event-stream", True),  # (h11 takes a str name)
        # Not Content-Type, of its length or not a bytes object: passed by, never raised on.
        (memoryview(b"x-request-id"), b"text/event-stream", False),
        (b"x-request-id", b"text/event-stream", False),
        (5, b"text/event-stream", False),
        # A value that is no bytes object but sent all the same (a memoryview under uvicorn's
        # httptools, a str under h11): the capture raised, a 500 for a response servers send.
        (b"content-type", memoryview(b"text/event-stream"), True),
        (b"content-type", bytearray(b"text/plain"), False),
        (b"content-type", "text/event-stream", True),
        (b"content-type", "text/plain", False),
        (b"content-type", 5, False),
    ],
)
async def test_a_content_type_servers_send_is_read_whatever_its_names_case_or_its_values_type(
    name: Any, value: Any, streams: bool
) -> None:
    r = Recorder()
    capture = ResponseCapture(r.send, 100, r)
    await capture({**START, "headers": [(name, value)]})
    assert capture.passthrough is streams
    assert r.settled == (["streaming"] if streams else [])


async def test_a_capture_without_an_owner_settles_early_by_its_own_method() -> None:
    """A subclass that is its own owner (the transactional attempt) overrides `settle_early`;
    a plain capture made without an owner cannot settle, and says so before any byte leaves."""
    r = Recorder()

    class Own(ResponseCapture):
        async def settle_early(self, reason: str) -> None:
            r.settled.append("own " + reason)

    own = Own(r.send, 1)
    await own(START)
    await own(body(b"too large", more=True))
    assert r.settled == ["own too-large"]
    assert r.sent == [START, body(b"too large", more=True)]

    bare = ResponseCapture(r.send, 0)
    await bare(START)
    with pytest.raises(TypeError, match="must override settle_early"):
        await bare(body(b"x"))
    assert len(r.sent) == 2  # nothing more left


@pytest.mark.parametrize(
    "messages",
    [
        [body(b"abc")],  # the usual: the whole body at once
        [body(b"", more=True), body(b"abc")],  # an empty chunk first
        [{"type": "http.response.body", "body": b"abc"}],  # more_body left out
        [{"type": "http.response.body"}],  # no body at all
    ],
)
async def test_a_body_sent_in_one_message_is_held_and_sent_on_as_that_message(
    messages: list[dict[str, Any]],
) -> None:
    """No list and no message of the capture's own for the usual response: the handler's
    message completing the body is what the server gets, its body what is stored."""
    r = Recorder()
    capture = ResponseCapture(r.send, 100, r)
    await capture(START)
    for message in messages:
        await capture(message)
    assert capture.complete
    assert capture.chunks is None
    expected = messages[-1].get("body", b"")
    assert capture.stored().body == expected
    await capture.flush()
    assert r.sent[0] is START
    assert r.sent[1] is messages[-1]
    assert len(r.sent) == 2


async def test_a_body_in_pieces_is_joined_and_sent_in_a_message_of_the_captures_own() -> None:
    r = Recorder()
    capture = ResponseCapture(r.send, 100, r)
    last = body(b"c")
    await capture(START)
    await capture(body(b"a", more=True))
    await capture(body(b"", more=True))
    await capture(body(b"b", more=True))
    await capture(last)
    assert capture.stored().body == b"abc"
    await capture.flush()
    assert r.sent == [START, body(b"abc")]
    assert r.sent[1] is not last
    # Flushed once: what it held is let go.
    assert (capture.body, capture.chunks, capture.last) == (b"", None, None)


async def test_a_body_going_over_the_cap_with_its_last_message_is_settled_and_sent_whole() -> None:
    """The message that takes the body over the cap settles it as too large; what was held
    (its chunks joined) is sent at once, as the end of the body."""
    r = Recorder()
    capture = ResponseCapture(r.send, 3, r)
    await capture(START)
    await capture(body(b"ab", more=True))
    await capture(body(b"cd"))
    assert r.settled == ["too-large"]
    assert r.sent == [START, body(b"abcd")]


@pytest.mark.parametrize("kind", ["generator", "dict items", "map"])
async def test_headers_in_any_iterable_reach_the_client_and_the_record(kind: str) -> None:
    """ASGI allows any iterable of pairs: one read once (a generator) is read once, and what it
    held goes to the server and into the stored response alike."""
    pairs = [(b"content-type", b"a/b"), (b"x-a", b"1")]
    headers: Any = {
        "generator": (pair for pair in pairs),
        "dict items": dict(pairs).items(),
        "map": map(tuple, pairs),
    }[kind]
    r = Recorder()
    capture = ResponseCapture(r.send, 100, r)
    await capture({**START, "headers": headers})
    await capture(body(b"{}"))
    assert capture.stored().headers == pairs
    await capture.flush()
    assert list(r.sent[0]["headers"]) == pairs


async def test_a_held_chunk_is_a_copy_of_a_buffer_the_app_refills() -> None:
    """Found by probing: a stream of memoryviews of one buffer the app refills (Starlette passes
    them on as they come) was held by reference, so the client and every replay got the last
    chunk's bytes in place of the earlier ones (`BBBBBBBB`, not `AAAABBBB`)."""
    r = Recorder()
    capture = ResponseCapture(r.send, 100, r)
    buffer = bytearray(b"AAAA")
    await capture(START)
    await capture(body(memoryview(buffer), more=True))  # type: ignore[arg-type]
    buffer[:] = b"BBBB"
    await capture(body(memoryview(buffer)))  # type: ignore[arg-type]
    buffer[:] = b"CCCC"
    assert capture.stored().body == b"AAAABBBB"
    await capture.flush()
    assert b"".join(bytes(m["body"]) for m in r.sent[1:]) == b"AAAABBBB"


def test_an_attempt_sets_every_field_of_its_capture_as_the_capture_would() -> None:
    """`transactional.Attempt` sets the capture's fields itself (no `ResponseCapture.__init__`
    call per attempt): each one set, to what the capture's own `__init__` sets."""
    from types import SimpleNamespace

    from idem_middleware.transactional import Attempt

    async def send(message: Any) -> None: ...

    policy = SimpleNamespace(max_response_bytes=123)
    ex: Any = SimpleNamespace(send=send, policy=policy)
    attempt = Attempt(ex, None, b"f", None)  # type: ignore[arg-type]
    capture = ResponseCapture(send, 123)
    for name in ResponseCapture.__slots__:
        assert getattr(attempt, name) == getattr(capture, name), name
