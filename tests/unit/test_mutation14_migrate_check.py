"""`migrate --check` (cli_migrate.check) in process, without a database: a DSN that is not one
stays a usage error (exit 2 with the command's usage, not "the check failed"); anything
unexpected is CHECK_FAILED with its traceback (a bug, said as one); the connection is closed
whatever the check met."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from idem_middleware import cli_migrate
from idem_middleware.cli_connect import UsageError


class _Conn:
    closed = False

    async def close(self) -> None:
        self.closed = True


def _args(dsn: str, json: bool = False) -> argparse.Namespace:
    return argparse.Namespace(dsn=dsn, json=json, check=True)


async def test_a_dsn_that_is_not_one_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="--dsn"):
        await cli_migrate.check(_args("postgresql://h:notaport/db"))


async def test_an_unexpected_failure_is_check_failed_with_its_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    conn = _Conn()

    async def connect(*args: Any, **kwargs: Any) -> _Conn:
        return conn

    async def pending_versions(c: Any) -> list[int]:
        raise RuntimeError("a bug in the check")

    monkeypatch.setattr(cli_migrate.asyncpg, "connect", connect)
    monkeypatch.setattr(cli_migrate, "pending_versions", pending_versions)
    assert await cli_migrate.check(_args("postgresql://h/db", json=True)) == 2
    assert conn.closed
    out, err = capsys.readouterr()
    assert "Traceback" in err
    assert "RuntimeError: a bug in the check" in err
    assert err.rstrip().endswith("idem-middleware: a bug in the check")
    assert out.strip() == '{"error": "a bug in the check", "pending": null}'
