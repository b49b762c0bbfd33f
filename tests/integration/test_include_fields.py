"""`Policy.include_fields`: when set, the fingerprint covers only the body members it names (less
those `exclude_fields` removes); on both stores, through the middleware."""

from __future__ import annotations

from typing import Any

import pytest

from idem_middleware import ConfigurationError, Policy
from idem_middleware.fingerprint import canonical_body
from idem_middleware.store.base import Store
from tests.apps import assert_problem, assert_replay_of, build_app, client, key

JSON = b"application/json"
FORM = {"content-type": "application/x-www-form-urlencoded"}


PAYMENT = {"amount": 5, "currency": "EUR", "meta": {"account": "acc-1", "trace": "t-1"}}
POLICY = Policy(include_fields=("amount", "/currency", "/meta/account"))


@pytest.mark.parametrize(
    "retry",
    [
        # Outside the allowlist: a member changed, one added, one removed.
        {**PAYMENT, "meta": {"account": "acc-1", "trace": "t-2"}},
        {**PAYMENT, "note": "retried by the client"},
        {"amount": 5, "currency": "EUR", "meta": {"account": "acc-1"}},
    ],
)
async def test_a_request_differing_only_outside_the_allowlist_is_replayed(
    store: Store, retry: dict[str, Any]
) -> None:
    app = build_app(store, default_policy=POLICY)
    async with client(app) as c:
        first = await c.post("/items", json=PAYMENT, headers=key("k1"))
        again = await c.post("/items", json=retry, headers=key("k1"))
    assert first.status_code == 201
    assert_replay_of(again, first)
    assert app.state.probe.calls == 1


@pytest.mark.parametrize(
    "retry",
    [
        {**PAYMENT, "amount": 6},
        {**PAYMENT, "meta": {"account": "acc-2", "trace": "t-1"}},
        # Missing is not null, and null is not missing.
        {"amount": 5, "meta": {"account": "acc-1"}},
        {**PAYMENT, "currency": None},
    ],
)
async def test_a_request_differing_inside_the_allowlist_is_422(
    store: Store, retry: dict[str, Any]
) -> None:
    app = build_app(store, default_policy=POLICY)
    async with client(app) as c:
        first = await c.post("/items", json=PAYMENT, headers=key("k1"))
        again = await c.post("/items", json=retry, headers=key("k1"))
    assert first.status_code == 201
    assert_problem(again, 422, "key-reused")
    assert app.state.probe.calls == 1


async def test_include_then_exclude(store: Store) -> None:
    # The whole order counts, less its trace id.
    app = build_app(
        store, default_policy=Policy(include_fields=("/order",), exclude_fields=("/order/trace",))
    )
    order = {"order": {"sku": "A1", "qty": 2, "trace": "t-1"}, "sent_at": "10:00"}
    async with client(app) as c:
        first = await c.post("/items", json=order, headers=key("k1"))
        noise = await c.post(
            "/items",
            json={"order": {"sku": "A1", "qty": 2, "trace": "t-2"}, "sent_at": "10:01"},
            headers=key("k1"),
        )
        changed = await c.post(
            "/items", json={"order": {"sku": "A1", "qty": 3, "trace": "t-1"}}, headers=key("k1")
        )
    assert first.status_code == 201
    assert_replay_of(noise, first)
    assert_problem(changed, 422, "key-reused")
    assert app.state.probe.calls == 1


async def test_a_form_counts_only_the_fields_named(store: Store) -> None:
    app = build_app(store, default_policy=Policy(include_fields=("amount",)))
    async with client(app) as c:
        first = await c.post("/items", content=b"amount=5&note=a", headers={**FORM, **key("k1")})
        noise = await c.post("/items", content=b"note=b&amount=5", headers={**FORM, **key("k1")})
        changed = await c.post("/items", content=b"amount=6&note=a", headers={**FORM, **key("k1")})
    assert first.status_code == 201
    assert_replay_of(noise, first)
    assert_problem(changed, 422, "key-reused")


async def test_the_query_string_still_counts_whole(store: Store) -> None:
    app = build_app(store, default_policy=Policy(include_fields=("amount",)))
    async with client(app) as c:
        first = await c.post("/items?dry_run=1", json={"amount": 5}, headers=key("k1"))
        other = await c.post("/items?dry_run=0", json={"amount": 5}, headers=key("k1"))
    assert first.status_code == 201
    assert_problem(other, 422, "key-reused")


def test_pointers_reach_into_arrays_and_escaped_names() -> None:
    def canon(body: bytes, *fields: str) -> bytes:
        return canonical_body(JSON, body, include_fields=fields)[1]

    lines = b'{"lines": [{"sku": "A"}, {"sku": "B"}], "a/b": 1, "m~n": 2}'
    assert canon(lines, "/lines/1/sku") == b'{"/lines/1/sku":"B"}'
    assert canon(lines, "/lines/2/sku", "/lines/-", "/lines/01") == b"{}"
    # A plain name is one member, "/" and "~" included; as a pointer they are escaped.
    assert canon(lines, "a/b", "m~n") == canon(lines, "/a~1b", "/m~0n")
    assert canon(lines, "a/b") == b'{"/a~1b":1}'
    # A selection is tagged apart from a whole body that looks like one.
    tag, whole = canonical_body(JSON, b'{"/a~1b":1}')
    assert whole == canon(lines, "a/b")
    assert tag != canonical_body(JSON, lines, include_fields=("a/b",))[0]


@pytest.mark.parametrize(
    "fields",
    ["amount", b"amount", ("/amount/~2",), (1,), None],
)
def test_a_bad_include_fields_is_a_configuration_error(fields: Any) -> None:
    with pytest.raises(ConfigurationError):
        Policy(include_fields=fields)
