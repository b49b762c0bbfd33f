"""responses.py: the problem+json refusals and the replay of a stored response, as ASGI
messages."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from idem_middleware.errors import ProblemKind
from idem_middleware.responses import (
    DEFAULT_PROBLEM_BASE,
    problem_status,
    send_accepted,
    send_problem,
    send_replay,
    storable_headers,
)
from idem_middleware.store import StoredResponse


class Sent(list[dict[str, Any]]):
    async def __call__(self, message: dict[str, Any]) -> None:
        self.append(message)

    @property
    def headers(self) -> dict[bytes, bytes]:
        return dict(self[0]["headers"])


@pytest.mark.parametrize("kind", list(ProblemKind))
async def test_every_problem_is_rfc9457_json_with_its_status(kind: ProblemKind) -> None:
    sent = Sent()
    await send_problem(sent, kind, "why", retry_after=3, instance="/x")
    start, body = sent
    assert start["status"] == problem_status(kind)
    assert sent.headers[b"content-type"] == b"application/problem+json"
    assert sent.headers[b"retry-after"] == b"3"
    assert sent.headers[b"content-length"] == str(len(body["body"])).encode()
    problem = orjson.loads(body["body"])
    assert problem["type"] == DEFAULT_PROBLEM_BASE + kind.value
    assert problem["status"] == start["status"]
    assert problem["detail"] == "why"
    assert problem["instance"] == "/x"
    assert problem["title"]


async def test_a_problem_base_replaces_the_type_prefix() -> None:
    sent = Sent()
    await send_problem(sent, ProblemKind.MISSING_KEY, "no key", base="https://e.example/p/")
    problem = orjson.loads(sent[1]["body"])
    assert problem["type"] == "https://e.example/p/missing-key"
    assert b"retry-after" not in sent.headers
    assert "instance" not in problem


async def test_accepted_names_where_to_look() -> None:
    sent = Sent()
    await send_accepted(sent, "/status/k1", 2)
    assert sent[0]["status"] == 202
    assert sent.headers[b"location"] == b"/status/k1"
    assert sent.headers[b"retry-after"] == b"2"
    assert orjson.loads(sent[1]["body"]) == {"status": "processing", "location": "/status/k1"}


def test_per_connection_and_per_response_headers_are_never_stored() -> None:
    headers = [
        (b"Content-Type", b"application/json"),
        (b"Set-Cookie", b"s=1"),
        (b"date", b"today"),
        (b"content-length", b"9"),
        (b"x-kept", b"1"),
    ]
    assert storable_headers(headers) == [(b"Content-Type", b"application/json"), (b"x-kept", b"1")]


def test_how_long_the_first_response_took_is_never_stored() -> None:
    """Found by probing: a timing a middleware inside sets (`Server-Timing`, `X-Response-Time`,
    FastAPI's example `X-Process-Time`, `X-Runtime`) was stored and replayed for the whole
    retention: every retry was told it took the first response's time, as false as the stored
    `Date` would be (docs/decisions.md, "Date and Server are the replay's own")."""
    headers = [
        (b"Server-Timing", b"db;dur=53"),
        (b"x-response-time", b"120ms"),
        (b"X-Process-Time", b"0.120"),
        (b"x-runtime", b"0.120"),
        (b"x-kept", b"1"),
    ]
    assert storable_headers(headers) == [(b"x-kept", b"1")]


def test_headers_the_connection_header_names_are_never_stored() -> None:
    """Hop-by-hop too (RFC 9110, 7.6.1), as `Proxy-Connection` is to HTTP/2 stacks, which
    refuse it. Found by probing: both were stored and replayed."""
    headers = [
        (b"Connection", b"close, X-Hop"),
        (b"x-hop", b"1"),
        (b"Proxy-Connection", b"keep-alive"),
        (b"x-kept", b"1"),
    ]
    assert storable_headers(headers) == [(b"x-kept", b"1")]


def test_stored_headers_are_tuples_whatever_pairs_the_app_sent() -> None:
    """An app may send its header pairs as lists; the stored ones are tuples (a record is
    immutable), and an app's own tuples are kept as they are."""
    kept = (b"x-kept", b"1")
    stored = storable_headers([[b"content-type", b"a/b"], kept, [b"Date", b"today"]])
    assert stored == [(b"content-type", b"a/b"), (b"x-kept", b"1")]
    assert all(type(pair) is tuple for pair in stored)
    assert stored[1] is kept


def test_header_names_and_values_a_server_sends_other_than_bytes_are_stored_as_bytes() -> None:
    """Found by probing: a `bytearray` name (uvicorn sends it) failed the recording, so every
    transactional attempt was a 500 and a lease-mode record stayed `unknown`; a `memoryview`
    value was replayed by the in-memory store and left out by PostgreSQL's. Both are `bytes` in
    the record, in both stores; a pair of anything else, which no server sends, is left out."""
    from idem_middleware.store.postgres.rows import (
        decode_headers,
        encode_headers,
    )

    headers: list[Any] = [
        (bytearray(b"x-trace"), b"abc"),
        (b"x-receipt", memoryview(b"r-123")),
        (memoryview(b"x-view"), bytearray(b"v")),
        (bytearray(b"Date"), b"today"),
        (None, b"x"),
        (b"x-kept", b"1"),
    ]
    expected = [
        (b"x-trace", b"abc"),
        (b"x-receipt", b"r-123"),
        (b"x-view", b"v"),
        (b"x-kept", b"1"),
    ]
    stored = storable_headers(headers)
    assert stored == expected
    assert all(type(name) is bytes and type(value) is bytes for name, value in stored)
    assert decode_headers(encode_headers(stored)) == expected
    one_view = [(b"x-receipt", memoryview(b"r-123"))]  # (kept by the loop as it came)
    assert decode_headers(encode_headers(storable_headers(one_view))) == [(b"x-receipt", b"r-123")]


async def test_a_replay_is_marked_and_framed() -> None:
    sent = Sent()
    stored = StoredResponse(201, [(b"content-type", b"application/json")], b'{"a":1}')
    await send_replay(sent, stored)
    assert sent[0]["status"] == 201
    assert sent.headers[b"idempotent-replayed"] == b"true"
    assert sent.headers[b"content-length"] == b"7"
    assert sent[1]["body"] == b'{"a":1}'


async def test_a_replay_without_its_body_says_so_and_claims_no_type() -> None:
    sent = Sent()
    stored = StoredResponse(200, [(b"content-type", b"text/event-stream")], b"", "streaming")
    await send_replay(sent, stored)
    assert b"content-type" not in sent.headers
    assert sent.headers[b"idempotency-body-omitted"] == b"streaming"
    assert sent[1]["body"] == b""


async def test_a_replay_without_its_body_claims_no_encoding_either() -> None:
    """Found by probing: a gzipped response too large to keep was replayed with
    `Content-Encoding: gzip` on an empty body, which is no gzip stream."""
    sent = Sent()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-encoding", b"gzip"),
        (b"vary", b"Accept-Encoding"),
    ]
    await send_replay(sent, StoredResponse(200, headers, b"", "too-large"))
    assert b"content-encoding" not in sent.headers
    assert sent.headers[b"vary"] == b"Accept-Encoding"  # what the body is not about stays


