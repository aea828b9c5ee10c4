"""Deadlines for tests, scaled for slow or loaded machines: tests wait on events, never on the clock.

PLEXUS_TEST_TIME_SCALE (default 3) multiplies every deadline a test waits under; a deadline only
bounds how long a failing test takes, so a generous one costs nothing when the test passes."""

from __future__ import annotations

import os
import time

SCALE = float(os.environ.get("PLEXUS_TEST_TIME_SCALE", "3"))


def scaled(seconds: float) -> float:
    return seconds * SCALE


def wait_until(predicate, timeout: float = 30.0, what: str = "condition"):
    """Poll predicate until it returns something truthy (and return that), within a scaled deadline."""
    deadline = time.monotonic() + scaled(timeout)
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {scaled(timeout):.0f}s waiting for {what}")
        time.sleep(0.02)
