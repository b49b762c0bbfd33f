"""`outbox publish` with no `--url` and no IDEM_OUTBOX_URL is a usage error naming both, exit 2,
before anything is reserved (`cli_commands.outbox`'s `if not args.url`). Without the check the
None reached httpx, and the command ended in a TypeError traceback."""

from __future__ import annotations

from typing import Any

from tests.integration.test_cli import cli


async def test_publish_without_a_url_names_the_option_and_its_variable(
    db_dsn: str, pool: Any
) -> None:
    from idem_middleware.outbox import add

    async with pool.acquire() as conn, conn.transaction():
        await add(conn, "t", {"n": 1}, event_id="due-1")
    for env in ({}, {"IDEM_OUTBOX_URL": ""}):  # (unset, or empty: unset as every variable)
        result = cli("outbox", "publish", "--once", dsn=db_dsn, env=env)
        assert result.returncode == 2, (result.stdout, result.stderr)
        assert result.stderr.startswith("usage: idem-middleware outbox publish "), result.stderr
        assert "outbox publish needs --url (or IDEM_OUTBOX_URL)" in result.stderr
        assert "Traceback" not in result.stderr
    assert await pool.fetchval("SELECT attempts FROM idem_outbox WHERE event_id = 'due-1'") == 0
