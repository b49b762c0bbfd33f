"""An operator's mistakes that `idem-middleware` used to accept, or answer with an empty result
that did not say why: each now says what was wrong (exit 2 for an argument, 1 for an id or key
that holds nothing)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from idem_middleware.outbox import purge_sent
from tests.integration.test_cli import cli, insert

_EVENTS = """
INSERT INTO idem_outbox (event_id, topic, payload, parked_at, sent_at)
VALUES ('parked-1', 't', '{}', now(), NULL), ('parked-2', 't', '{}', now(), NULL),
       ('unsent-1', 't', '{}', NULL, NULL), ('sent-1', 't', '{}', NULL, now())
"""


async def test_requeue_names_each_id_that_was_not_a_parked_event(db_dsn: str, pool: Any) -> None:
    """`outbox requeue abc` printed "requeued 0 parked events" and exited 0."""
    await pool.execute(_EVENTS)
    typo = cli("outbox", "requeue", "abc", dsn=db_dsn)
    assert typo.returncode == 1
    assert typo.stdout.splitlines() == [
        "requeued 0 parked events",
        "not requeued: abc (no such event)",
    ]
    mixed = cli(
        "outbox", "requeue", "parked-1", "unsent-1", "sent-1", "parked-1", "--json", dsn=db_dsn
    )
    assert mixed.returncode == 1
    assert json.loads(mixed.stdout) == {
        "requeued": 1,
        "requeued_ids": ["parked-1"],
        "not_requeued": {"unsent-1": "unsent", "sent-1": "sent"},
    }
    done = cli("outbox", "requeue", "parked-2", dsn=db_dsn)
    assert (done.returncode, done.stdout.strip()) == (0, "requeued 1 parked events")
    parked = await pool.fetchval("SELECT count(*) FROM idem_outbox WHERE parked_at IS NOT NULL")
    assert parked == 0


async def test_stale_with_no_pending_state_asked_for_is_refused(db_dsn: str, pool: Any) -> None:
    """`--stale` filters pending records only: `list --stale --state succeeded` listed every
    succeeded record as if it had applied."""
    await insert(pool, "done", "succeeded", expires_at=datetime.now(UTC) + timedelta(days=1))
    refused = cli("list", "--stale", "--state", "succeeded", dsn=db_dsn)
    assert refused.returncode == 2
    assert "--stale keeps the pending records whose lease lapsed" in refused.stderr
    assert refused.stdout == ""
    both = cli("list", "--stale", "--state", "succeeded", "--state", "pending", dsn=db_dsn)
    assert both.returncode == 0, both.stderr
    assert "key=done" in both.stdout


@pytest.mark.parametrize(
    ("operation", "hint"),
    [
        ("post /payouts", "did you mean 'POST /payouts'?"),
        ("/payouts", 'an operation is named "METHOD /template"'),
    ],
)
async def test_an_operation_not_named_as_operations_are_gets_a_hint(
    db_dsn: str, pool: Any, operation: str, hint: str
) -> None:
    """The method is upper case: `show --operation "post /refunds"` said only "no record
    holds this key", and `list` "no records"."""
    await insert(pool, "u1", "unknown")
    record = ("--tenant", "t", "--operation", operation, "--key", "u1")
    show = cli("show", *record, dsn=db_dsn)
    assert show.returncode == 1
    assert "no record holds this key" in show.stdout
    assert hint in show.stdout
    listed = cli("list", "--operation", operation, dsn=db_dsn)
    assert listed.returncode == 0
    assert hint in listed.stdout
    for command in (("resolve", "--to", "retry"), ("reopen",)):
        moved = cli(*command, *record, "--note", "n", dsn=db_dsn)
        assert moved.returncode == 1
        assert "no record holds this key" in moved.stderr
        assert hint in moved.stderr
    well_named = ("--tenant", "t", "--operation", "POST /payouts", "--key", "nope")
    exact = cli("show", *well_named, dsn=db_dsn)
    assert exact.stdout.strip() == "no record holds this key"  # (no hint when it is well named)


@pytest.mark.parametrize(
    ("args", "usage"),
    [
        (
            ("resolve", *("--tenant", "t", "--operation", "POST /x", "--key", "k", "--to", "ok")),
            "usage: idem-middleware resolve ",
        ),
        (("reconcile",), "usage: idem-middleware reconcile "),
        (("outbox", "publish"), "usage: idem-middleware outbox publish "),
        (("list", "--stale", "--state", "unknown"), "usage: idem-middleware list "),
        # An option the command does not take (`--again` is resolve's): its usage, naming it.
        (
            ("reopen", *("--tenant", "t", "--operation", "POST /x", "--key", "k", "--again")),
            "usage: idem-middleware reopen ",
        ),
        (("outbox", "publish", "--bogus"), "usage: idem-middleware outbox publish "),
    ],
)
def test_a_missing_argument_shows_its_commands_usage(
    db_dsn: str, args: tuple[str, ...], usage: str
) -> None:
    """The usage printed was the top-level one, naming none of the command's options."""
    args = tuple("succeeded" if arg == "ok" else arg for arg in args)  # (lines kept short)
    note = ("--note", "n") if args[0] in ("resolve", "reopen") else ()
    result = cli(*args, *note, dsn=db_dsn)
    assert result.returncode == 2
    assert result.stderr.startswith(usage), result.stderr


