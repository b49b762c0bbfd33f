"""capture.py, pinned against hand-made mutants (mutation17):

- a response of exactly `max_response_bytes` is held and stored whole (only one *over* the cap
  streams, its body never stored);
- a body completed by an empty last message is held whole (the empty message is not the body);
- an outcome settled early for a response over the cap records no body, however big the chunk
  that went over it (the record would otherwise carry the bytes the cap keeps out of it).
"""

from __future__ import annotations

from typing import Any

from idem_middleware.capture import ResponseCapture
from idem_middleware.store.base import StoredResponse

START = {"type": "http.response.start", "status": 201, "headers": [(b"content-type", b"a/b")]}


def body(chunk: bytes, more: bool = False) -> dict[str, Any]:
    return {"type": "http.response.body", "body": chunk, "more_body": more}


class Owner:
    """Records what the capture would store when it settles early, as the executions do."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.capture: ResponseCapture | None = None
        self.recorded: list[StoredResponse] = []

    async def send(self, message: Any) -> None:
        self.sent.append(message)

    async def settle_early(self, reason: str) -> None:
        assert self.capture is not None
        assert not self.sent
        self.recorded.append(self.capture.stored(reason))


async def test_a_response_of_exactly_the_cap_is_held_and_stored_whole() -> None:
    owner = Owner()
    capture = owner.capture = ResponseCapture(owner.send, 4, owner)
    await capture(START)
    await capture(body(b"ab", more=True))
    await capture(body(b"cd"))
    assert owner.recorded == []
    assert not capture.passthrough
    assert capture.complete
    assert capture.stored().body == b"abcd"
    assert owner.sent == []


async def test_a_body_completed_by_an_empty_message_is_held_whole() -> None:
    owner = Owner()
    capture = owner.capture = ResponseCapture(owner.send, 100, owner)
    await capture(START)
    await capture(body(b"abc", more=True))
    await capture(body(b""))
    assert capture.complete
    assert capture.stored().body == b"abc"
    start, last = capture.held()
    assert start is START
    assert last is not None
    assert last["body"] == b"abc"
    assert not last.get("more_body", False)


async def test_an_outcome_settled_for_a_response_over_the_cap_records_no_body() -> None:
    owner = Owner()
    capture = owner.capture = ResponseCapture(owner.send, 4, owner)
    await capture(START)
    await capture(body(b"x" * 1000, more=True))
    assert capture.passthrough
    [recorded] = owner.recorded
    assert (recorded.status, recorded.body, recorded.body_omitted) == (201, b"", "too-large")
    assert owner.sent == [START, body(b"x" * 1000, more=True)]
