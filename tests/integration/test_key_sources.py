"""Where the key comes from (`Policy.key_source`): a named header, a JSON body member, a
function of the request; on both stores, with the header's validation and the tenant's scope."""

from __future__ import annotations

from typing import Any

import asyncpg
import pytest
from starlette.types import Scope

from idem_middleware import (
    ConfigurationError,
    KeyFromBody,
    KeyFromFunction,
    KeyFromHeader,
    Mode,
    Policy,
    ProblemKind,
    RequestRejected,
)
from idem_middleware.store.base import Store
from tests.apps import assert_problem, assert_replay_of, build_app, client, key

JSON = {"content-type": "application/json"}
CREDIT = "/accounts/acc-1/credits"


def webhook_id(scope: Scope, body: bytes) -> str | None:
    for name, value in scope["headers"]:
        if name == b"x-webhook-id":
            return value.decode("latin-1") or None
    return None


async def async_webhook_id(scope: Scope, body: bytes) -> str | None:
    return webhook_id(scope, body)


# -- each source: the key it reads replays, and the default header no longer counts ----------


@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
async def test_a_named_header_is_the_key(store: Store, mode: Mode) -> None:
    app = build_app(
        store, default_policy=Policy(key_source=KeyFromHeader("X-Request-Id"), mode=mode)
    )
    async with client(app) as c:
        first = await c.post(CREDIT, json={"amount": 5}, headers={"x-request-id": "req-1"})
        again = await c.post(CREDIT, json={"amount": 5}, headers={"x-request-id": '"req-1"'})
        other = await c.post(CREDIT, json={"amount": 5}, headers={"x-request-id": "req-2"})
        idem_only = await c.post(CREDIT, json={"amount": 5}, headers=key("req-1"))
    assert first.status_code == 201
    # Read as Idempotency-Key is: an sf-string and a bare token carry the same key.
    assert_replay_of(again, first)
    assert other.status_code == 201
    problem = assert_problem(idem_only, 400, "missing-key")
    assert "X-Request-Id header" in problem["detail"]
    assert app.state.probe.calls == 2


@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
async def test_a_body_member_is_the_key(store: Store, mode: Mode) -> None:
    app = build_app(store, default_policy=Policy(key_source=KeyFromBody("/event/id"), mode=mode))
    event = {"event": {"id": "evt_1", "type": "charge.succeeded"}, "amount": 7}
    async with client(app) as c:
        first = await c.post(CREDIT, json=event)
        again = await c.post(CREDIT, json=event)
        other = await c.post(CREDIT, json={**event, "event": {"id": "evt_2"}})
    assert first.status_code == 201
    # The handler read the body the key source had already read.
    assert first.json()["amount"] == 7
    assert_replay_of(again, first)
    assert other.status_code == 201
    assert app.state.probe.calls == 2


async def test_an_integer_member_is_rendered_canonically(store: Store) -> None:
    app = build_app(store, default_policy=Policy(key_source=KeyFromBody("/id")))
    async with client(app) as c:
        first = await c.post(CREDIT, content=b'{"id": 42, "amount": 1}', headers=JSON)
        # 4.2e1 is the integer 42: the same key and, canonically, the same request.
        again = await c.post(CREDIT, content=b'{"amount": 1, "id": 4.2e1}', headers=JSON)
        # The string "42" is the same key too, but a different request.
        text = await c.post(CREDIT, content=b'{"id": "42", "amount": 1}', headers=JSON)
    assert first.status_code == 201
    assert_replay_of(again, first)
    assert_problem(text, 422, "key-reused")
    assert app.state.probe.calls == 1


@pytest.mark.parametrize("function", [webhook_id, async_webhook_id])
async def test_a_function_of_the_request_is_the_key(store: Store, function: Any) -> None:
    app = build_app(store, default_policy=Policy(key_source=function))
    async with client(app) as c:
        first = await c.post(CREDIT, json={"amount": 3}, headers={"x-webhook-id": "wh-1"})
        again = await c.post(CREDIT, json={"amount": 3}, headers={"x-webhook-id": "wh-1"})
        missing = await c.post(CREDIT, json={"amount": 3}, headers=key("wh-1"))
    assert first.status_code == 201
    assert_replay_of(again, first)
    problem = assert_problem(missing, 400, "missing-key")
    assert function.__qualname__ in problem["detail"]
    assert app.state.probe.calls == 1


