"""The malloc arena cap the coordinator and site processes set at start."""

from __future__ import annotations

import subprocess
import sys


def test_glibc_takes_the_arena_cap():
    # In a fresh interpreter, as `plexus coordinator run` calls it: before any worker thread exists.
    code = "from plexus.memory import limit_malloc_arenas as f; print(f(2))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True"
