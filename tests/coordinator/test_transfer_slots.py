"""TransferSlots: at most `limit` model transfers at once, whatever the number of sites."""

from __future__ import annotations

import threading
import time

import pytest

from coordinator.service import TransferSlots
from plexus.errors import FailedPrecondition

from timing import scaled


class _Context:
    def __init__(self, active: bool = True):
        self.active = active

    def is_active(self) -> bool:
        return self.active


def test_no_more_than_the_limit_transfer_at_once():
    slots, inside, peak, lock, full = TransferSlots(3), [0], [0], threading.Lock(), threading.Event()

    def transfer():
        with slots.slot(_Context()):
            with lock:
                inside[0] += 1
                peak[0] = max(peak[0], inside[0])
                if inside[0] == 3:
                    full.set()
            # The first three hold their slots until all three are in, however slowly threads start;
            # a fourth let in by a broken limit would then be inside with them.
            full.wait(scaled(10))
            time.sleep(0.02)
            with lock:
                inside[0] -= 1

    threads = [threading.Thread(target=transfer) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(scaled(10))

    assert peak[0] == 3 and inside[0] == 0


def test_a_call_that_ends_while_waiting_gives_up_and_takes_no_slot():
    slots = TransferSlots(1)
    context = _Context()
    with slots.slot(_Context()):
        threading.Timer(0.1, lambda: setattr(context, "active", False)).start()
        with pytest.raises(FailedPrecondition, match="ended while it waited for a transfer slot"):
            with slots.slot(context):
                pass
    with slots.slot(_Context()):   # the slot came back once its holder finished
        pass


def test_one_holder_takes_one_slot_at_a_time_and_leaves_the_others_to_the_rest():
    slots, second, inside = TransferSlots(3), threading.Event(), threading.Event()

    def again():
        with slots.slot(_Context(), "a"):
            second.set()

    with slots.slot(_Context(), "a"):
        thread = threading.Thread(target=again)
        thread.start()
        with slots.slot(_Context(), "b"):   # a free slot, and b holds none
            inside.set()
        assert inside.is_set() and not second.is_set()   # a's second transfer waits for its first
    thread.join(scaled(10))
    assert second.is_set()