async def test_a_function_can_name_where_it_looks(store: Store) -> None:
    source = KeyFromFunction(webhook_id, where="the X-Webhook-Id header")
    app = build_app(store, default_policy=Policy(key_source=source))
    async with client(app) as c:
        missing = await c.post(CREDIT, json={"amount": 3})
    problem = assert_problem(missing, 400, "missing-key")
    assert problem["detail"].endswith("reads it from the X-Webhook-Id header.")


# -- missing and invalid keys: the header's problems, naming the source -----------------------


@pytest.mark.parametrize(
    ("body", "where"),
    [
        (b'{"amount": 1}', "/event/id"),
        (b'{"event": {"id": null}, "amount": 1}', "/event/id"),
        (b'{"event": "evt_1", "amount": 1}', "/event/id"),
        (b"", "/event/id"),
    ],
)
async def test_a_missing_body_member_is_400_missing_key(
    store: Store, body: bytes, where: str
) -> None:
    app = build_app(store, default_policy=Policy(key_source=KeyFromBody("/event/id")))
    async with client(app) as c:
        r = await c.post(CREDIT, content=body, headers={**JSON, **key("k1")})
    problem = assert_problem(r, 400, "missing-key")
    assert f"the JSON body's member {where}" in problem["detail"]
    assert app.state.probe.calls == 0


@pytest.mark.parametrize(
    ("body", "kind", "detail"),
    [
        (b'{"event": {"id": true}}', "invalid-key", "must be a string or an integer"),
        (b'{"event": {"id": {"x": 1}}}', "invalid-key", "must be a string or an integer"),
        (b'{"event": {"id": 1.5}}', "invalid-key", "not an integer"),
        (b'{"event": {"id": ""}}', "invalid-key", "1 to 255 printable ASCII"),
        (b'{"event": {"id": "' + b"x" * 256 + b'"}}', "invalid-key", "1 to 255"),
        ('{"event": {"id": "évt"}}'.encode(), "invalid-key", "printable ASCII"),
        (b'{"event": {"id": "a\\u0000b"}}', "invalid-key", "printable ASCII"),
        (b'{"event": {"id": "evt_1"}', "body-invalid", "not valid JSON"),
        (b'{"event": {"id": "evt_1", "id": "evt_2"}}', "body-invalid", "duplicate"),
    ],
)
async def test_an_invalid_body_member_is_refused_before_any_claim(
    store: Store, body: bytes, kind: str, detail: str
) -> None:
    app = build_app(store, default_policy=Policy(key_source=KeyFromBody("/event/id")))
    async with client(app) as c:
        r = await c.post(CREDIT, content=body, headers=JSON)
    problem = assert_problem(r, 400, kind)
    assert detail in problem["detail"]
    assert app.state.probe.calls == 0


@pytest.mark.parametrize(
    ("headers", "detail"),
    [
        ({"x-request-id": "x" * 256}, "The X-Request-Id must be 1 to 255"),
        ({"x-request-id": '"unterminated'}, "The X-Request-Id header is not a valid"),
        ([("x-request-id", "a"), ("X-Request-Id", "b")], "X-Request-Id header must be sent only"),
    ],
)
async def test_an_invalid_header_key_is_400_invalid_key_naming_the_header(
    store: Store, headers: Any, detail: str
) -> None:
    app = build_app(store, default_policy=Policy(key_source=KeyFromHeader("X-Request-Id")))
    async with client(app) as c:
        r = await c.post(CREDIT, json={"amount": 1}, headers=headers)
    problem = assert_problem(r, 400, "invalid-key")
    assert detail in problem["detail"]
    assert app.state.probe.calls == 0


async def test_a_function_key_is_held_to_the_header_rules(store: Store) -> None:
    app = build_app(store, default_policy=Policy(key_source=lambda scope, body: "caf\u00e9"))
    async with client(app) as c:
        r = await c.post(CREDIT, json={"amount": 1})
    problem = assert_problem(r, 400, "invalid-key")
    assert "printable ASCII" in problem["detail"]
    assert app.state.probe.calls == 0


