"""Assertions on responses and reads of the test database shared by the HTTP tests."""

from __future__ import annotations

import re
from typing import Any

import httpx

# -- helpers shared by the HTTP tests ----------------------------------------------------------

PROBLEM_BASE = "urn:idem-middleware:problem:"


def key(value: str | bytes) -> dict[str, str | bytes]:
    return {"idempotency-key": value}


def assert_problem(response: httpx.Response, status: int, kind: str) -> dict[str, Any]:
    """A problem+json refusal of one kind; returns the parsed problem."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    problem: dict[str, Any] = response.json()
    assert problem["type"] == PROBLEM_BASE + kind
    assert problem["status"] == status
    assert "idempotent-replayed" not in response.headers
    return problem


def assert_replay_of(replay: httpx.Response, original: httpx.Response) -> None:
    """The same status and body as the original, marked as a replay; the original is not."""
    assert "idempotent-replayed" not in original.headers
    assert replay.headers.get("idempotent-replayed") == "true"
    assert replay.status_code == original.status_code
    assert replay.content == original.content
    assert replay.headers["content-length"] == str(len(replay.content))


async def count(pool: Any, table: str) -> int:
    assert table in {"test_ledger", "test_accounts", "idem_requests"}
    n: int = await pool.fetchval(f"SELECT count(*) FROM {table}")
    return n


async def balance(pool: Any, account: str, tenant: str = "tenant-a") -> int | None:
    value: int | None = await pool.fetchval(
        "SELECT balance FROM test_accounts WHERE tenant = $1 AND account_id = $2", tenant, account
    )
    return value


async def records(pool: Any) -> list[dict[str, Any]]:
    rows = await pool.fetch(
        "SELECT tenant, operation, idem_key, state, mode, generation, response_status, "
        "response_headers, response_body, body_omitted, expires_at FROM idem_requests "
        "ORDER BY tenant, operation, idem_key"
    )
    return [dict(row) for row in rows]


#: The bound on every wait in the HTTP tests: long enough never to flake, short enough to fail fast.


async def idle_in_transaction(pool: Any) -> int:
    """Backends of this database left inside an open transaction (a leaked claim would be one)."""
    n: int = await pool.fetchval(
        "SELECT count(*) FROM pg_stat_activity "
        "WHERE datname = current_database() AND state LIKE 'idle in transaction%'"
    )
    return n


def trail(note: str | None) -> list[str]:
    """A record's audit trail (its `note`), a line per move, each checked for its UTC stamp and
    read without it."""
    lines = (note or "").splitlines()
    for line in lines:
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ .*", line), line
    return [line.split(" ", 1)[1] for line in lines]
