"""`reconcile --limit` is a whole number from 1 (`cli._parser`'s `type=positive_int`), refused
with the command's usage and exit 2 before anything runs otherwise. Taken as any int, `--limit 0`
was a silent "examined 0" with exit 0 (its reconcilers never ran) and `--limit -1` a traceback
(`reconcile_unknown`'s ValueError, caught by nothing)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.integration.test_cli import cli, insert


@pytest.mark.parametrize("limit", ["0", "-1", str(2**63), "many"])
async def test_a_reconcile_limit_that_is_no_count_is_a_bad_argument(
    limit: str, db_dsn: str, pool: Any
) -> None:
    await insert(pool, "happened", "unknown")
    result = cli("reconcile", "--app", "tests.cli_app:app", "--limit", limit, dsn=db_dsn)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stderr.startswith("usage: idem-middleware reconcile "), result.stderr
    assert "argument --limit: " in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""
    assert await pool.fetchval("SELECT state FROM idem_requests") == "unknown"
