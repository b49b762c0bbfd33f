"""`idem-middleware stats --json` (and every other `--json` output) is JSON a strict parser reads:
an age from a timestamp set to 'infinity' or '-infinity' by hand is the string "Infinity" or
"-Infinity", never the bare `Infinity` json.dumps writes by default."""

from __future__ import annotations

import json
from typing import Any, NoReturn

from idem_middleware.cli_values import finite, json_line, shown_age
from tests.integration.test_cli import cli, insert


def _refuse(constant: str) -> NoReturn:
    raise ValueError(f"not JSON: {constant}")


def strict(text: str) -> Any:
    """`text` as a strict parser reads it (Python's json takes Infinity and NaN unless told)."""
    return json.loads(text, parse_constant=_refuse)


async def test_stats_json_with_infinite_ages_is_json(db_dsn: str, pool: Any) -> None:
    await insert(pool, "ancient", "pending")
    await insert(pool, "future", "unknown")
    await pool.execute(
        "UPDATE idem_requests SET updated_at = CASE idem_key WHEN 'ancient' THEN "
        "'-infinity'::timestamptz ELSE 'infinity' END"
    )
    await pool.execute(
        "INSERT INTO idem_outbox (event_id, topic, payload, created_at) "
        "VALUES ('e1', 'paid', '{}', '-infinity')"
    )
    full = cli("stats", "--json", dsn=db_dsn)
    assert full.returncode == 0, full.stderr
    data = strict(full.stdout)
    assert data["oldest_age_seconds"]["pending"] == "Infinity"
    assert data["oldest_age_seconds"]["unknown"] == "-Infinity"
    assert data["oldest_unresolved_age_seconds"] == "Infinity"
    assert data["outbox"]["oldest_unsent_age_seconds"] == "Infinity"
    assert data["counts"]["pending"] == data["counts"]["unknown"] == 1
    assert float(data["oldest_unresolved_age_seconds"]) == float("inf")  # read back as such
    cheap = cli("stats", "--unresolved", env={"IDEM_STATS_JSON": "1"}, dsn=db_dsn)
    assert cheap.returncode == 0, cheap.stderr
    assert strict(cheap.stdout)["oldest_unresolved_age_seconds"] == "Infinity"
    text = cli("stats", dsn=db_dsn)
    assert text.returncode == 0, text.stderr
    assert "oldest Infinity" in text.stdout
    assert "oldest -Infinity" in text.stdout
    assert "infs" not in text.stdout
    # The other --json outputs on the same rows: strict JSON too.
    for args in (
        ("list", "--json"),
        ("show", "--tenant", "t", "--operation", "POST /payouts", "--key", "ancient", "--json"),
        ("outbox", "list", "--json"),
    ):
        shown = cli(*args, dsn=db_dsn)
        assert shown.returncode == 0, (args, shown.stderr)
        lines = [strict(line) for line in shown.stdout.splitlines()]
        assert lines, args


def test_finite_writes_every_non_finite_float_as_a_string() -> None:
    nan, inf = float("nan"), float("inf")
    data = {"a": inf, "b": [-inf, {"c": nan}], "d": 1.5, "e": None, "f": (inf,)}
    assert finite(data) == {
        "a": "Infinity",
        "b": ["-Infinity", {"c": "NaN"}],
        "d": 1.5,
        "e": None,
        "f": ["Infinity"],
    }
    assert strict(json_line(data))["a"] == "Infinity"
    assert [shown_age(a) for a in (None, 3.4, inf, -inf, 1e300)] == [
        "-",
        "3s",
        "Infinity",
        "-Infinity",
        f"{1e300:.0f}s",
    ]
