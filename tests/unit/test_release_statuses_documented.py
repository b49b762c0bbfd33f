"""Which 4xx release the key is what docs/protocol.md's table says, no more and no fewer: every
other 4xx is stored as `failed_final` and replayed, in either mode (a status added to the set by
mistake, 414 or 418 say, was no test's concern)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from idem_middleware.outcomes import Outcome, outcome_for_status
from idem_middleware.policy import Mode

PROTOCOL = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


def _documented() -> set[int]:
    row = next(
        line for line in PROTOCOL.read_text().splitlines() if '("nothing happened, fix' in line
    )
    listed = row.split("(")[0]
    return {int(s) for s in re.findall(r"\b4\d\d\b", listed)}


def test_the_documented_list_is_read() -> None:
    assert {400, 409, 411, 431} <= _documented()


@pytest.mark.parametrize("mode", [Mode.TRANSACTIONAL, Mode.LEASE])
def test_exactly_the_documented_4xx_release_the_key(mode: Mode) -> None:
    released = {s for s in range(400, 500) if outcome_for_status(s, mode) is Outcome.RELEASE}
    assert released == _documented()
    stored = {s for s in range(400, 500) if outcome_for_status(s, mode) is Outcome.FAILED_FINAL}
    assert stored == set(range(400, 500)) - released