@pytest.mark.parametrize("status", [204, 304])
async def test_a_replay_without_content_has_no_content_length(status: int) -> None:
    sent = Sent()
    await send_replay(sent, StoredResponse(status, [], b""))
    assert b"content-length" not in sent.headers


@pytest.mark.parametrize("status", [204, 304])
async def test_a_replay_without_content_sends_none_whatever_the_handler_sent(status: int) -> None:
    """Found by probing: `Response(b"x", status_code=204)` is stored with its body; uvicorn
    sends the first client none, but every replay sent it, and uvicorn raised on each (h11:
    "Too much data for declared Content-Length"; httptools: "Response content longer than
    Content-Length"), an error logged per retry."""
    sent = Sent()
    await send_replay(sent, StoredResponse(status, [(b"x-done", b"yes")], b"xyz"))
    assert sent[1]["body"] == b""
    assert b"content-length" not in sent.headers
    assert sent.headers[b"x-done"] == b"yes"


async def test_a_replay_hook_changes_the_replay_and_a_failing_one_does_not() -> None:
    stored = StoredResponse(201, [(b"x-a", b"1")], b"body")

    def hook(response: StoredResponse, scope: Any) -> StoredResponse:
        return StoredResponse(200, [(b"X-B", b"2"), (b"content-length", b"99")], b"new")

    def broken(response: StoredResponse, scope: Any) -> Any:
        return "not a response"

    changed, unchanged = Sent(), Sent()
    await send_replay(changed, stored, hook, {"method": "POST", "path": "/x"})
    await send_replay(unchanged, stored, broken, {"method": "POST", "path": "/x"})
    assert changed[0]["status"] == 200
    assert changed.headers[b"x-b"] == b"2"
    assert changed.headers[b"content-length"] == b"3"
    assert changed[1]["body"] == b"new"
    assert unchanged[0]["status"] == 201
    assert unchanged[1]["body"] == b"body"


async def test_a_replay_without_its_body_drops_every_claim_about_it() -> None:
    """Found by probing: a file too large to keep was replayed with its `Content-Digest` (a
    client checking RFC 9530 digests rejects the empty body as corrupt) and its
    `Content-Disposition: attachment` (a browser saves an empty report.csv); and a raw ASGI app's
    `Content-Type` kept its type on the empty body, as its name was not lower-case."""
    sent = Sent()
    headers = [
        (b"Content-Type", b"text/csv"),
        (b"content-disposition", b'attachment; filename="report.csv"'),
        (b"content-digest", b"sha-256=:RK/0qy18MlBSVnWgjwz6lZEWjP/lF5HF9bvEF8FabDg=:"),
        (b"repr-digest", b"sha-256=:RK/0qy18MlBSVnWgjwz6lZEWjP/lF5HF9bvEF8FabDg=:"),
        (b"content-md5", b"Q2hlY2sgSW50ZWdyaXR5IQ=="),
        (b"content-language", b"en"),
        (b"etag", b'"v7"'),
        (b"last-modified", b"Tue, 01 Jul 2025 12:00:00 GMT"),
        (b"content-location", b"/reports/7"),
    ]
    await send_replay(sent, StoredResponse(200, headers, b"", "too-large"))
    assert [name for name, _ in sent[0]["headers"]] == [
        b"etag",
        b"last-modified",
        b"content-location",
        b"idempotency-body-omitted",
        b"content-length",
        b"idempotent-replayed",
    ]
    assert sent.headers[b"content-length"] == b"0"
