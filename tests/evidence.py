"""Evidence lines the test suites leave behind, for the evidence table in docs/evidence.md.

Each call to `record` appends one JSON object (one line) to `tests/.evidence/<run>.jsonl`:

    {"scenario": str, "run": str, "requests": int, "duplicate_effects": int,
     "lost_outcomes": int, "stuck_keys": int, "recorded_at": "2025-01-01T00:00:00+00:00",
     "details": {...}}

- `requests`: requests (or claims) the scenario sent;
- `duplicate_effects`: executions beyond one per key;
- `lost_outcomes`: 2xx answers (or granted completions) with no stored record / business write;
- `stuck_keys`: keys left pending or unknown that should not be;
- `details`: optional, free-form, JSON-serialisable (never needed to build the table).

`run` is "default" unless the environment variable IDEM_EVIDENCE_RUN names another (a heavy run
writes `tests/.evidence/slow.jsonl`, say). Appending one short line per call is safe across
processes (O_APPEND). `load` reads a run back.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

__all__ = ["EVIDENCE_DIR", "RUN_ENV", "current_run", "load", "record"]

EVIDENCE_DIR = Path(__file__).resolve().parent / ".evidence"
RUN_ENV = "IDEM_EVIDENCE_RUN"
_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def current_run() -> str:
    return os.environ.get(RUN_ENV, "").strip() or "default"


def _path(run: str) -> Path:
    if _RUN_NAME.fullmatch(run) is None:
        raise ValueError(f"run name {run!r} must be 1-64 of [A-Za-z0-9._-] (no path parts)")
    return EVIDENCE_DIR / f"{run}.jsonl"


def record(
    scenario: str,
    *,
    requests: int,
    duplicate_effects: int,
    lost_outcomes: int,
    stuck_keys: int,
    run: str | None = None,
    details: Mapping[str, Any] | None = None,
) -> Path:
    """Append one evidence line; returns the file written."""
    if not scenario.strip():
        raise ValueError("scenario must not be empty")
    counts = {
        "requests": requests,
        "duplicate_effects": duplicate_effects,
        "lost_outcomes": lost_outcomes,
        "stuck_keys": stuck_keys,
    }
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, not {value!r}")
    run = run or current_run()
    path = _path(run)
    line: dict[str, Any] = {
        "scenario": scenario,
        "run": run,
        **counts,
        "recorded_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    if details:
        line["details"] = dict(details)
    data = (json.dumps(line, sort_keys=False, separators=(",", ":")) + "\n").encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    return path


def load(run: str | None = None) -> list[dict[str, Any]]:
    """Every line of a run, oldest first ([] if the run has none)."""
    path = _path(run or current_run())
    if not path.exists():
        return []
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
