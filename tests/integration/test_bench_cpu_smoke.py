"""`python -m bench.cpu` runs end to end on a few requests and writes its table (no timing
asserted: the numbers are for docs/performance.md, not for the tests)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_cpu_runs_every_variant_and_every_request_succeeds() -> None:
    command = [
        sys.executable,
        "-m",
        "bench.cpu",
        "--requests",
        "30",
        "--rounds",
        "1",
        "--concurrency",
        "4",
        "--variants",
        "bare,bare+memory,ours-tx,ours-lease",
    ]
    out = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=120, env=dict(os.environ)
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = {
        line.split("|")[1].strip(): line for line in out.stdout.splitlines() if line.count("|") > 4
    }
    for variant in ("bare", "bare+memory", "ours-tx", "ours-lease"):
        assert variant in rows, out.stdout
        assert "{201: 30}" in rows[variant], rows[variant]
