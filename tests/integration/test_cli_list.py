"""`idem-middleware list` page by page, and `list`/`show` printing stored text for a terminal."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import Any

import pytest

from idem_middleware.cli_list import printable, records
from idem_middleware.store.base import State
from idem_middleware.store.postgres import PostgresStore
from tests.integration.test_cli import cli

_ROWS = """
INSERT INTO idem_requests (tenant, operation, idem_key, fingerprint, state, mode, retention,
    updated_at, expires_at, response_status)
SELECT 't', 'POST /payouts', $1 || i, '\\x00', $1, 'lease', interval '1 day',
    now() - make_interval(secs => $2 + i * 10),
    CASE WHEN $1 = 'succeeded' THEN now() + interval '1 day' END,
    CASE WHEN $1 = 'succeeded' THEN 201 END
FROM generate_series(1, $3) AS i
"""

_NEW = """
INSERT INTO idem_requests (tenant, operation, idem_key, fingerprint, state, mode, retention)
VALUES ('t', 'POST /payouts', $1, '\\x00', $2, 'lease', interval '1 day')
"""


async def _fill(pool: Any) -> list[str]:
    """12 unknown and 9 pending records, interleaved by age, and finished ones; the listed keys,
    oldest first."""
    await pool.execute(_ROWS, "unknown", 0.0, 12)
    await pool.execute(_ROWS, "pending", 5.0, 9)
    await pool.execute(_ROWS, "succeeded", 1.0, 5)
    rows = await pool.fetch(
        "SELECT idem_key FROM idem_requests WHERE state IN ('pending', 'unknown') "
        "ORDER BY updated_at"
    )
    return [r["idem_key"] for r in rows]


@pytest.mark.db_routes("partitioned", "pgbouncer")  # (partitions: each index read, merged)
async def test_a_long_listing_is_read_in_bounded_pages_each_record_once_in_order(
    pool: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, `list --limit N` read all N records in one statement into memory (905 MB for
    940,000). Now each state is read a page at a time and merged oldest first; between the
    pages records are inserted, deleted and moved (a listed pending record turned unknown, as
    a lapsed lease is): every record that stayed is listed exactly once, in order."""
    expected = await _fill(pool)
    store = PostgresStore(pool=pool, listen=False)
    real = store.list_page
    sizes: list[int] = []

    async def page(state: State, **kwargs: Any) -> Any:
        found = await real(state, **kwargs)
        sizes.append(kwargs["size"])
        n = len(sizes)
        # A record claimed meanwhile (updated now): after the listing began, so not in it.
        await pool.execute(_NEW, f"new-{n}", state.value)
        if n == 2:  # an unlisted record deleted, a listed one moved
            await pool.execute("DELETE FROM idem_requests WHERE idem_key = 'unknown2'")
            await pool.execute(
                "UPDATE idem_requests SET state = 'unknown', updated_at = now() "
                "WHERE idem_key = 'pending9'"
            )
        return found

    monkeypatch.setattr(store, "list_page", page)
    listed = [
        r.key.key
        async for r in records(
            store, states=[State.PENDING, State.UNKNOWN], limit=1000, page_size=4
        )
    ]
    assert listed == [k for k in expected if k != "unknown2"]
    assert set(sizes) == {4}
    assert len(sizes) == 3 + 3  # 9 pending in 3 pages, the 11 unknown left in 3


