"""A key from a KeySource of the app's own (a subclass of the public `KeySource`) is held to the
header's rules, as every built-in source's is ("Whatever the source, a key is held to the
header's rules", keysource.py). Its `find` answer went to the store unchecked: on PostgreSQL an
empty or oversized key was a `500` after the handler had run (a transactional handler ran again
at every retry, each answered 500), a NUL a `500`, an int or bytes a bare `500` from the
driver; on the in-memory store each was taken as a key. Now: a str outside the rules is
`400 invalid-key` naming the source, before any claim or run; anything but a str or None is
the app's bug (`ConfigurationError`, as a key function's), and nothing runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from idem_middleware import Policy
from idem_middleware.errors import ConfigurationError
from idem_middleware.keysource import KeyFromHeader, KeySource
from idem_middleware.store.base import RecordKey
from tests.apps import client, counting_pay_app, one_route_app


class Custom(KeySource):
    """The app's own source: answers `value`, whatever the request."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def describe(self) -> str:
        return "the X-Event header"

    async def find(self, scope: Any, body: bytes, *, max_json_values: int) -> Any:
        return self.value


class Text(str):
    pass


def _app(store: Any, value: Any, mode: str) -> tuple[Any, list[int]]:
    return counting_pay_app(store, mode, key_source=Custom(value))


BAD_TEXT = {
    "empty": "",
    "too long": "x" * 5000,
    "a NUL": "a\x00b",
    "non-ASCII": "é",
    "a line break": "a\nb",
}


@pytest.mark.parametrize("mode", ["transactional", "lease"])
@pytest.mark.parametrize("name", list(BAD_TEXT))
async def test_a_key_outside_the_rules_is_refused_before_any_claim(
    store: Any, name: str, mode: str
) -> None:
    app, runs = _app(store, BAD_TEXT[name], mode)
    async with client(app) as c:
        answers = [await c.post("/pay", json={}) for _ in range(2)]
    for answer in answers:
        assert answer.status_code == 400, (name, answer.text)
        assert answer.json()["type"].endswith("invalid-key")
        assert "the X-Event header" in answer.json()["detail"]
    assert runs == []


@pytest.mark.parametrize("mode", ["transactional", "lease"])
@pytest.mark.parametrize("value", [7, b"k-1", ["k-1"]], ids=["int", "bytes", "list"])
async def test_a_key_that_is_no_str_is_the_apps_error_and_nothing_runs(
    store: Any, value: Any, mode: str
) -> None:
    app, runs = _app(store, value, mode)
    async with client(app) as c:
        answer = await c.post("/pay", json={})
    assert answer.status_code == 500
    assert runs == []
    raising = httpx.ASGITransport(app=app)  # (the app's error itself, not the server's 500)
    with pytest.raises(ConfigurationError, match=f"found a {type(value).__name__}, not a str"):
        async with httpx.AsyncClient(transport=raising, base_url="http://test") as c:
            await c.post("/pay", json={}, headers={"authorization": "Bearer demo-a"})
    assert runs == []


@pytest.mark.parametrize("mode", ["transactional", "lease"])
async def test_a_valid_key_still_guards_the_request(store: Any, mode: str) -> None:
    app, runs = _app(store, Text("k-custom"), mode)
    async with client(app) as c:
        first = await c.post("/pay", json={})
        again = await c.post("/pay", json={})
    assert (first.status_code, again.status_code) == (201, 201)
    assert again.headers["idempotent-replayed"] == "true"
    assert runs == [1]
    assert await store.get(RecordKey("tenant-a", "POST /pay", "k-custom")) is not None


@dataclass(frozen=True)
class HeaderOrDefault(KeyFromHeader):
    """An app's subclass of a built-in source, with a `find` of its own: held to the rules too
    (the built-in sources' own `find` checks its key; this one's does not)."""

    default: Any = ""

    async def find(self, scope: Any, body: bytes, *, max_json_values: int) -> Any:
        return self.default


@pytest.mark.parametrize("value", ["", "a\x00b", "x" * 5000], ids=["empty", "NUL", "too long"])
async def test_a_built_in_sources_subclass_with_its_own_find_is_held_to_the_rules(
    store: Any, value: str
) -> None:
    runs: list[int] = []

    async def pay(request: Request) -> Response:
        runs.append(1)
        return JSONResponse({"run": len(runs)}, status_code=201)

    policy = Policy(key_source=HeaderOrDefault(default=value))
    app = one_route_app("/pay", pay, store=store, default_policy=policy)
    async with client(app) as c:
        answer = await c.post("/pay", json={})
    assert answer.status_code == 400, answer.text
    assert answer.json()["type"].endswith("invalid-key")
    assert runs == []


@pytest.mark.parametrize("required", [True, False])
async def test_no_key_found_is_no_key_as_before(store: Any, required: bool) -> None:
    """(None is the source's "no key here": `missing-key`, or unguarded when not required.)"""
    runs: list[int] = []

    async def pay(request: Request) -> Response:
        runs.append(1)
        return JSONResponse({"run": len(runs)}, status_code=201)

    policy = Policy(key_source=Custom(None), key_required=required)
    app = one_route_app("/pay", pay, store=store, default_policy=policy)
    async with client(app) as c:
        answer = await c.post("/pay", json={})
    if required:
        assert answer.status_code == 400, answer.text
        assert answer.json()["type"].endswith("missing-key")
        assert runs == []
    else:
        assert answer.status_code == 201, answer.text
        assert runs == [1]
