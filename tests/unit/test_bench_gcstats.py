"""bench.gcstats: the app's collector counts (served at /bench/gc) and the table built from them."""

from __future__ import annotations

import gc
import os
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from bench.gcstats import Run, install, markdown, pinning
from bench.gcstats import main as gcstats_main


async def test_the_app_counts_its_collections_from_the_last_reset() -> None:
    app = FastAPI()
    collector = install(app)
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:

            async def get(path: str) -> Any:
                return (await client.get(path)).json()

            await get("/bench/gc/reset")
            gc.collect()
            gc.collect(0)
            stats = await get("/bench/gc")
            assert stats["passes"][2] >= 1
            assert stats["passes"][0] >= 1
            assert stats["seconds"][2] > 0
            assert stats["enabled"] is True
            assert (await get("/bench/gc/reset"))["passes"] == [0, 0, 0]
    finally:
        collector.close()


def test_the_table_compares_each_run_with_bare_in_its_repeat() -> None:
    runs = [
        Run("bare", 0, 1000.0, 5000, 1000.0, [10.0, 2.0, 20.0], [50.0, 5.0, 0.5]),
        Run("ours-memory", 0, 800.0, 4000, 1250.0, [20.0, 4.0, 40.0], [80.0, 7.0, 0.7]),
    ]
    table = markdown(runs)
    assert "| ours-memory | 1 | 800 | 0.80x | 1,250 | 0.80x | 64.0 (20.0, 4.0, 40.0) |" in table
    assert "ours-memory: app CPU ratio median 0.80x bare" in table


def test_pinning_splits_the_cpus_and_refuses_nonsense() -> None:
    allowed = os.sched_getaffinity(0)
    assert pinning(None) is None
    with pytest.raises(ValueError, match="not one this process may use"):
        pinning(max(allowed) + 1)
    with pytest.raises(ValueError, match="not one this process may use"):
        pinning(-1)
    cpu = min(allowed)
    if len(allowed) < 2:
        with pytest.raises(ValueError, match="second CPU"):
            pinning(cpu)
    else:
        assert pinning(cpu) == ({cpu}, allowed - {cpu})


def test_a_cpu_that_cannot_be_pinned_is_refused_at_the_command_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        gcstats_main(["--pin-app", "4096", "--variants", "bare"])
    assert exited.value.code == 2
    assert "--pin-app: CPU 4096 is not one this process may use" in capsys.readouterr().err
