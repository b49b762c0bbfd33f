"""A DSN's secrets in its query are never shown when a command cannot connect: `password` and
`sslpassword` (the passphrase of the client's SSL key), whatever their case, percent-encoded or
not. Only `password` was pinned; `sslpassword` was printed to stderr (and to CI logs)."""

from __future__ import annotations

import pytest

from tests.integration.test_cli import cli


@pytest.mark.parametrize(
    "name", ["sslpassword", "SSLPassword", "ssl%70assword", "password", "PASSWORD"]
)
def test_a_secret_in_the_dsns_query_is_not_shown(name: str) -> None:
    dsn = f"postgresql://nobody@/none?host=/nonexistent-dir&{name}=pw-secret"
    result = cli("stats", dsn=dsn)
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith("idem-middleware: cannot connect to "), result.stderr
    assert "pw-secret" not in result.stderr + result.stdout
    assert "=***" in result.stderr
