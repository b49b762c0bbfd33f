"""Throwaway PostgreSQL servers for the tests, set up as the pytest plugin sets up its own.

Their data is deleted when they stop, so nothing is worth flushing to disk: `fsync` and
`full_page_writes` are off (`THROWAWAY_SETTINGS`). A commit still goes through the server's
write-ahead log and reaches the kernel before it is acknowledged, so a server process that is
killed, or stopped in immediate mode, loses nothing (all the restart tests do; only the machine's
crash would lose data). Measured on the test machine: a commit 258 -> 87 us, CREATE DATABASE about
3x quicker, and a fast stop's shutdown checkpoint after many databases from tens of seconds to
a fraction of one."""

from __future__ import annotations

import asyncio

from idem_middleware.pytest_databases import tuned_throwaway


def tune(uri: str) -> None:
    """Apply the plugin's THROWAWAY_SETTINGS to the server at `uri`, before the tests use it."""
    asyncio.run(tuned_throwaway(uri))
