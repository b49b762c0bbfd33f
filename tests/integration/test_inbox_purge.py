"""`idem-middleware inbox purge` and `inbox.purge_inbox`: consumers' inbox rows recorded long
enough ago are deleted in bounded batches (before, nothing deleted them: `idem_inbox` grew for
ever). Rows younger than the age are kept, so their events' redeliveries stay no-ops. Its stop at
`--max-batches` and its report of a failure partway are `outbox purge`'s too, tested for both."""

from __future__ import annotations

import argparse
import json
from datetime import timedelta
from typing import Any

import pytest

from idem_middleware import cli_commands
from idem_middleware.errors import StoreError
from idem_middleware.inbox import purge_inbox
from idem_middleware.outbox import consume_once
from idem_middleware.store.postgres import PostgresStore
from tests.integration.test_cli import cli
from tests.integration.test_cli_mistakes import sent_events

_ROWS = """
INSERT INTO idem_inbox (consumer, event_id, received_at)
VALUES ('ledger', 'old-1', now() - interval '40 days'),
       ('ledger', 'old-2', now() - interval '31 days'),
       ('mail', 'old-1', now() - interval '31 days'),
       ('ledger', 'week', now() - interval '8 days'),
       ('ledger', 'new', now())
"""
_LEFT = "SELECT array_agg(consumer || '/' || event_id ORDER BY consumer, event_id) FROM idem_inbox"


async def _old_rows(pool: Any, count: int) -> None:
    await pool.execute(
        "INSERT INTO idem_inbox (consumer, event_id, received_at)"
        " SELECT 'ledger', 'event-' || i, now() - interval '1 hour' FROM generate_series(1, $1) i",
        count,
    )


async def test_inbox_purge_deletes_the_rows_recorded_long_enough_ago(
    db_dsn: str, pool: Any
) -> None:
    await pool.execute(_ROWS)
    month = cli("inbox", "purge", "--json", dsn=db_dsn)  # (the default age: 30 days)
    assert month.returncode == 0, month.stderr
    assert json.loads(month.stdout) == {"purged": 3, "stopped_at_limit": False}
    assert await pool.fetchval(_LEFT) == ["ledger/new", "ledger/week"]
    day = cli("inbox", "purge", "--older-than", "86400", "--batch-size", "1", dsn=db_dsn)
    assert (day.returncode, day.stdout.strip()) == (0, "purged 1 inbox rows"), day.stderr
    assert await pool.fetchval(_LEFT) == ["ledger/new"]
    async with pool.acquire() as conn, conn.transaction():
        # The row kept makes its event's redelivery a no-op; the purged one's would be applied
        # again, which is why the age must outlast every redelivery.
        assert await consume_once(conn, "ledger", "new") is False
        assert await consume_once(conn, "ledger", "week") is True


@pytest.mark.parametrize(
    "nonsense",
    [
        ("--older-than", "nan"),
        ("--older-than", "inf"),
        ("--older-than", "-1"),
        ("--batch-size", "0"),
        ("--batch-size", "many"),
        ("--max-batches", "0"),
        ("--max-batches", "-5"),
    ],
)
async def test_inbox_purge_refuses_nonsense_arguments_before_deleting_anything(
    db_dsn: str, pool: Any, nonsense: tuple[str, str]
) -> None:
    await pool.execute(_ROWS)
    refused = cli("inbox", "purge", "--older-than", "0", *nonsense, dsn=db_dsn)
    assert refused.returncode == 2
    assert refused.stderr.startswith("usage: idem-middleware inbox purge "), refused.stderr
    assert await pool.fetchval("SELECT count(*) FROM idem_inbox") == 5


# (kind: the table, the command, what its report calls the rows, how old rows are made)
_KINDS = {
    "inbox": ("idem_inbox", "inbox", "inbox rows", _old_rows),
    "outbox": ("idem_outbox", "outbox", "sent events", sent_events),
}


@pytest.mark.parametrize("kind", _KINDS)
async def test_an_aged_purge_stops_at_max_batches_and_says_so(
    db_dsn: str, pool: Any, kind: str
) -> None:
    """`outbox purge` had a fixed 10,000 batches, and said nothing when it stopped there: one
    deleting fewer events each run than are sent meanwhile fell behind for ever, silently."""
    table, command, what, rows = _KINDS[kind]
    await rows(pool, 5)
    args = (command, "purge", "--older-than", "60", "--batch-size", "2", "--max-batches", "2")
    first = cli(*args, "--json", dsn=db_dsn)
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout) == {"purged": 4, "stopped_at_limit": True}
    assert f"{command} purge stopped at --max-batches (2 batches of 2)" in first.stderr
    assert await pool.fetchval(f"SELECT count(*) FROM {table}") == 1
    second = cli(*args, dsn=db_dsn)
    assert (second.returncode, second.stdout.strip(), second.stderr) == (
        0,
        f"purged 1 {what}",
        "",
    )


# (kind: rows 1 to 5 aged 1 to 5 hours, inserted youngest first; the ids of the rows left)
_AGED = {
    "inbox": (
        "INSERT INTO idem_inbox (consumer, event_id, received_at) SELECT 'ledger', i::text,"
        " now() - make_interval(hours => i) FROM generate_series(1, 5) i",
        "SELECT array_agg(event_id ORDER BY event_id) FROM idem_inbox",
    ),
    "outbox": (
        "INSERT INTO idem_outbox (event_id, topic, payload, sent_at) SELECT i::text, 't', '{}',"
        " now() - make_interval(hours => i) FROM generate_series(1, 5) i",
        "SELECT array_agg(event_id ORDER BY event_id) FROM idem_outbox",
    ),
}


