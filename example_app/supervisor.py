"""Workers that outlive their supervisor shut down.

With `--workers N`, `python -m example_app` is a supervisor: uvicorn's worker processes and the
shared bank simulator are its children. SIGKILLed, it runs no exit hooks and nothing tells them:
they would go on serving the port (a restart cannot bind it) and the bank would linger. Each
child started under a supervisor watches for it to go and then stops itself, gracefully.
"""

from __future__ import annotations

import asyncio
import os
import signal

#: Set by the supervisor, inherited by the processes it starts: its own PID.
SUPERVISOR_ENV = "EXAMPLE_SUPERVISOR_PID"
#: How often a child looks for its supervisor.
POLL_SECONDS = 0.5


async def stop_when_orphaned() -> None:
    """SIGTERM this process once its supervisor is gone; returns at once without one (the app
    run as one process is nobody's child)."""
    supervisor = os.environ.get(SUPERVISOR_ENV)
    if not supervisor or int(supervisor) == os.getpid():
        return
    while True:
        await asyncio.sleep(POLL_SECONDS)
        if os.getppid() != int(supervisor):  # re-parented: the supervisor is gone
            break
    os.kill(os.getpid(), signal.SIGTERM)  # uvicorn's handler: a graceful shutdown
