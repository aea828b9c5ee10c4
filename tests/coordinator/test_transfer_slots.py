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
