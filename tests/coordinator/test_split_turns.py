"""The server's turns in a SplitFed epoch: batch t of every site, in name order, before batch t+1 of any; a site
that leaves (or whose plan is shorter) gives its turns up; a waiter whose session is cut stops waiting."""

from __future__ import annotations

import threading
import time

import pytest

from coordinator.drivers.split import Turns, average_parts
from plexus.errors import RoundClosed, TimedOut


def order_of(turns: Turns) -> list[tuple[int, str]]:
    seen = []
    while (turn := turns.current()) is not None:
        seen.append(turn)
        turns.done(turn[1], turn[0])
    return seen


def test_batches_take_turns_by_batch_then_site():
    turns = Turns(["a", "b", "c"], time.monotonic)
    turns.open("a", 2), turns.open("b", 1), turns.open("c", 3)
    assert order_of(turns) == [(0, "a"), (0, "b"), (0, "c"), (1, "a"), (1, "c"), (2, "c")]


def test_a_turn_waits_for_a_site_that_has_not_opened_and_a_leaver_gives_its_turns_up():
    turns = Turns(["a", "b"], time.monotonic)
    turns.open("b", 2)
    assert turns.current() == (0, "a")   # a's plan is not known yet: its turn waits
    turns.leave("a")
    assert order_of(turns) == [(0, "b"), (1, "b")]


def test_a_waiter_proceeds_on_its_turn_and_stops_when_cut():
    turns = Turns(["a", "b"], time.monotonic)
    turns.open("a", 1), turns.open("b", 1)
    done = []
    waiter = threading.Thread(target=lambda: (turns.wait("b", 0, lambda: None), done.append("b")))
    waiter.start()
    time.sleep(0.2)
    assert not done
    turns.done("a", 0)
    waiter.join(5)
    assert done == ["b"]
    late = Turns(["a", "b"], time.monotonic)
    late.open("b", 1)
    with pytest.raises(TimedOut):
        late.wait("b", 0, lambda: TimedOut("cut"))
    late.leave("b")
    with pytest.raises(RoundClosed):
        late.wait("b", 0, lambda: None)


def test_splitfed_averages_the_sites_parts_by_rows():
    import numpy as np

    parts = {"a": (30, {"w": np.full(2, 1.0, np.float32)}), "b": (10, {"w": np.full(2, 5.0, np.float32)})}
    out = average_parts(parts, ["w"])
    assert out["w"].dtype == np.float32 and out["w"].tolist() == [2.0, 2.0]