@pytest.mark.parametrize("kind", _AGED)
async def test_an_aged_purge_stopped_at_its_limit_deleted_the_oldest_first(
    db_dsn: str, pool: Any, kind: str
) -> None:
    """`outbox purge`'s batches had no order: one stopped at `--max-batches` deleted whichever
    qualifying events the scan met first (here the youngest), not the oldest."""
    rows, left = _AGED[kind]
    await pool.execute(rows)
    args = ("--older-than", "60", "--batch-size", "2", "--max-batches", "1", "--json")
    purged = cli(kind, "purge", *args, dsn=db_dsn)
    assert purged.returncode == 0, purged.stderr
    assert json.loads(purged.stdout) == {"purged": 2, "stopped_at_limit": True}
    assert await pool.fetchval(left) == ["1", "2", "3"]


@pytest.mark.parametrize(
    "options",
    [
        {"batch_size": 0},
        {"batch_size": -1},
        {"batch_size": 1.5},
        {"batch_size": True},
        {"max_batches": 0},
        {"max_batches": 2**31},
        {"older_than_seconds": float("nan")},
        {"older_than_seconds": float("inf")},
        {"older_than_seconds": -1.0},
        {"older_than_seconds": timedelta(days=30)},
    ],
)
async def test_purge_inbox_refuses_what_cannot_work_before_any_statement(
    pool: Any, options: dict[str, Any]
) -> None:
    await pool.execute(_ROWS)
    with pytest.raises(ValueError, match=next(iter(options))):
        await purge_inbox(pool, **{"older_than_seconds": 0.0, **options})
    assert await pool.fetchval("SELECT count(*) FROM idem_inbox") == 5


async def test_purge_inbox_refuses_a_progress_it_cannot_call_before_any_statement(
    pool: Any,
) -> None:
    """`progress=5` was a TypeError ("'int' object is not callable") raised after the first
    batch was deleted and committed, where the docstring promised a ValueError first."""
    await _old_rows(pool, 5)
    with pytest.raises(ValueError, match=r"progress .*\(a callable, or None\), not the int 5"):
        await purge_inbox(pool, older_than_seconds=60, batch_size=2, progress=5)  # type: ignore[arg-type]
    assert await pool.fetchval("SELECT count(*) FROM idem_inbox") == 5


@pytest.mark.parametrize(
    ("given", "named"),
    [
        (
            "postgresql://app:s3cret@db.example/app",
            "not a value of type str: for a DSN, pass `await asyncpg",
        ),
        (None, "not None"),
        (42, "not a value of type int"),
    ],
)
async def test_purge_inbox_refuses_what_is_no_pool_naming_what_it_was_given(
    given: Any, named: str
) -> None:
    """A DSN as the first argument was an AttributeError ("'str' object has no attribute
    'acquire'"), and None a ValueError naming `pool=` and `dsn=`, arguments the caller never
    used. The DSN's password is not repeated."""
    with pytest.raises(
        ValueError, match=r"^purge_inbox: the first argument is an asyncpg pool"
    ) as no:
        await purge_inbox(given, older_than_seconds=60)
    assert named in str(no.value)
    assert "s3cret" not in str(no.value)


async def test_purge_inbox_deletes_in_batches_reporting_each(pool: Any) -> None:
    await _old_rows(pool, 5)
    await pool.execute("INSERT INTO idem_inbox (consumer, event_id) VALUES ('ledger', 'fresh')")
    seen: list[int] = []
    assert await purge_inbox(pool, older_than_seconds=60, batch_size=2, progress=seen.append) == 5
    assert seen == [2, 4, 5]
    assert await pool.fetchval(_LEFT) == ["ledger/fresh"]


@pytest.mark.parametrize("kind", _KINDS)
async def test_an_aged_purge_the_database_fails_partway_says_what_it_deleted(
    pool: Any, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    """`outbox purge` said only the error: the batches it had committed were counted nowhere."""
    table, command, what, rows = _KINDS[kind]
    await rows(pool, 5)
    store = PostgresStore(pool=pool, listen=False)
    run = store._run
    calls = [0]

    async def failing(*args: Any) -> Any:
        calls[0] += 1
        if calls[0] == 2:
            raise StoreError("connection lost")
        return await run(*args)

    store._run = failing  # type: ignore[method-assign]
    args = argparse.Namespace(
        command=command,
        outbox_command="purge",
        json=True,
        older_than=60.0,
        batch_size=2,
        max_batches=10,
    )
    with pytest.raises(cli_commands.Interrupted) as stopped:
        await getattr(cli_commands, command)(store, args)
    assert str(stopped.value).startswith(f"{command} purge stopped after deleting 2 {what}")
    assert "committed; run it again)" in str(stopped.value)  # (a lost connection: it may pass)
    report = json.loads(capsys.readouterr().out)
    assert report == {"purged": 2, "stopped_at_limit": False, "error": "connection lost"}
    assert await pool.fetchval(f"SELECT count(*) FROM {table}") == 3


async def test_purge_sent_refuses_what_purge_inbox_refuses_before_any_statement(
    db_dsn: str,
) -> None:
    """The outbox's purge took a progress it could not call (a TypeError after its first batch
    was deleted) and a DSN for a pool (an AttributeError), as the inbox's did."""
    from idem_middleware.outbox import purge_sent

    with pytest.raises(ValueError, match="purge_sent: progress is called"):
        await purge_sent(object(), older_than_seconds=0, progress=5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="for a DSN, pass") as caught:
        await purge_sent(db_dsn, older_than_seconds=0)
    assert db_dsn not in str(caught.value)
