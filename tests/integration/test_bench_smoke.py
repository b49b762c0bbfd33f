"""`python -m bench` runs end to end for a second and writes its table (no timing asserted)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    shutil.which("wrk") is None,
    reason="wrk is not installed (apt-get install -y wrk); the benchmark needs it for load",
)

#: The bare app, and the claim's transaction written through asyncpg and through SQLAlchemy.
VARIANTS = ("bare", "ours-tx", "ours-tx-sqla")


def test_bench_runs_and_writes_its_table(tmp_path: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "bench",
        "--duration",
        "1",
        "--repeats",
        "1",
        # (No warm-up, a short drain: the harness end to end, not figures; 12 s of the suite.)
        "--warmup",
        "0",
        "--drain",
        "1",
        "--variants",
        ",".join(VARIANTS),
        "--scenarios",
        "fresh",
        "--out",
        str(tmp_path),
    ]
    out = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=55, env=dict(os.environ)
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    table = (tmp_path / "latest.md").read_text()
    assert (tmp_path / "latest.json").exists()
    section = table.split("## Fresh keys", 1)[1].split("\n## ", 1)[0]
    rows = {
        line.split("|")[1].strip(): line
        for line in section.splitlines()
        if line.split("|")[1:2] and line.split("|")[1].strip() in VARIANTS
    }
    assert set(rows) == set(VARIANTS), table
    for variant, row in rows.items():
        correctness = row.rstrip(" |").rsplit("|", 1)[-1].strip()
        assert correctness.startswith("ok"), f"{variant}: {row}"
        assert "VIOLATION" not in row
