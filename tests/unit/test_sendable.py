"""sendable.py: the response heads servers refuse, refused before an outcome is recorded."""

from __future__ import annotations

from typing import Any

import pytest

from idem_middleware.capture import ResponseCapture
from idem_middleware.sendable import UnsendableResponse, head_problem, sendable_headers

SENT = [
    (b"content-type", b"application/json"),
    (b"content-length", b"13"),
    (b"x-tab", b"a\tb"),
    (b"x-latin", "é".encode("latin-1")),
    (b"x-utf8", "€".encode()),
    (b"x-empty", b""),
    (b"X-Mixed-Case", b"v"),
    (b"!#$%&'*+.^_`|~", b"token chars"),
]


@pytest.mark.parametrize("status", [200, 201, 204, 304, 402, 599])
def test_what_servers_send_passes(status: int) -> None:
    assert head_problem(status, SENT) is None
    assert head_problem(status, ()) is None
    assert head_problem(status, [tuple(pair) for pair in SENT]) is None


@pytest.mark.parametrize(
    "status", [100, 101, 103, 199, 99, 600, 1000, -1, "201", 201.0, True, None]
)
def test_a_status_that_is_no_final_status_is_refused(status: Any) -> None:
    assert "status" in (head_problem(status, []) or "")


@pytest.mark.parametrize(
    "header",
    [
        (b"x a", b"v"),
        (b"x:a", b"v"),
        (b"", b"v"),
        (b"x\x00", b"v"),
        (b"x\n", b"v"),
        (b"\xe9", b"v"),
        (b"x-a", b"a\r\nb"),
        (b"x-a", b"a\nb"),
        (b"x-a", b"a\rb"),
        (b"x-a", b"a\x00b"),
        (b"x-a", b"a\x01b"),
        (b"x-a", b"a\x0bb"),
        (b"x-a", b"a\x7fb"),
        (b"x-a", b" v"),
        (b"x-a", b"v "),
        (b"x-a", b"v\t"),
        (b"x-a", b" "),
        (b"x-a", "v"),
        ("x-a", b"v"),
        (b"x-a", None),
        (b"x-a", b"v", b"w"),
        (b"x-a",),
        (b"Proxy-Connection", b"keep-alive"),  # (HTTP/2's h2 refuses it)
        (b"proxy-connection", b" keep-alive "),
    ],
)
def test_a_header_a_server_refuses_is_refused_wherever_it_is(header: Any) -> None:
    for headers in ([header], [*SENT, header], [header, *SENT], [SENT[0], header, SENT[1]]):
        assert "header" in (head_problem(201, headers) or "")


def test_a_value_smuggling_a_field_of_its_own_is_refused() -> None:
    """The check joins the headers with NUL and LF: a value holding both is still one value."""
    assert head_problem(201, [(b"x-a", b"a\nb\x00c")]) is not None
    assert head_problem(201, [(b"x-a", b"a\x00b")]) is not None


def test_the_refusal_names_the_header_never_quotes_its_value() -> None:
    problem = head_problem(201, [*SENT, (b"content-disposition", b'attachment; filename="s\r\n"')])
    assert "content-disposition" in (problem or "")
    assert "filename" not in (problem or "")


START = {"type": "http.response.start", "status": 201, "headers": [(b"content-type", b"a/b")]}
BODY = {"type": "http.response.body", "body": b"ok"}


class _Owner:
    def __init__(self) -> None:
        self.sent: list[Any] = []
        self.settled: list[str] = []

    async def send(self, message: Any) -> None:
        self.sent.append(message)

    async def settle_early(self, reason: str) -> None:
        self.settled.append(reason)


@pytest.mark.parametrize(
    "messages",
    [
        [{**START, "status": 101}],
        [{**START, "status": "201"}],
        # A stream is refused before it settles (it would be recorded, then refused).
        [{**START, "status": 99, "headers": [(b"content-type", b"text/event-stream")]}],
        [START, START],
        [BODY],
        [START, BODY, BODY],
    ],
)
async def test_the_capture_raises_at_the_send_and_holds_nothing(messages: list[Any]) -> None:
    owner = _Owner()
    capture = ResponseCapture(owner.send, 100, owner)
    for message in messages[:-1]:
        await capture(message)
    with pytest.raises(RuntimeError):
        await capture(messages[-1])
    assert owner.sent == []
    assert owner.settled == []
    if messages[0] is not START:
        assert capture.start is None


async def test_headers_are_not_checked_on_the_hot_path() -> None:
    """(Their check costs more than the hot path allows: a replay leaves refused ones out.)"""
    owner = _Owner()
    capture = ResponseCapture(owner.send, 100, owner)
    await capture({**START, "headers": [(b"x-a", b"a\r\nb")]})
    await capture(BODY)
    assert capture.complete


async def test_a_refused_status_is_an_unsendable_response() -> None:
    owner = _Owner()
    capture = ResponseCapture(owner.send, 100, owner)
    with pytest.raises(UnsendableResponse, match="status 103"):
        await capture({**START, "status": 103})


def test_sendable_headers_keeps_the_rest_in_order_and_names_what_it_left_out() -> None:
    bad = [(b"x-a", b"a\r\nsecret"), (b"x b", b"v"), ("x-c", b"v")]
    kept, refused = sendable_headers([SENT[0], bad[0], SENT[1], bad[1], bad[2], SENT[2]])
    assert kept == [SENT[0], SENT[1], SENT[2]]
    assert len(refused) == 3
    assert "x-a" in refused[0]
    assert "secret" not in " ".join(refused)
    assert sendable_headers(SENT) == (SENT, [])


def test_a_value_refused_only_for_an_edge_space_is_replayed_stripped() -> None:
    """The same field to HTTP, and what httptools sent the first client (h11 refused it): kept
    in the replay, trimmed, and named nowhere as refused."""
    kept, refused = sendable_headers(
        [SENT[0], (b"x-trace", b" abc \t"), (b"x-tab", b"\ta b"), (b"x-both", b" \r\n ")]
    )
    assert kept == [SENT[0], (b"x-trace", b"abc"), (b"x-tab", b"a b")]
    assert len(refused) == 1
    assert "x-both" in refused[0]  # a control character inside: left out, as ever


def test_a_pair_that_is_not_two_bytes_is_left_out_not_trimmed() -> None:
    """A `str` name or value, or a pair of three, fails the rule: left out, never trimmed (the
    trim read it as bytes, and every replay of the record raised)."""
    bad = [(b"x-a", "v "), ("x-b", b"v "), (b"x-c", b"v ", b"3"), b"x-d"]
    kept, refused = sendable_headers([SENT[0], *bad])
    assert kept == [SENT[0]]
    assert len(refused) == 4


def test_a_stored_proxy_connection_is_left_out_of_the_replay() -> None:
    """Stored before it was dropped at the store: replayed, every retry over HTTP/2 failed
    (h2 refuses it) for the whole retention. Found by review."""
    kept, refused = sendable_headers([SENT[0], (b"Proxy-Connection", b"keep-alive"), SENT[1]])
    assert kept == [SENT[0], SENT[1]]
    assert "Proxy-Connection" in refused[0]
