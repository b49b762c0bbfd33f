"""`--key` as the header's value: the spaces and tabs around a bare key are not the key's (a
header never gives a key that starts or ends with one), as around a quoted one. A bare key with
a space around it found no record, though a quoted one did."""

from __future__ import annotations

from typing import Any

import pytest

from tests.integration.test_cli import cli, insert


@pytest.mark.parametrize("given", ["k1", " k1", "k1 ", "\tk1 ", ' "k1" '])
async def test_a_key_is_found_whatever_spaces_surround_it(
    db_dsn: str, pool: Any, given: str
) -> None:
    await insert(pool, "k1", "unknown")
    shown = cli("show", "--tenant", "t", "--operation", "POST /payouts", "--key", given, dsn=db_dsn)
    assert shown.returncode == 0, shown.stdout + shown.stderr
