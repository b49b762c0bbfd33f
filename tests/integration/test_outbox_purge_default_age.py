"""`outbox purge` without `--older-than` keeps events sent less than 7 days ago (the default its
help states, 604800 seconds: `cli._parser`'s `default=7 * 86400.0`). A shorter default would
delete, unasked, the sent events an operator keeps a week to look into a consumer's complaint."""

from __future__ import annotations

import json
from typing import Any

from tests.integration.test_cli import cli


async def test_outbox_purge_by_default_deletes_only_events_sent_over_seven_days_ago(
    db_dsn: str, pool: Any
) -> None:
    await pool.execute(
        "INSERT INTO idem_outbox (event_id, topic, payload, sent_at) VALUES"
        " ('sent-2-days', 't', '{}', now() - interval '2 days'),"
        " ('sent-6-days-23-hours', 't', '{}', now() - interval '6 days 23 hours'),"
        " ('sent-7-days-1-hour', 't', '{}', now() - interval '7 days 1 hour')"
    )
    week = cli("outbox", "purge", "--json", dsn=db_dsn)
    assert week.returncode == 0, week.stderr
    assert json.loads(week.stdout) == {"purged": 1, "stopped_at_limit": False}
    left = await pool.fetchval("SELECT array_agg(event_id ORDER BY event_id) FROM idem_outbox")
    assert left == ["sent-2-days", "sent-6-days-23-hours"]
    help_text = " ".join(cli("outbox", "purge", "--help").stdout.split())
    assert "(default 604800: 7 days)" in help_text  # (what it says is what it does)