async def test_a_function_may_refuse_the_request_with_its_own_problem(store: Store) -> None:
    def refuse(scope: Scope, body: bytes) -> str | None:
        raise RequestRejected(ProblemKind.INVALID_KEY, "The webhook id is not one of ours.")

    app = build_app(store, default_policy=Policy(key_source=refuse))
    async with client(app) as c:
        r = await c.post(CREDIT, json={"amount": 1})
    problem = assert_problem(r, 400, "invalid-key")
    assert problem["detail"] == "The webhook id is not one of ours."
    assert app.state.probe.calls == 0


async def test_a_function_returning_a_non_string_is_a_server_error(store: Store) -> None:
    app = build_app(store, default_policy=Policy(key_source=lambda scope, body: 42))
    async with client(app) as c:
        r = await c.post(CREDIT, json={"amount": 1})
    assert r.status_code == 500
    assert app.state.probe.calls == 0


async def test_a_header_source_never_reads_the_body(store: Store) -> None:
    # A missing key is refused before the body: an oversized one is not even looked at.
    policy = Policy(key_source=KeyFromHeader("X-Request-Id"), max_body_bytes=10)
    app = build_app(store, default_policy=policy)
    async with client(app) as c:
        r = await c.post(CREDIT, json={"amount": 1, "pad": "x" * 100})
    assert_problem(r, 400, "missing-key")


async def test_a_body_source_keeps_the_body_cap(store: Store) -> None:
    policy = Policy(key_source=KeyFromBody("/id"), max_body_bytes=10)
    app = build_app(store, default_policy=policy)
    async with client(app) as c:
        r = await c.post(CREDIT, json={"id": "k1", "amount": 1})
    assert_problem(r, 413, "body-too-large")
    assert app.state.probe.calls == 0


async def test_without_a_required_key_the_app_gets_the_body_the_source_read(
    store: Store, pool: asyncpg.Pool[Any]
) -> None:
    policy = Policy(key_source=KeyFromBody("/event/id"), key_required=False)
    # (`pool`: the unguarded credit writes in a transaction of its own.)
    app = build_app(store, default_policy=policy, pool=pool)
    async with client(app) as c:
        first = await c.post(CREDIT, json={"amount": 4})
        second = await c.post(CREDIT, json={"amount": 4})
    # Unprotected, so run twice; the handler read the whole body both times.
    assert first.status_code == second.status_code == 201
    assert first.json()["amount"] == second.json()["amount"] == 4
    assert app.state.probe.calls == 2


# -- tenant scope -------------------------------------------------------------------------------


async def test_two_tenants_with_the_same_body_key_are_two_requests(store: Store) -> None:
    app = build_app(store, default_policy=Policy(key_source=KeyFromBody("/event/id")))
    event = {"event": {"id": "evt_shared"}, "amount": 2}
    async with client(app, "demo-a") as a, client(app, "demo-b") as b:
        first_a = await a.post(CREDIT, json=event)
        first_b = await b.post(CREDIT, json=event)
        again_a = await a.post(CREDIT, json=event)
        again_b = await b.post(CREDIT, json=event)
    assert first_a.status_code == first_b.status_code == 201
    assert first_a.json()["call"] == 1
    assert first_b.json()["call"] == 2
    assert_replay_of(again_a, first_a)
    assert_replay_of(again_b, first_b)
    assert app.state.probe.calls == 2


# -- configuration ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "build",
    [
        lambda: KeyFromHeader("X Request Id"),
        lambda: KeyFromHeader(""),
        lambda: KeyFromBody("event.id"),
        lambda: KeyFromBody(""),
        lambda: KeyFromBody("/event/~2"),
        lambda: Policy(key_source="X-Request-Id"),
        lambda: Policy(key_source=42),
        lambda: Policy(key_source=lambda scope: None),
        lambda: KeyFromFunction("not callable"),  # type: ignore[arg-type]
    ],
)
def test_a_bad_key_source_is_a_configuration_error(build: Any) -> None:
    with pytest.raises(ConfigurationError):
        build()
