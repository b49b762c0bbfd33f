"""The example app's bounds (docs/example-app.md): the bank's fault delays, the durations the app
takes from the environment, and where `--workers N` > 1 says its bank runs."""

from __future__ import annotations

import logging
import re
import signal
from typing import Any

import httpx
import pytest
import uvicorn

from example_app.bank import create_bank_app
from example_app.supervisor import SUPERVISOR_ENV

#: The longest fault delay the bank takes, as docs/example-app.md states it.
MAX_DELAY_MS = 2147483647


def bank_client() -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=create_bank_app(), client=("127.0.0.1", 40000))
    return httpx.AsyncClient(transport=transport, base_url="http://bank", timeout=5)


@pytest.mark.parametrize("fault", ["delay_ms", "webhook_delay_ms"])
async def test_a_delay_longer_than_the_bank_takes_is_refused(fault: str) -> None:
    """Before, `{"delay_ms": 10**400}` was accepted, and every transfer after it was recorded,
    then answered a plain 500 (no float holds the delay in seconds); the webhooks' the same."""
    async with bank_client() as c:
        for delay in (10**400, MAX_DELAY_MS + 1):
            refused = await c.post("/_faults", json={fault: delay})
            assert refused.status_code == 400, refused.text
        faults = (await c.post("/_faults", json={fault: MAX_DELAY_MS})).json()
        assert faults[fault] == MAX_DELAY_MS  # the longest one is taken
        assert (await c.post("/_faults", json={})).status_code == 200
        # Refused, they changed nothing: the bank answers at once.
        assert (await c.post("/_faults", json={fault: 10**400})).status_code == 400
        transfer = await c.post(
            "/transfers", json={"account": "a", "amount": 1}, headers={"idempotency-key": "k"}
        )
        assert transfer.status_code == 201, transfer.text
        event = {"event_id": "e1", "topic": "t", "payload": 1}
        webhook = await c.post("/webhooks", json=event, headers={"idempotency-key": "e1"})
        assert webhook.status_code == 200, webhook.text


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("EXAMPLE_LEASE_SECONDS", "0.05", "lease_seconds must be at least 0.1 seconds"),
        ("EXAMPLE_LEASE_SECONDS", "1e12", "lease_seconds must be at most 3153600000 seconds"),
        ("EXAMPLE_WAIT_SECONDS", "1e12", "wait_seconds must be at most 3153600000 seconds"),
    ],
)
def test_a_duration_the_library_refuses_is_refused_naming_the_variable(
    name: str, value: str, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, the library's ConfigurationError stopped startup, naming no variable."""
    from example_app.app import create_app

    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=re.escape(f"{name}={value!r} is refused: {message}")):
        create_app("postgresql://unused/x")


def test_the_shortest_lease_is_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    from example_app.app import create_app

    monkeypatch.setenv("EXAMPLE_LEASE_SECONDS", "0.1")
    monkeypatch.setenv("EXAMPLE_WAIT_SECONDS", "3153600000")
    create_app("postgresql://unused/x")


def test_several_workers_print_where_their_bank_is(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before, the shared bank's random port was printed nowhere, and the documented /bank
    commands answered 404 with more than one worker."""
    from example_app import __main__ as entry

    bank_url = "http://127.0.0.1:54321"
    ran: dict[str, Any] = {}
    monkeypatch.setattr(entry, "resolve_database_url", lambda: "postgresql://db/x")
    monkeypatch.setattr(entry, "_start_bank", lambda host: bank_url)
    monkeypatch.setattr(uvicorn, "run", lambda *args, **kwargs: ran.update(kwargs))
    monkeypatch.setattr(signal, "signal", lambda *args: None)
    monkeypatch.setattr(logging, "basicConfig", lambda **kwargs: None)
    for name in ("DATABASE_URL", "BANK_URL", SUPERVISOR_ENV):
        monkeypatch.setenv(name, "")  # restored (or removed) after the test
        monkeypatch.delenv(name)
    entry.main(["--workers", "2"])
    assert ran["workers"] == 2
    out = capsys.readouterr().out
    assert f"example_app bank: {bank_url}\n" in out
    assert f"POST {bank_url}/_faults" in out
