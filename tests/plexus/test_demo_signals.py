"""The demo's Ctrl-C: a KeyboardInterrupt that Python drops (raised while a finalizer runs) still stops it; and
a child that exits stops it at once, not at the job's next event."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading

import grpc
import pytest

from plexus.demo import Federation
from plexus.errors import PlexusError

from timing import scaled


def test_a_dropped_keyboard_interrupt_is_raised_again_at_the_next_event(tmp_path):
    fed = Federation(tmp_path)
    fed.check_alive()   # nothing started, nothing interrupted: no error
    try:   # what Python does when the handler raises inside a __del__: prints "Exception ignored", goes on
        fed.interrupt(signal.SIGINT, None)
    except KeyboardInterrupt:
        pass
    with pytest.raises(KeyboardInterrupt):
        fed.check_alive()


def test_a_child_that_exits_cancels_the_watch_and_the_demo_says_which(tmp_path):
    fed = Federation(tmp_path)
    (fed.logs / "site-x.log").write_text("its last words\n")
    fed.procs["site-x"] = child = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    cancelled = threading.Event()

    class Watch:   # the job's watch: a call the guard may cancel
        def cancel(self):
            cancelled.set()

    try:
        with pytest.raises(PlexusError, match="site-x exited with code 3; its log ends:\nits last words"):
            with fed.guarding(Watch()):
                assert cancelled.wait(scaled(10)), "the guard never cancelled the watch"
                raise grpc.RpcError()   # what iterating a cancelled watch raises
    finally:
        child.wait()
