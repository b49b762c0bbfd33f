"""bench.cpu.drive: the paths it sends name the accounts in turn, or a new one each request."""

from __future__ import annotations

import asyncio
from typing import Any

from bench.cpu import drive


def _paths(accounts: int) -> list[str]:
    paths: list[str] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        paths.append(scope["path"])
        await receive()
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    statuses = asyncio.run(drive(app, 12, "t", 4, accounts))
    assert statuses == {201: 12}
    return paths


def test_paths_cycle_through_the_accounts() -> None:
    assert len(set(_paths(3))) == 3


def test_accounts_zero_puts_a_new_account_in_every_path() -> None:
    paths = _paths(0)
    assert len(set(paths)) == 12
    assert all(p.startswith("/accounts/acct-t-") and p.endswith("/credits") for p in paths)
