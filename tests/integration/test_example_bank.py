"""The example app's in-process bank simulator is a test double: under `/bank` it answers
loopback clients only, and the app's idempotency middleware leaves it alone; what it and the
app's settings (EXAMPLE_TOKENS) accept."""

from __future__ import annotations

import httpx
import pytest

from example_app.app import create_app
from example_app.bank import create_bank_app
from example_app.settings import parse_tokens


def client(app: object, host: str) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, client=(host, 40000))  # type: ignore[arg-type]
    return httpx.AsyncClient(transport=transport, base_url="http://app")


@pytest.mark.parametrize("path", ["/bank/transfers", "/bank/webhooks"])
async def test_the_mounted_bank_refuses_other_machines(db_dsn: str, path: str) -> None:
    app = create_app(db_dsn)
    async with client(app, "203.0.113.7") as c:
        assert (await c.get(path)).status_code == 403
        assert (await c.post("/bank/_faults", json={"fail_status": 500})).status_code == 403
    async with client(app, "127.0.0.1") as c:
        assert (await c.get(path)).status_code == 200
        # The fault switch is still reached as before (no tenant, no key: not guarded).
        faults = await c.post("/bank/_faults", json={})
        assert faults.status_code == 200, faults.text
    async with client(app, "::1") as c:
        assert (await c.get(path)).status_code == 200


async def test_the_standalone_bank_answers_its_network() -> None:
    """Run as its own process (docker compose), the app reaches it from another address."""
    async with client(create_bank_app(), "172.18.0.3") as c:
        assert (await c.get("/transfers")).status_code == 200


@pytest.mark.parametrize("status", ["abc", 99, 600, 1.5, True, 100, 101, 204, 205, 304])
@pytest.mark.parametrize("fault", ["fail_status", "fail_after_record"])
async def test_a_fault_status_http_cannot_send_is_refused(fault: str, status: object) -> None:
    """Found by probing: `{"fail_status": "abc"}` (or 99, or true) was accepted, and every
    transfer after it was a 500 or a dropped connection instead of the injected status. So was a
    status that is no final answer (1xx) or carries no body (204, 205, 304): uvicorn refused the
    bank's error body after its headers ("Response content longer than Content-Length")."""
    async with client(create_bank_app(), "127.0.0.1") as c:
        refused = await c.post("/_faults", json={fault: status})
        assert refused.status_code == 400, refused.text
        transfer = await c.post(
            "/transfers", json={"account": "a", "amount": 1}, headers={"idempotency-key": "k"}
        )
        assert transfer.status_code == 201  # the refused fault changed nothing
        assert (await c.post("/_faults", json={fault: 503})).status_code == 200


@pytest.mark.parametrize(
    "body",
    [
        b"{",
        b"[1]",
        b'{"delay_ms": 1e400}',
        b'{"delay_ms": -5}',
        b'{"delay_ms": "5"}',
        b'{"webhook_delay_ms": true}',
        b'{"delay_ms": 1.5}',
    ],
)
async def test_a_fault_switch_that_is_not_a_json_object_of_integers_is_a_400(body: bytes) -> None:
    """Found by probing: a body that was not JSON, or a delay of 1e400, answered 500 (the
    parse and int() ran outside the check); "5", true and -5 were taken as delays."""
    async with client(create_bank_app(), "127.0.0.1") as c:
        refused = await c.post("/_faults", content=body)
        faults = (await c.post("/_faults")).json()  # an empty body clears them
    assert refused.status_code == 400, refused.text
    assert faults == {
        "delay_ms": 0,
        "fail_after_record": None,
        "fail_status": None,
        "webhook_delay_ms": 0,
    }


@pytest.mark.parametrize(
    "body",
    [
        {"account": "a", "amount": 1.9},
        {"account": "a", "amount": True},
        {"account": "a", "amount": "5"},
        {"account": 7, "amount": 1},
        {"amount": 1},
        [],
    ],
)
async def test_a_transfer_is_a_string_account_and_an_integer_amount(body: object) -> None:
    """Found by probing: the bank took `int()` and `str()` of whatever came: an amount of 1.9
    moved 1, `true` moved 1, and an account 7 became "7". The contract says
    `{"account": str, "amount": int}`: anything else is a 400, and nothing is recorded."""
    async with client(create_bank_app(), "127.0.0.1") as c:
        refused = await c.post("/transfers", json=body, headers={"idempotency-key": "k"})
        listed = (await c.get("/transfers")).json()
    assert refused.status_code == 400, refused.text
    assert listed == []


def test_a_token_named_twice_in_example_tokens_is_refused() -> None:
    """Found by probing: `EXAMPLE_TOKENS="t:tenant-a,t:tenant-b"` started, and `t` was tenant-b's
    without a word (the last entry won); the app now refuses to start."""
    assert parse_tokens("a:tenant-a, b:tenant-b") == {"a": "tenant-a", "b": "tenant-b"}
    with pytest.raises(ValueError, match="twice"):
        parse_tokens("t:tenant-a,t:tenant-b")


def test_example_tokens_set_but_empty_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """`EXAMPLE_TOKENS=""` (a deployment's variable left blank) served the demo tokens without a
    word; set but empty is now refused at startup, as any other entry that is not token:tenant."""
    monkeypatch.setenv("EXAMPLE_TOKENS", "")
    with pytest.raises(ValueError, match="not token:tenant"):
        create_app("postgresql://127.0.0.1:1/none")
