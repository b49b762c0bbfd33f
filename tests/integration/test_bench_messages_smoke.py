"""`python -m bench.messages` sends each message as the store writes it (its prepared statements,
the fused literals): it runs end to end and prints a row per sequence, so a change to the store's
messages that the tool no longer matches fails here (no timing asserted)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_messages_runs_every_sequence() -> None:
    command = [sys.executable, "-m", "bench.messages", "--n", "5", "--rounds", "1"]
    out = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=120, env=dict(os.environ)
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| `")]
    assert len(rows) == 9, out.stdout
    assert any(row.startswith("| `transactional: BEGIN; claim") for row in rows), out.stdout
    for row in rows:
        assert float(row.rsplit("|", 2)[1].split()[0]) > 0, row  # (names hold "|")
