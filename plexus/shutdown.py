"""Stop a long-running process on SIGTERM/SIGINT within a second, whichever thread the kernel picks.

Python runs signal handlers only in the main thread, between bytecodes. When the
kernel delivers the signal to another thread (gRPC's, torch's: any thread may
get a process-directed signal), a main thread blocked in a wait without a
timeout never runs the handler, and `systemctl stop` / `docker stop` hang until
they kill. So the main thread waits in short ticks, and the handler only
records the signal: taking a lock there (Event.set) can deadlock against the
very wait it interrupted.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import NoReturn

TICK_S = 0.2


class StopSignals:
    """Records SIGTERM/SIGINT from the moment it is made; `wait` blocks until one arrives."""

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> None:
        self.received: list[int] = []
        self._previous = {sig: signal.signal(sig, self._record) for sig in signals}

    def _record(self, signum: int, _frame) -> None:
        self.received.append(signum)   # list.append takes no Python-level lock

    def wait(self, done: Callable[[], bool] = lambda: False) -> int | None:
        """Block until a signal arrives (its number) or `done()` is true (None).

        The previous handlers are back on return, so a second signal during a slow
        shutdown acts as it would have without Plexus (SIGTERM kills, SIGINT interrupts).
        """
        try:
            while not self.received and not done():
                time.sleep(TICK_S)
        finally:
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)
        return self.received[0] if self.received else None


def exit_now(status: int) -> NoReturn:
    """End a worker process whose work is done (its last reply written and flushed) without the interpreter's
    teardown, which with torch loaded takes 0.3-0.8 s: its parent waits that out (a split job's end, under the
    coordinator's engine lock). The standard streams and log handlers are flushed first."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)