@pytest.mark.parametrize(
    ("dsn", "env", "says"),
    [
        (None, {}, "no database"),
        ("", {}, "--dsn is empty"),
        ("postgresql://127.0.0.1:1/x", {"IDEM_JSON": "maybe"}, "IDEM_JSON='maybe'"),
    ],
)
def test_a_missing_database_or_bad_flag_shows_its_commands_usage(
    dsn: str | None, env: dict[str, str], says: str
) -> None:
    """Refused before any connection, with the command's usage (it was the top-level one)."""
    result = cli("list", "--limit", "1", dsn=dsn, env=env)
    assert result.returncode == 2
    assert result.stderr.startswith("usage: idem-middleware list "), result.stderr
    assert says in result.stderr


def test_resolve_refuses_a_content_type_without_a_body(db_dsn: str) -> None:
    """It was dropped without a word, and never checked (a content type that is no media type
    was taken, where with --body it is refused)."""
    record = ("--tenant", "t", "--operation", "POST /x", "--key", "k", "--note", "n")
    result = cli(
        "resolve", *record, "--to", "succeeded", "--status", "201", "--content-type", "text/x",
        dsn=db_dsn,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.startswith("usage: idem-middleware resolve "), result.stderr
    assert "--content-type names the type of --body" in result.stderr


async def test_outbox_purge_deletes_the_events_sent_long_enough_ago(db_dsn: str, pool: Any) -> None:
    """Found by probing: no command deleted sent events (`purge` deletes records, tokens and
    waits), so the outbox grew for ever unless an operator found `purge_sent` in the code."""
    await pool.execute(_EVENTS)
    await pool.execute(
        "INSERT INTO idem_outbox (event_id, topic, payload, sent_at)"
        " VALUES ('sent-old', 't', '{}', now() - interval '8 days')"
    )
    week = cli("outbox", "purge", "--json", dsn=db_dsn)
    assert week.returncode == 0, week.stderr
    assert json.loads(week.stdout) == {"purged": 1, "stopped_at_limit": False}
    left = await pool.fetchval("SELECT array_agg(event_id ORDER BY event_id) FROM idem_outbox")
    assert left == ["parked-1", "parked-2", "sent-1", "unsent-1"]  # (unsent and parked kept)
    now = cli("outbox", "purge", "--older-than", "0", "--batch-size", "1", dsn=db_dsn)
    assert (now.returncode, now.stdout.strip()) == (0, "purged 1 sent events"), now.stderr
    for nonsense in (("--older-than", "nan"), ("--older-than", "-1"), ("--batch-size", "0")):
        refused = cli("outbox", "purge", *nonsense, dsn=db_dsn)
        assert refused.returncode == 2
        assert refused.stderr.startswith("usage: idem-middleware outbox purge ")
    assert await pool.fetchval("SELECT count(*) FROM idem_outbox") == 3


async def sent_events(pool: Any, count: int) -> None:
    await pool.execute(
        "INSERT INTO idem_outbox (event_id, topic, payload, sent_at)"
        " SELECT 'sent-' || i, 't', '{}', now() - interval '1 hour' FROM generate_series(1, $1) i",
        count,
    )


@pytest.mark.parametrize(
    "nonsense",
    [("--max-batches", "0"), ("--max-batches", "-5"), ("--max-batches", "many")],
)
async def test_outbox_purge_refuses_nonsense_max_batches_before_deleting_anything(
    db_dsn: str, pool: Any, nonsense: tuple[str, str]
) -> None:
    """`outbox purge` had a fixed limit of 10,000 batches and no `--max-batches` (as `purge` and
    `inbox purge` have): the option is its own, refused with the command's usage unless from 1."""
    await sent_events(pool, 3)
    refused = cli("outbox", "purge", "--older-than", "0", *nonsense, dsn=db_dsn)
    assert refused.returncode == 2
    assert refused.stderr.startswith("usage: idem-middleware outbox purge "), refused.stderr
    assert "argument --max-batches: " in refused.stderr
    assert await pool.fetchval("SELECT count(*) FROM idem_outbox") == 3


async def test_purge_sent_stops_at_max_batches_reporting_each_batch(pool: Any) -> None:
    await sent_events(pool, 5)
    seen: list[int] = []
    purged = await purge_sent(
        pool, older_than_seconds=60, batch_size=2, max_batches=2, progress=seen.append
    )
    assert (purged, seen) == (4, [2, 4])
    assert await purge_sent(pool, older_than_seconds=60, progress=seen.append) == 1
    assert seen == [2, 4, 1]
