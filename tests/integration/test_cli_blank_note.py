"""Operator mistakes `resolve` and `reopen` refuse: an audit note with no text in it (a blank
`--note " "`), and a final state without the status retries get. Each a usage error (exit 2),
the record left as it was."""

from __future__ import annotations

from typing import Any

import pytest

from tests.integration.test_cli import cli, insert


@pytest.mark.parametrize("note", ["", " ", "\t \n"], ids=["empty", "space", "whitespace"])
@pytest.mark.parametrize(
    "command", [("resolve", "--to", "retry"), ("reopen",)], ids=["resolve", "reopen"]
)
async def test_a_blank_audit_note_is_a_usage_error(
    db_dsn: str, pool: Any, command: tuple[str, ...], note: str
) -> None:
    await insert(pool, "blank-note", "unknown")
    record = ("--tenant", "t", "--operation", "POST /payouts", "--key", "blank-note")
    result = cli(*command, *record, "--note", note, dsn=db_dsn)
    assert result.returncode == 2, result.stdout
    assert "an audit note is required" in result.stderr
    row = await pool.fetchrow("SELECT state, note FROM idem_requests WHERE idem_key = 'blank-note'")
    assert (row["state"], row["note"]) == ("unknown", None)


@pytest.mark.parametrize("to", ["succeeded", "failed_final"])
async def test_resolving_to_a_final_state_without_a_status_is_a_usage_error(
    db_dsn: str, pool: Any, to: str
) -> None:
    """The status retries would be answered with is required: exit 2 naming --status, the
    record left unknown."""
    await insert(pool, "no-status", "unknown")
    record = ("--tenant", "t", "--operation", "POST /payouts", "--key", "no-status")
    result = cli("resolve", *record, "--to", to, "--note", "n", dsn=db_dsn)
    assert result.returncode == 2, result.stdout
    assert "--status is required" in result.stderr
    state = await pool.fetchval("SELECT state FROM idem_requests WHERE idem_key = 'no-status'")
    assert state == "unknown"
