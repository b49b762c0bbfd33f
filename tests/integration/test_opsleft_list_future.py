"""`idem-middleware list` shows a record whose updated_at is ahead of the database's clock (a
clock stepped back since it was written, an edit by hand), last. Every page was bounded by the
first page's now(), so it was left out: `stats` counted it, and `list --state unknown` said
"no records in state unknown"."""

from __future__ import annotations

import json
from typing import Any

import pytest

from idem_middleware.cli_list import records
from idem_middleware.store.base import State
from idem_middleware.store.postgres import PostgresStore
from tests.integration.test_cli import cli, insert

_AHEAD = {"soon": "now() + interval '1 hour'", "never": "'infinity'"}


async def _records(pool: Any) -> None:
    """Pending `old` (10 min ago) and `now`; `soon` (pending, an hour ahead), and `never`
    (unknown, at infinity)."""
    await insert(pool, "old", "pending", age=600)
    await insert(pool, "now", "pending")
    await insert(pool, "soon", "pending")
    await insert(pool, "never", "unknown")
    for key, ahead in _AHEAD.items():
        await pool.execute(
            f"UPDATE idem_requests SET updated_at = {ahead} WHERE idem_key = $1", key
        )


async def test_list_shows_records_changed_ahead_of_the_clock_last(db_dsn: str, pool: Any) -> None:
    await _records(pool)
    listed = cli("list", "--json", dsn=db_dsn)
    assert listed.returncode == 0, listed.stderr
    assert [json.loads(line)["key"] for line in listed.stdout.splitlines()] == [
        "old",
        "now",
        "soon",
        "never",
    ]
    unknown = cli("list", "--state", "unknown", dsn=db_dsn)
    assert unknown.returncode == 0, unknown.stderr
    assert "key=never" in unknown.stdout
    assert "no records" not in unknown.stdout
    stats = json.loads(cli("stats", "--json", "--unresolved", dsn=db_dsn).stdout)
    assert stats["counts"] == {"pending": 3, "unknown": 1}  # as many as listed
    assert stats["oldest_age_seconds"]["unknown"] == "-Infinity"


@pytest.mark.db_routes("partitioned")
async def test_in_pages_each_once_and_a_record_moved_meanwhile_still_not_twice(
    pool: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    await _records(pool)
    store = PostgresStore(pool=pool, listen=False)
    real = store.list_page
    pages: list[int] = []

    async def page(state: State, **kwargs: Any) -> Any:
        found = await real(state, **kwargs)
        pages.append(len(found))
        if len(pages) == 2:  # `old`, listed, is moved: changed after the listing began
            await pool.execute("UPDATE idem_requests SET updated_at = now() WHERE idem_key = 'old'")
        return found

    monkeypatch.setattr(store, "list_page", page)
    states = [State.PENDING, State.UNKNOWN]
    listed = [r.key.key async for r in records(store, states=states, limit=100, page_size=1)]
    assert listed == ["old", "now", "soon", "never"]


async def test_a_record_at_minus_infinity_merges_with_another_states(
    db_dsn: str, pool: Any
) -> None:
    """asyncpg gives '-infinity' as a naive datetime.min: merged with another state's records
    (aware), `list` failed with a traceback (TypeError)."""
    await insert(pool, "first", "pending")
    await insert(pool, "second", "unknown")
    await pool.execute("UPDATE idem_requests SET updated_at = '-infinity' WHERE idem_key = 'first'")
    listed = cli("list", dsn=db_dsn)
    assert listed.returncode == 0, listed.stderr
    assert [line.split("key=")[1].split()[0] for line in listed.stdout.splitlines()] == [
        "first",
        "second",
    ]


async def test_a_record_at_infinity_after_another_merges_with_another_states(
    db_dsn: str, pool: Any
) -> None:
    """'infinity' (a naive datetime.max) as the record that follows another of its state:
    pushed on the merge beside another state's head (aware), a TypeError."""
    await insert(pool, "first", "pending", age=60)
    await insert(pool, "last", "pending")
    await insert(pool, "middle", "unknown", age=30)
    await pool.execute("UPDATE idem_requests SET updated_at = 'infinity' WHERE idem_key = 'last'")
    listed = cli("list", dsn=db_dsn)
    assert listed.returncode == 0, listed.stderr
    assert [line.split("key=")[1].split()[0] for line in listed.stdout.splitlines()] == [
        "first",
        "middle",
        "last",
    ]
