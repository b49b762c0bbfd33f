"""bench.sqla_cpu refuses what it cannot measure before it starts a database."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "args",
    [
        # Before, an unknown variant was measured as sqla-text and printed under its own name.
        ("--variants", "nope"),
        # Before, a ZeroDivisionError after the database had started.
        ("--concurrency", "0"),
        ("--requests", "4", "--concurrency", "8"),
    ],
)
def test_bad_arguments_are_a_usage_error(args: tuple[str, ...]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "bench.sqla_cpu", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "error:" in result.stderr
