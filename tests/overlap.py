"""Two runs in two threads that overlap, for tests of what must not depend on another thread's timing."""

from __future__ import annotations

import threading


def overlapping(run) -> dict[int, object]:
    """{1: run(1, pause), 2: run(2, pause)}, run 1 in a thread of its own: run 1 pauses half-way until run 2 comes in
    (1 s at most: where runs take turns, it cannot), and run 2 pauses half-way until run 1 has ended. `run(seed,
    pause)` calls `pause()` once, half-way through."""
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    got = {}

    def first():
        try:
            got[1] = run(1, lambda: (first_in.set(), second_in.wait(1.0)))
        finally:
            first_out.set()

    thread = threading.Thread(target=first)
    thread.start()
    try:
        if not first_in.wait(30):
            raise AssertionError("the first run never got half-way")
        got[2] = run(2, lambda: (second_in.set(), first_out.wait(30)))
    finally:
        thread.join(30)
    return got
