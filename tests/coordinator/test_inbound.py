"""The coordinator's reader of a client stream (coordinator.service.Inbound): a network stream through a helper
thread that times it out, a stream already in memory read as it is."""

from __future__ import annotations

import threading
import time

import pytest

from coordinator.service import Inbound
from plexus.errors import FailedPrecondition, TimedOut


def _helpers() -> int:
    return sum(t.name == "plexus-inbound" for t in threading.enumerate())


def test_a_stream_in_memory_is_read_in_order_without_a_helper_thread():
    before = _helpers()
    inbound = Inbound(("a", "b", "c"), idle_s=5.0, what="the update")
    assert _helpers() == before
    assert list(inbound) == ["a", "b", "c"]
    assert inbound.next() is None
    inbound.close()


def test_a_stream_in_memory_is_cut_short_as_a_network_stream_is():
    inbound = Inbound(["a", "b", "c"], idle_s=5.0, what="the update")
    assert inbound.next() == "a"
    inbound.cut(FailedPrecondition("the round closed"))
    with pytest.raises(FailedPrecondition, match="the round closed"):
        inbound.next()


def test_a_network_stream_that_stalls_times_out_through_its_helper():
    stop = threading.Event()

    def stalling():
        yield "a"
        stop.wait(10)   # a sender that goes quiet

    inbound = Inbound(stalling(), idle_s=0.2, what="the update")
    try:
        assert inbound.next() == "a"
        started = time.monotonic()
        with pytest.raises(TimedOut, match="did not arrive within 0.2 s"):
            inbound.next()
        assert time.monotonic() - started < 5
    finally:
        stop.set()
        inbound.close()
