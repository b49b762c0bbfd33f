"""bench.cpu.drive: the paths it sends name the accounts in turn, or a new one each request."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from bench.cpu import drive


def _paths(accounts: int) -> list[str]:
    paths: list[str] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        paths.append(scope["path"])
        await receive()
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    statuses = asyncio.run(drive(app, 12, "t", 4, accounts))
    assert statuses == {201: 12}
    return paths


def test_paths_cycle_through_the_accounts() -> None:
    assert len(set(_paths(3))) == 3


def test_accounts_zero_puts_a_new_account_in_every_path() -> None:
    paths = _paths(0)
    assert len(set(paths)) == 12
    assert all(p.startswith("/accounts/acct-t-") and p.endswith("/credits") for p in paths)


def test_paired_requests_take_turns_and_the_table_has_the_added_share() -> None:
    """bench.paired: every variant serves as many requests, in an order that rotates, and the
    table's share is (variant - bare) / bare, by median and by mean."""
    import asyncio

    from bench.paired import measure_paired, paired_markdown

    order: list[str] = []

    def app_named(name: str) -> object:
        async def app(scope: object, receive: object, send: object) -> None:
            order.append(name)

        return app

    def requests(prefix: str, n: int) -> list[tuple[dict[str, str], None]]:
        return [({"p": prefix}, None) for _ in range(n)]

    async def send(message: object) -> None:
        return None

    apps = {"bare": app_named("bare"), "ours": app_named("ours")}
    times = asyncio.run(measure_paired(apps, 450, send, requests))  # type: ignore[arg-type]
    assert [len(times["bare"]), len(times["ours"])] == [450, 450]
    assert order[:4] == ["bare", "ours", "ours", "bare"]  # the order rotates
    table = paired_markdown({"bare": [100.0, 100.0, 100.0], "ours": [130.0, 130.0, 160.0]})
    assert "| +30.0 / +40.0 | 0.30x / 0.40x |" in table, table


def test_wrk_ratios_per_repeat_pair_each_run_with_bares_in_the_same_repeat() -> None:
    from bench.report import summarize

    def run(variant: str, repeat: int, rps: float) -> dict[str, object]:
        return {
            "scenario": "fresh",
            "variant": variant,
            "repeat": repeat,
            "rps": rps,
            "statuses": {"201": 10},
            "p50_ms": 1.0,
            "p99_ms": 2.0,
            "non2xx": 0,
            "received": 10,
            "replayed": 0,
            "correct": True,
            "check": "ok",
            "cpu": {},
            "app_errors": 0,
        }

    runs = [run("bare", 0, 100.0), run("ours", 0, 95.0), run("bare", 1, 200.0)]
    runs += [run("ours", 1, 120.0), run("bare", 2, 150.0), run("ours", 2, 140.0)]
    summary = summarize(
        {"settings": {"scenarios": ["fresh"], "variants": ["bare", "ours"]}, "runs": runs}
    )
    ours = summary["fresh"]["ours"]
    assert ours["ratio"] == 0.8  # the medians' ratio: 120 / 150
    assert ours["paired"] == [0.933, 0.6, 0.95]  # 0.95, 0.6 and 0.933, repeat by repeat
    assert "paired" not in summary["fresh"]["bare"]


def test_paired_runs_give_each_process_its_shares_then_their_median_and_range() -> None:
    """bench.paired_runs: a share is (variant / bare) - 1 within one process, by the median and
    by the mean; the last row is the median of the processes' shares, and their range."""
    from bench.paired_runs import markdown, shares

    one = {"bare": [100.0, 200.0], "ours-memory": [140.0, 300.0], "floor-memory": [110.0, 220.0]}
    s = shares(one)
    assert s["ours-memory"] == pytest.approx((0.40, 0.50))
    assert s["floor-memory"] == pytest.approx((0.10, 0.10))
    two = {"bare": [50.0, 50.0], "ours-memory": [80.0, 80.0], "floor-memory": [55.0, 60.0]}
    three = {"bare": [80.0, 80.0], "ours-memory": [100.0, 120.0], "floor-memory": [84.0, 88.0]}
    table = markdown([{"times": t} for t in (one, two, three)]).splitlines()
    assert table[2] == "| 1 | 100.0 | 0.40x / 0.50x | 0.10x / 0.10x |"
    assert table[3] == "| 2 | 50.0 | 0.60x / 0.60x | 0.10x / 0.20x |"
    # ours by median: 0.40, 0.60, 0.25 -> 0.40 (0.25-0.60); by mean: 0.50, 0.60, 0.50.
    assert table[-1] == (
        "| **median (range) of the processes** | | 0.40x (0.25-0.60) / 0.50x (0.50-0.60) "
        "| 0.10x (0.05-0.10) / 0.10x (0.10-0.20) |"
    )
