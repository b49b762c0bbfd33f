"""keysource.py: where a request's idempotency key comes from (a header, the JSON body, a
function), and what a malformed one gets."""

from __future__ import annotations

from typing import Any

import pytest

from idem_middleware.errors import ConfigurationError, ProblemKind, RequestRejected
from idem_middleware.keysource import (
    KeyFromBody,
    KeyFromFunction,
    KeyFromHeader,
    as_key_source,
)

LIMIT = 1000


def scope(*headers: tuple[bytes, bytes]) -> dict[str, Any]:
    return {"type": "http", "headers": list(headers)}


def test_a_header_is_read_like_idempotency_key() -> None:
    source = KeyFromHeader("X-Webhook-Id")
    assert source.find(scope((b"x-webhook-id", b"abc")), b"", max_json_values=LIMIT) == "abc"
    assert source.find(scope((b"x-webhook-id", b'"q-1"')), b"", max_json_values=LIMIT) == "q-1"
    assert source.find(scope(), b"", max_json_values=LIMIT) is None
    assert source.describe() == "the X-Webhook-Id header"
    assert not source.reads_body


def test_a_header_sent_twice_is_an_invalid_key() -> None:
    twice = scope((b"idempotency-key", b"a"), (b"Idempotency-Key", b"b"))
    with pytest.raises(RequestRejected) as caught:
        KeyFromHeader().find(twice, b"", max_json_values=LIMIT)
    assert caught.value.kind is ProblemKind.INVALID_KEY


@pytest.mark.parametrize("name", ["", "bad header", "x:y", 3])
def test_a_header_source_needs_a_header_name(name: Any) -> None:
    with pytest.raises(ConfigurationError):
        KeyFromHeader(name)


@pytest.mark.parametrize(
    ("body", "key"),
    [
        (b'{"event": {"id": "evt-1"}}', "evt-1"),
        (b'{"event": {"id": 1000}}', "1000"),
        (b'{"event": {"id": 1e3}}', "1000"),
        # One key, however spelt: the fingerprint's mark for an integer no double holds spelt
        # with a fraction (fingerprint.md) is not part of it.
        (b'{"event": {"id": 9007199254740993.0}}', "9007199254740993"),
        (b'{"event": {"id": null}}', None),
        (b'{"event": {}}', None),
        (b"", None),
    ],
)
def test_a_body_member_by_json_pointer(body: bytes, key: str | None) -> None:
    source = KeyFromBody("/event/id")
    assert source.reads_body
    assert source.find(scope(), body, max_json_values=LIMIT) == key


@pytest.mark.parametrize(
    ("body", "kind"),
    [
        (b'{"event": {"id": 1.5}}', ProblemKind.INVALID_KEY),
        (b'{"event": {"id": [1]}}', ProblemKind.INVALID_KEY),
        (b'{"event": {"id": true}}', ProblemKind.INVALID_KEY),
        (b"not json", ProblemKind.BODY_INVALID),
    ],
)
def test_a_body_member_that_is_no_key_is_refused(body: bytes, kind: ProblemKind) -> None:
    with pytest.raises(RequestRejected) as caught:
        KeyFromBody("/event/id").find(scope(), body, max_json_values=LIMIT)
    assert caught.value.kind is kind


def test_a_body_source_needs_a_json_pointer() -> None:
    with pytest.raises(ConfigurationError, match="JSON Pointer"):
        KeyFromBody("event_id")


async def test_a_function_source_sync_or_async() -> None:
    def sync(scope: Any, body: bytes) -> str | None:
        return body.decode() or None

    async def async_(scope: Any, body: bytes) -> str | None:
        return "from-async"

    assert await KeyFromFunction(sync).find(scope(), b"k-1", max_json_values=LIMIT) == "k-1"
    assert await KeyFromFunction(sync).find(scope(), b"", max_json_values=LIMIT) is None
    assert await KeyFromFunction(async_).find(scope(), b"", max_json_values=LIMIT) == "from-async"
    assert KeyFromFunction(sync, where="the event").describe() == "the event"


async def test_a_function_source_is_held_to_the_key_rules_and_its_type() -> None:
    with pytest.raises(RequestRejected) as caught:
        await KeyFromFunction(lambda s, b: "bad key\n").find(scope(), b"", max_json_values=LIMIT)
    assert caught.value.kind is ProblemKind.INVALID_KEY
    with pytest.raises(ConfigurationError, match="not str or None"):
        await KeyFromFunction(lambda s, b: 7).find(scope(), b"", max_json_values=LIMIT)
    with pytest.raises(ConfigurationError, match=r"must take \(scope, body\)"):
        KeyFromFunction(lambda: "k")  # type: ignore[arg-type]
    # `where` names the source in the problem a client gets: `3` was taken, and shown as "3".
    with pytest.raises(ConfigurationError, match="where=3 is not a str"):
        KeyFromFunction(lambda s, b: "k", where=3)  # type: ignore[arg-type]


def test_as_key_source() -> None:
    header = KeyFromHeader()
    assert as_key_source(None) is None
    assert as_key_source(header) is header
    assert isinstance(as_key_source(lambda s, b: None), KeyFromFunction)
    with pytest.raises(ConfigurationError, match="KeyFromHeader"):
        as_key_source("X-Id")
    with pytest.raises(ConfigurationError):
        as_key_source(42)
