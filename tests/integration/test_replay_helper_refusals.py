"""`idem_replay` (the pytest plugin's helper) fails a pair it should not pass: a first response
that is a replay already (the key was used by an earlier test, so the handler never ran), and a
replay whose status or body differs from the first response's. Each passed silently before: the
test using it then checked nothing it claimed to. And a client whose `request` returns an
awaitable without being a coroutine function is a TypeError saying what to give instead."""

from __future__ import annotations

from typing import Any

import httpx
import pytest


class Canned:
    """A synchronous client answering the given responses in turn."""

    def __init__(self, *responses: httpx.Response) -> None:
        self.responses = list(responses)

    def request(self, method: str, url: str, **options: Any) -> httpx.Response:
        return self.responses.pop(0)


REPLAYED = {"idempotent-replayed": "true"}


def test_a_first_response_that_is_a_replay_fails(idem_replay: Any) -> None:
    client = Canned(
        httpx.Response(201, json={"id": 1}, headers=REPLAYED),
        httpx.Response(201, json={"id": 1}, headers=REPLAYED),
    )
    with pytest.raises(AssertionError, match="already a replay"):
        idem_replay(client, "POST", "/things", json={})


def test_a_replay_with_another_status_fails(idem_replay: Any) -> None:
    client = Canned(
        httpx.Response(201, json={"id": 1}),
        httpx.Response(200, json={"id": 1}, headers=REPLAYED),
    )
    with pytest.raises(AssertionError, match="replay's status is 200"):
        idem_replay(client, "POST", "/things", json={})


def test_a_replay_with_another_body_fails(idem_replay: Any) -> None:
    client = Canned(
        httpx.Response(201, json={"id": 1}),
        httpx.Response(201, json={"id": 2}, headers=REPLAYED),
    )
    with pytest.raises(AssertionError, match="body differs"):
        idem_replay(client, "POST", "/things", json={})


def test_an_awaitable_from_a_plain_function_is_refused(idem_replay: Any) -> None:
    async def answer() -> httpx.Response:
        return httpx.Response(201)

    class Wrapped:
        def request(self, method: str, url: str, **options: Any) -> Any:
            return answer()  # (a sync wrapper around an async client)

    with pytest.raises(TypeError, match="not a coroutine function"):
        idem_replay(Wrapped(), "POST", "/things", json={})
