"""The pytest plugin with an `IDEM_TEST_DSN` it cannot connect to: the run fails at once (or
within the plugin's bound) saying which server, without its password, and what to do."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.test_pytest_plugin import run, use_this_server

USES_THE_DATABASE = "def test_db(idem_postgres_dsn):\n    pass\n"
#: The inner run's bound on the first connection, short for the test (the plugin's is 10 s).
SHORT_WAIT = "import idem_middleware.pytest_databases as databases\n\ndatabases._WAIT = 1.0\n"


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A port that accepts connections (the kernel's backlog) and never answers."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        yield listener.getsockname()[1]


def test_a_server_that_never_answers_fails_the_run_within_the_bound_saying_so(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    pg_dsn: str,
    silent_server: int,
) -> None:
    """The reservation's connection waited asyncpg's 60 s, then the run failed with a bare
    `TimeoutError` out of concurrent.futures, naming neither the server nor IDEM_TEST_DSN (and
    "Task was destroyed but it is pending!" at exit)."""
    use_this_server(pytester, monkeypatch, pg_dsn)
    monkeypatch.setenv("IDEM_TEST_DSN", f"postgresql://app:s3cret@127.0.0.1:{silent_server}/app")
    pytester.makeconftest(SHORT_WAIT)
    pytester.makepyfile(test_db=USES_THE_DATABASE)
    result = run(pytester)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        [
            "idem_postgres_dsn: cannot connect to the server IDEM_TEST_DSN names "
            f"(postgresql://app@127.0.0.1:{silent_server}/app): no answer in 1 s; start it or "
            "correct IDEM_TEST_DSN, or unset IDEM_TEST_DSN for a throwaway embedded PostgreSQL"
        ]
    )
    assert "s3cret" not in result.stdout.str() + result.stderr.str()
    assert "destroyed but it is pending" not in result.stdout.str() + result.stderr.str()


def test_a_refused_connection_names_the_server_without_its_password(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, pg_dsn: str
) -> None:
    """A server not running, or a socket directory that does not exist: asyncpg's
    "[Errno 2] No such file or directory" alone, out of the plugin's internals."""
    use_this_server(pytester, monkeypatch, pg_dsn)
    absent = Path(f"/tmp/idem-no-server-{os.getpid()}")  # (a socket's path is short)
    assert not absent.exists()
    monkeypatch.setenv("IDEM_TEST_DSN", f"postgresql://app@/app?host={absent}&password=s3cret")
    pytester.makepyfile(test_db=USES_THE_DATABASE)
    result = run(pytester)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        [
            f"idem_postgres_dsn: cannot connect to the server IDEM_TEST_DSN names "
            f"(postgresql://app@/app?host={absent}&password=***): *No such file or directory; "
            "start it or correct IDEM_TEST_DSN*"
        ]
    )
    assert "s3cret" not in result.stdout.str()
    assert "During handling" not in result.stdout.str()


def test_a_blank_dsn_fails_the_run_instead_of_reaching_a_local_server(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, pg_dsn: str
) -> None:
    """IDEM_TEST_DSN set to spaces: asyncpg took it for libpq's defaults, and the plugin made
    and dropped its database on whatever local server those reached."""
    use_this_server(pytester, monkeypatch, pg_dsn)
    monkeypatch.setenv("IDEM_TEST_DSN", "   ")
    pytester.makepyfile(test_db=USES_THE_DATABASE)
    result = run(pytester)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*IDEM_TEST_DSN is set but blank: unset it*"])
