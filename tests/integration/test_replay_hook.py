"""`Policy.replay_hook`: adjusts a replayed response, never a first execution; a hook that fails
leaves the stored response to be replayed unchanged. On both stores, in both modes."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import pytest
from starlette.types import Scope

from idem_middleware import (
    ConfigurationError,
    Mode,
    Policy,
    StoredResponse,
)
from idem_middleware.store.base import Store
from tests.apps import assert_problem, assert_replay_of, build_app, client, key


class Hook:
    """Adds `x-replay-of` to a replay and remembers what it was given."""

    def __init__(self) -> None:
        self.seen: list[tuple[StoredResponse, Scope]] = []

    def __call__(self, response: StoredResponse, scope: Scope) -> StoredResponse:
        self.seen.append((response, scope))
        return dataclasses.replace(
            response, headers=[*response.headers, (b"x-replay-of", scope["path"].encode())]
        )


@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
async def test_a_replay_gets_the_hooks_header_and_the_first_execution_does_not(
    store: Store, mode: Mode
) -> None:
    hook = Hook()
    app = build_app(store, default_policy=Policy(replay_hook=hook, mode=mode))
    async with client(app) as c:
        first = await c.post("/items", json={"a": 1}, headers=key("k1"))
        assert hook.seen == []
        again = await c.post("/items", json={"a": 1}, headers=key("k1"))
        reused = await c.post("/items", json={"a": 2}, headers=key("k1"))
    assert "x-replay-of" not in first.headers
    assert_replay_of(again, first)
    assert again.headers["x-replay-of"] == "/items"
    # A refusal is not a replay.
    assert_problem(reused, 422, "key-reused")
    assert len(hook.seen) == 1
    seen, scope = hook.seen[0]
    # An immutable view of what was stored.
    assert isinstance(seen.headers, tuple)
    assert seen.status == 201
    assert seen.body == first.content
    assert scope["method"] == "POST"


async def test_an_async_hook_may_change_the_status_and_body(store: Store) -> None:
    async def hook(response: StoredResponse, scope: Scope) -> StoredResponse:
        # A hook's framing and replay marker are the middleware's business: dropped.
        headers = [
            *response.headers,
            (b"Content-Length", b"999"),
            (b"idempotent-replayed", b"false"),
        ]
        return StoredResponse(200, headers, b'{"replayed":true}')

    app = build_app(store, default_policy=Policy(replay_hook=hook))
    async with client(app) as c:
        first = await c.post("/items", json={}, headers=key("k1"))
        again = await c.post("/items", json={}, headers=key("k1"))
    assert first.status_code == 201
    assert again.status_code == 200
    assert again.content == b'{"replayed":true}'
    assert again.headers.get_list("content-length") == [str(len(again.content))]
    assert again.headers.get_list("idempotent-replayed") == ["true"]


async def test_a_hook_returning_none_leaves_the_replay_unchanged(store: Store) -> None:
    calls: list[int] = []

    def hook(response: StoredResponse, scope: Scope) -> None:
        calls.append(response.status)

    app = build_app(store, default_policy=Policy(replay_hook=hook))
    async with client(app) as c:
        first = await c.post("/items", json={}, headers=key("k1"))
        again = await c.post("/items", json={}, headers=key("k1"))
    assert_replay_of(again, first)
    assert sorted(again.headers.raw) == sorted(
        [*first.headers.raw, (b"idempotent-replayed", b"true")]
    )
    assert calls == [201]


def _raises(response: StoredResponse, scope: Scope) -> StoredResponse:
    raise RuntimeError("hook bug")


async def _raises_async(response: StoredResponse, scope: Scope) -> StoredResponse:
    raise RuntimeError("hook bug")


def _returns_a_dict(response: StoredResponse, scope: Scope) -> Any:
    return {"status": 200}


def _returns_a_bad_header(response: StoredResponse, scope: Scope) -> StoredResponse:
    return dataclasses.replace(response, headers=[(b"x-bad", b"a\r\nset-cookie: s=1")])


def _returns_a_str_header(response: StoredResponse, scope: Scope) -> StoredResponse:
    """Found by probing: the refusal's message (logged with its traceback) quoted the header
    whole, and a header value may carry what the body does (a card, a session)."""
    return dataclasses.replace(response, headers=[(b"x-card", "4242-secret")])


def _returns_a_header_with_a_line_break(response: StoredResponse, scope: Scope) -> StoredResponse:
    return dataclasses.replace(response, headers=[(b"x-card", b"4242-secret\r\nx-bad: 1")])


@pytest.mark.parametrize(
    "hook",
    [
        _raises,
        _raises_async,
        _returns_a_dict,
        _returns_a_bad_header,
        _returns_a_str_header,
        _returns_a_header_with_a_line_break,
    ],
)
async def test_a_failing_hook_is_logged_and_the_stored_response_replayed(
    store: Store, hook: Any, caplog: pytest.LogCaptureFixture
) -> None:
    app = build_app(store, default_policy=Policy(replay_hook=hook))
    body = {"card": "4242-secret"}
    async with client(app) as c:
        first = await c.post("/items", json=body, headers=key("k-secret-1"))
        with caplog.at_level(logging.ERROR, logger="idem_middleware"):
            again = await c.post("/items", json=body, headers=key("k-secret-1"))
    assert_replay_of(again, first)
    assert "x-bad" not in again.headers
    assert app.state.probe.calls == 1
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1
    assert "replay hook failed on POST /items" in errors[0].getMessage()
    assert errors[0].exc_info is not None
    # Neither the body nor the key reaches the log.
    text = caplog.text
    assert "4242-secret" not in text
    assert "k-secret-1" not in text


@pytest.mark.parametrize("hook", ["add-header", 42])
def test_a_hook_that_is_not_callable_is_a_configuration_error(hook: Any) -> None:
    with pytest.raises(ConfigurationError):
        Policy(replay_hook=hook)
