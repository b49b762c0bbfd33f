"""PgBouncer in transaction pooling mode in front of the test PostgreSQL, started and stopped by
PID (Debian's `pgbouncer` package; `.ci/run` installs it)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from example_app.launcher import free_port

# PgBouncer refuses to run as root; the embedded server's own user will do.
RUN_AS = "embedded_postgres"


def binary() -> str | None:
    return shutil.which("pgbouncer") or (
        "/usr/sbin/pgbouncer" if os.path.exists("/usr/sbin/pgbouncer") else None
    )


class PgBouncer:
    def __init__(
        self,
        upstream_dsn: str,
        *,
        pool_size: int = 20,
        server_idle_timeout: int = 1,
        pool_mode: str = "transaction",
        settings: dict[str, object] | None = None,
    ) -> None:
        parts = urlsplit(upstream_dsn)
        query = parse_qs(parts.query)
        self.upstream_host = query.get("host", [parts.hostname or "127.0.0.1"])[0]
        self.upstream_port = parts.port or 5432
        self.user = parts.username or "postgres"
        self.port = free_port()
        self.folder = Path(tempfile.mkdtemp(prefix="idem-pgbouncer-"))
        self.proc: subprocess.Popen[bytes] | None = None
        self.pool_size = pool_size
        self.server_idle_timeout = server_idle_timeout
        self.pool_mode = pool_mode
        self.settings = settings or {}  # more [pgbouncer] settings (query_wait_timeout, ...)

    def dsn(self, database: str = "postgres") -> str:
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{database}"

    def start(self) -> PgBouncer:
        exe = binary()
        if exe is None:
            raise RuntimeError("pgbouncer is not installed (apt-get install -y pgbouncer)")
        ini = self.folder / "pgbouncer.ini"
        ini.write_text(
            "[databases]\n"
            f"* = host={self.upstream_host} port={self.upstream_port} user={self.user}\n"
            "[pgbouncer]\n"
            "listen_addr = 127.0.0.1\n"
            f"listen_port = {self.port}\n"
            f"unix_socket_dir = {self.folder}\n"
            "auth_type = any\n"
            f"pool_mode = {self.pool_mode}\n"
            "max_client_conn = 500\n"
            f"default_pool_size = {self.pool_size}\n"
            # Idle server connections go back to PostgreSQL at once: held for the default
            # 600 s, they used up max_connections for tests that came after (a storm test's
            # worker processes, say), so the suite passed only in one order.
            f"server_idle_timeout = {self.server_idle_timeout}\n"
            "ignore_startup_parameters = extra_float_digits,application_name\n"
            f"logfile = {self.folder / 'pgbouncer.log'}\n"
            + "".join(f"{name} = {value}\n" for name, value in self.settings.items())
        )
        os.chmod(self.folder, 0o777)
        for path in self.folder.iterdir():
            os.chmod(path, 0o666)
        self.proc = subprocess.Popen(
            [exe, "-u", RUN_AS, str(ini)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pgbouncer exited: {self.log()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"pgbouncer did not start: {self.log()}")

    def log(self) -> str:
        path = self.folder / "pgbouncer.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        shutil.rmtree(self.folder, ignore_errors=True)