@pytest.mark.db_routes("partitioned")
async def test_the_limit_stops_the_reading(pool: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    expected = await _fill(pool)
    store = PostgresStore(pool=pool, listen=False)
    real = store.list_page
    calls: list[State] = []

    async def page(state: State, **kwargs: Any) -> Any:
        calls.append(state)
        return await real(state, **kwargs)

    monkeypatch.setattr(store, "list_page", page)
    states = [State.UNKNOWN, State.PENDING, State.UNKNOWN]  # (a state given twice: once)
    listed = [r.key.key async for r in records(store, states=states, limit=7, page_size=3)]
    assert listed == expected[:7]
    assert calls == [State.UNKNOWN, State.PENDING, State.UNKNOWN]  # the pages of those 7


async def test_the_cli_lists_past_a_page_as_before(db_dsn: str, pool: Any) -> None:
    await pool.execute(_ROWS, "unknown", 0.0, 5200)
    await pool.execute(_ROWS, "pending", 5.0, 600)
    await pool.execute(_ROWS, "succeeded", 1.0, 5300)
    everything = await pool.fetch("SELECT idem_key FROM idem_requests ORDER BY updated_at")
    result = cli("list", "--json", "--limit", "99999", *_all_states(), dsn=db_dsn)
    assert result.returncode == 0, result.stderr
    assert [json.loads(line)["key"] for line in result.stdout.splitlines()] == [
        r["idem_key"] for r in everything
    ]
    text = cli("list", "--state", "succeeded", "--limit", "5001", dsn=db_dsn)
    lines = text.stdout.splitlines()
    assert len(lines) == 5001
    assert lines[0].startswith("tenant=t  operation=POST /payouts  key=succeeded5300  ")


def _all_states() -> list[str]:
    return [arg for state in State for arg in ("--state", state.value)]


def test_printable_escapes_what_a_terminal_would_act_on() -> None:
    assert printable("payout-1 café 支付") == "payout-1 café 支付"
    assert printable("a\x1b[2Jb\x07\x7f\x9b") == "a\\x1b[2Jb\\x07\\x7f\\x9b"
    assert printable("x\u202ey\u2028\t\n\r\U000e0001") == "x\\u202ey\\u2028\\t\\n\\r\\U000e0001"


async def test_list_and_show_print_stored_control_characters_escaped(
    db_dsn: str, pool: Any
) -> None:
    """A tenant is what the app's resolver returned (a user name, say), a note what an operator
    or a reconciler wrote: before, `list` and `show` wrote them raw, so ESC sequences in them
    reached the operator's terminal (retitling it, clearing it, hiding lines)."""
    tenant, operation, key = "evil\x1b]0;owned\x07", "POST /caf\u00e9\u202e", "k\x1b[2J"
    note = "checked\x1b[8m hidden\nsecond line"
    await pool.execute(
        "INSERT INTO idem_requests (tenant, operation, idem_key, fingerprint, state, mode, "
        "retention, note) VALUES ($1, $2, $3, '\\x00', 'unknown', 'lease', interval '1 day', $4)",
        tenant,
        operation,
        key,
        note,
    )
    listed = cli("list", dsn=db_dsn, env={"PYTHONIOENCODING": "ascii"})
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.startswith(
        "tenant=evil\\x1b]0;owned\\x07  operation=POST /caf\\xe9\\u202e  key=k\\x1b[2J  "
    )
    assert "note=checked\\x1b[8m hidden | second line" in listed.stdout
    shown = cli("show", "--tenant", tenant, "--operation", operation, "--key", key, dsn=db_dsn)
    assert shown.returncode == 0, shown.stderr
    assert "\x1b" not in shown.stdout
    assert "\u202e" not in shown.stdout
    assert "  checked\\x1b[8m hidden\n  second line\n" in shown.stdout
    exact = json.loads(cli("list", "--json", dsn=db_dsn).stdout)
    assert (exact["tenant"], exact["operation"], exact["key"]) == (tenant, operation, key)


async def test_an_empty_tenant_variable_means_no_filter_and_the_anonymous_tenant_is_named(
    db_dsn: str, pool: Any
) -> None:
    """Before, `IDEM_TENANT=` (left empty in an env file) filtered on the anonymous tenant `""`
    and said "no records in state pending or unknown" with records of every tenant stuck."""
    await pool.execute(_NEW, "k1", "unknown")
    unset = cli("list", "--json", dsn=db_dsn, env={"IDEM_TENANT": "", "IDEM_OPERATION": ""})
    assert unset.returncode == 0, unset.stderr
    assert [json.loads(line)["key"] for line in unset.stdout.splitlines()] == ["k1"]
    anonymous = cli("list", "--tenant", "", dsn=db_dsn)
    assert anonymous.stdout.strip() == 'no records in state pending or unknown, tenant ""'
    await pool.execute(_NEW.replace("'t'", "''"), "k2", "unknown")
    assert "key=k2" in cli("list", "--tenant", "", dsn=db_dsn).stdout


async def test_ctrl_c_during_a_listing_ends_it_with_a_line_not_a_traceback(
    db_dsn: str, pool: Any
) -> None:
    """Before, Ctrl-C on a long `list` printed asyncpg's and asyncio's tracebacks, a screenful."""
    await pool.execute(_ROWS, "unknown", 0.0, 6000)
    returncode, stderr = _interrupted_listing(db_dsn)
    assert (returncode, stderr) == (130, "idem-middleware: interrupted\n")


def _interrupted_listing(dsn: str) -> tuple[int, str]:
    """`idem-middleware list`, Ctrl-C once it has printed a line."""
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "IDEM_DATABASE_URL")}
    with subprocess.Popen(
        [sys.executable, "-m", "idem_middleware", "--dsn", dsn, "list", "--limit", "6000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        # (a child started from a shell in the background may inherit SIGINT ignored)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    ) as lister:
        assert lister.stdout is not None
        assert lister.stdout.readline().startswith(b"tenant=t")  # listing; the pipe fills up
        lister.send_signal(signal.SIGINT)
        _, stderr = lister.communicate(timeout=60)
    return lister.returncode, stderr.decode()
