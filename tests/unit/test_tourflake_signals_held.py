"""`tour_stack.signals_held`: what the tour does with a Ctrl-C or SIGTERM that lands while it
stops its servers. Each case runs in a child of its own: a fresh interpreter with one thread
(the kernel gives a process's signal to a thread that does not block it, and pytest's may have
several), and signal handlers the test sets itself, whatever it inherited."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from example_app.launcher import ROOT

PRELUDE = """
import os, signal, sys
from example_app.tour_stack import signals_held

def on_term(signum, frame):
    raise SystemExit(143)

signal.signal(signal.SIGTERM, on_term)
"""


def _run(body: str) -> subprocess.CompletedProcess[str]:
    script = textwrap.dedent(PRELUDE) + textwrap.dedent(body)
    return subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_ctrl_c_landing_while_the_handlers_are_put_back_leaves_sigterm_handled() -> None:
    """Before: the Ctrl-C raised KeyboardInterrupt between putting SIGINT's handler back and
    SIGTERM's, so SIGTERM stayed with the hold's handler: the process ignored it from then on."""
    done = _run(
        """
        signal.signal(signal.SIGINT, signal.default_int_handler)
        real_signal = signal.signal

        def putting_back(signum, handler):
            old = real_signal(signum, handler)
            if handler is signal.default_int_handler:  # SIGINT's is back: Ctrl-C now
                os.kill(os.getpid(), signal.SIGINT)
            return old

        signal.signal = putting_back
        try:
            with signals_held():
                pass
        except KeyboardInterrupt:
            print("interrupted")
        signal.signal = real_signal
        print("sigterm", "handled" if signal.getsignal(signal.SIGTERM) is on_term else "lost")
        """
    )
    assert done.stdout.split() == ["interrupted", "sigterm", "handled"], done.stdout + done.stderr


def test_a_sigterm_held_after_an_ignored_sigint_still_ends_the_process() -> None:
    """SIGINT ignored, as in a job a shell starts with `&`. Before, only the first signal held
    was raised again: the ignored SIGINT, and the SIGTERM was lost."""
    done = _run(
        """
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with signals_held():
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGTERM)
            print("held", flush=True)
        print("carried on")
        """
    )
    assert done.returncode == 143, done.stdout + done.stderr
    assert done.stdout.split() == ["held"], done.stdout + done.stderr


def test_a_ctrl_c_held_ends_as_interrupted_once_the_stops_are_done() -> None:
    done = _run(
        """
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            with signals_held():
                os.kill(os.getpid(), signal.SIGINT)
                print("stops done", flush=True)
        except KeyboardInterrupt:
            print("interrupted")
        print("handlers", signal.getsignal(signal.SIGINT) is signal.default_int_handler,
              signal.getsignal(signal.SIGTERM) is on_term)
        """
    )
    assert done.stdout.split() == ["stops", "done", "interrupted", "handlers", "True", "True"], (
        done.stdout + done.stderr
    )


def test_a_ctrl_c_the_process_ignores_stays_ignored() -> None:
    """A process started with SIGINT ignored (a job a shell starts with `&`, which no Ctrl-C at
    the terminal reaches) goes on, as it would have without the hold."""
    done = _run(
        """
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with signals_held():
            os.kill(os.getpid(), signal.SIGINT)
        print("carried on", signal.getsignal(signal.SIGINT) is signal.SIG_IGN)
        """
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.split() == ["carried", "on", "True"], done.stdout + done.stderr
