"""One job, the same keys, run by two processes at once (each with its own store and pool): each
key's effect happens once, and both processes return that one run's result."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

KEYS = 12

WORKER = textwrap.dedent(
    f"""
    import asyncio, json, os, random, sys
    from idem_middleware import Mode, PostgresStore
    from idem_middleware.jobs import idempotent_job

    DSN, MODE, OUT = sys.argv[1], sys.argv[2], sys.argv[3]

    async def main():
        async with PostgresStore(dsn=DSN, min_size=1, max_size=4, listen=False) as store:
            @idempotent_job(store, operation="payouts.send", key="k", mode=Mode(MODE),
                            wait_seconds=30)
            async def send(job, *, k):
                if MODE == "transactional":
                    conn = job.connection
                else:
                    conn = await job.fenced_connection()
                await conn.execute(
                    "INSERT INTO test_ledger (tenant, account_id, amount) VALUES ('p', $1, 1)", k)
                await asyncio.sleep(random.random() * 0.02)
                return {{"pid": os.getpid()}}

            keys = [f"k{{i}}" for i in range({KEYS})]
            random.shuffle(keys)
            results = await asyncio.gather(*(send(k=k) for k in keys))
            with open(OUT, "w") as out:
                json.dump(dict(zip(keys, results)), out)

    asyncio.run(main())
    """
)


@pytest.mark.parametrize("mode", ["transactional", "lease"])
async def test_two_processes_running_one_job_apply_each_key_once(
    db_dsn: str, pool: Any, tmp_path: Path, mode: str
) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    outs = [tmp_path / f"out{i}.json" for i in range(2)]
    procs = [
        subprocess.Popen([sys.executable, str(script), db_dsn, mode, str(out)])  # noqa: ASYNC220
        for out in outs
    ]
    try:
        for proc in procs:
            await asyncio.to_thread(proc.wait, 120)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    assert [proc.returncode for proc in procs] == [0, 0]
    effects = await pool.fetch(
        "SELECT account_id, count(*) AS n FROM test_ledger WHERE tenant = 'p' GROUP BY 1"
    )
    assert {r["account_id"]: r["n"] for r in effects} == {f"k{i}": 1 for i in range(KEYS)}
    first, second = (json.loads(out.read_text()) for out in outs)
    assert first == second  # a repeat returns the run's result, whichever process ran it
