"""The demo's Ctrl-C: a KeyboardInterrupt that Python drops (raised while a finalizer runs) still stops it."""

from __future__ import annotations

import signal

import pytest

from plexus.demo import Federation


def test_a_dropped_keyboard_interrupt_is_raised_again_at_the_next_event(tmp_path):
    fed = Federation(tmp_path)
    fed.check_alive()   # nothing started, nothing interrupted: no error
    try:   # what Python does when the handler raises inside a __del__: prints "Exception ignored", goes on
        fed.interrupt(signal.SIGINT, None)
    except KeyboardInterrupt:
        pass
    with pytest.raises(KeyboardInterrupt):
        fed.check_alive()
