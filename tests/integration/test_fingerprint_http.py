"""The fingerprint through the middleware: requests a handler reads differently are never
replayed for each other, and the caps refuse before anything is claimed."""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Callable

import pytest

from idem_middleware import Policy
from tests.apps import assert_problem, build_app, client, count, key

JSON = {"content-type": "application/json"}
FORM = {"content-type": "application/x-www-form-urlencoded"}


@pytest.mark.parametrize(
    ("headers", "first", "second"),
    [
        # The finding: Starlette's request.json() reads a form-typed body as JSON (5, then 500).
        (FORM, b'{"amount":5,"%61mount":500}', b'{"amount":5,"amount":500}'),
        (JSON, b'{"amount":9007199254740993.0}', b'{"amount":9007199254740992}'),
        (JSON, b'{"amount":0.1}', b'{"amount":0.1000000000000000055511151231257827}'),
        # One exact value, but request.json() reads the integer exactly and the other spelling
        # as the nearest double: 9007199254740993 and 9007199254740992.0.
        (JSON, b'{"amount":9007199254740993}', b'{"amount":9007199254740993.0}'),
        (JSON, b'{"amount":100000000000000000000000}', b'{"amount":1e23}'),
    ],
)
async def test_a_body_read_differently_is_422_not_a_replay(
    pg_store, pool, headers: dict[str, str], first: bytes, second: bytes
) -> None:
    app = build_app(pg_store)
    async with client(app) as c:
        original = await c.post("/items", content=first, headers={**headers, **key("k1")})
        other = await c.post("/items", content=second, headers={**headers, **key("k1")})
    assert original.status_code == 201
    assert_problem(other, 422, "key-reused")
    assert app.state.probe.calls == 1


@pytest.mark.parametrize(
    ("url", "headers", "body", "detail"),
    [
        ("/items?" + "a&" * 5 + "a", {}, b"", "The query string may hold at most 5 fields."),
        ("/items", FORM, b"a=1&" * 5 + b"a=1", "A form body may hold at most 5 fields."),
        ("/items", JSON, b"[" + b"1," * 7 + b"1]", "at most 7 values"),
    ],
)
async def test_over_the_field_caps_is_400_too_many_fields_and_nothing_is_claimed(
    pg_store, pool, url: str, headers: dict[str, str], body: bytes, detail: str
) -> None:
    app = build_app(pg_store, default_policy=Policy(max_fields=5, max_json_values=7))
    async with client(app) as c:
        r = await c.post(url, content=body, headers={**headers, **key("k1")})
    problem = assert_problem(r, 400, "too-many-fields")
    assert detail in problem["detail"]
    assert app.state.probe.calls == 0
    assert await count(pool, "idem_requests") == 0


@pytest.mark.parametrize(
    "content_type",
    ["application/json", "application/merge-patch+json", "application/json; charset=latin-1"],
)
async def test_an_empty_body_under_a_json_type_is_served_as_a_bodyless_post(
    pg_store, pool, content_type: str
) -> None:
    """Clients send a JSON content type on bodyless POSTs too (an action endpoint such as a
    capture): nothing was sent, so the request is simply empty, as it is under any other type
    or none, and an endpoint that takes no body serves it (it was a 400 body-invalid, which the
    same app without the middleware never answered). Its retry is a replay, and the same empty
    request without the content type is the same request."""
    app = build_app(pg_store)
    async with client(app) as c:
        headers = {"content-type": content_type, **key("k1")}
        first = await c.post("/items", content=b"", headers=headers)
        again = await c.post("/items", content=b"", headers=headers)
        untyped = await c.post("/items", content=b"", headers=key("k1"))
    assert first.status_code == 201, first.text
    assert again.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
    assert untyped.headers["idempotent-replayed"] == "true"
    assert app.state.probe.calls == 1
    assert await count(pool, "idem_requests") == 1


@pytest.mark.parametrize(
    ("content_type", "encoding", "compress"),
    [
        ("application/json", "gzip", gzip.compress),
        ("application/json", "deflate", zlib.compress),
        ("application/x-www-form-urlencoded", "gzip", gzip.compress),
    ],
    ids=["json-gzip", "json-deflate", "form-gzip"],
)
async def test_a_compressed_body_is_refused_saying_it_was_not_decoded(
    pg_store, pool, content_type: str, encoding: str, compress: Callable[[bytes], bytes]
) -> None:
    """Found by probing: a gzipped JSON body was refused as "not valid UTF-8", and a deflated
    one as not JSON, which sent the client looking for a defect in the document it had
    compressed. Bodies count as they arrive (docs/fingerprint.md); the refusal now says the
    Content-Encoding was not decoded."""
    app = build_app(pg_store)
    document = b'{"amount": 5}' if content_type == "application/json" else b"amount=5"
    headers = {"content-type": content_type, "content-encoding": encoding, **key("k1")}
    async with client(app) as c:
        r = await c.post("/items", content=compress(document), headers=headers)
        # Not compressed, or said to be as sent: a defect is only the document's.
        identity = {**JSON, "content-encoding": "identity", **key("k2")}
        broken = await c.post("/items", content=b'{"amount": }', headers=identity)
    assert "Content-Encoding" in assert_problem(r, 400, "body-invalid")["detail"]
    assert "Content-Encoding" not in assert_problem(broken, 400, "body-invalid")["detail"]
    assert app.state.probe.calls == 0
    assert await count(pool, "idem_requests") == 0


async def test_a_json_body_of_ascii_bytes_labelled_iso_8859_1_is_served_and_replayed(
    pg_store, pool
) -> None:
    """Older clients label every body ISO-8859-1: ASCII bytes say the same in UTF-8, and the app's
    JSON reader decodes UTF-8 whatever the label, so the request is served (it was 400), and the
    same body labelled UTF-8 is its replay. Non-ASCII bytes under that label are still refused:
    the client meant Latin-1, the app would read UTF-8."""
    latin = {"content-type": "application/json; charset=ISO-8859-1"}
    utf8 = {"content-type": "application/json; charset=utf-8"}
    app = build_app(pg_store)
    async with client(app) as c:
        first = await c.post("/items", content=b'{"a": 1}', headers={**latin, **key("k1")})
        again = await c.post("/items", content=b'{"a":1}', headers={**utf8, **key("k1")})
        accented = await c.post("/items", content=b'{"a": "\xe9"}', headers={**latin, **key("k2")})
    assert first.status_code == 201, first.text
    assert again.headers["idempotent-replayed"] == "true"
    assert_problem(accented, 400, "body-invalid")
    assert app.state.probe.calls == 1
    assert await count(pool, "idem_requests") == 1
