"""`python -m bench.opcodes` runs end to end on a few requests and attributes the middleware's
bytecodes to its functions (the numbers are for docs/performance.md, not for the tests)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(
    sys.version_info >= (3, 12),
    reason="bench.opcodes counts with sys.settrace's opcode events, which count nothing of the "
    "bare app on Python 3.12 (a benchmark tool's limit, run it on 3.11)",
)
def test_bench_opcodes_counts_every_variant_and_names_the_middlewares_functions() -> None:
    command = [sys.executable, "-m", "bench.opcodes", "--requests", "20", "--concurrency", "4"]
    command += ["--variants", "bare,ours-memory,ours-tx", "--top", "5", "--gc-requests", "200"]
    out = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=300, env=dict(os.environ)
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    totals = dict(re.findall(r"^\| (bare|ours-memory|ours-tx) \| ([\d,]+) \|", out.stdout, re.M))
    assert set(totals) == {"bare", "ours-memory", "ours-tx"}, out.stdout
    bare = int(totals["bare"].replace(",", ""))
    assert bare > 1000, out.stdout  # a FastAPI request with its handler's statements
    for variant in ("ours-memory", "ours-tx"):
        assert int(totals[variant].replace(",", "")) > bare, out.stdout
        section = out.stdout.split(f"**{variant}**", 1)[1]
        listed = re.findall(r"^\| (\S+\.py):\d+ (\S+) \| [\d,.]+ \|", section, re.M)[:5]
        assert len(listed) == 5, section
        assert all(not name.startswith("/") for name, _ in listed), listed  # the package's own
        assert ("transactional.py", "run") in listed, listed  # the attempt, with its handler
