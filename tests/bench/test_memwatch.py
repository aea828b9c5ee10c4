"""bench.memwatch, the sampler of a process tree's peak memory: it counts each process once and answers when its
stdin closes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HOLD = "import sys, time; block = bytearray({n}); block[::4096] = b'x' * len(block[::4096]); sys.stdin.read()"


def test_the_peak_covers_a_child_holding_memory_and_each_process_once():
    """A child touching 64 MiB under this process: the peak sum holds it, and is far below this process's RSS counted
    twice plus the child's (what an in-process sampler that listed itself twice would report)."""
    size = 64 << 20
    child = subprocess.Popen([sys.executable, "-c", HOLD.format(n=size)], stdin=subprocess.PIPE)
    watch = subprocess.Popen([sys.executable, "-m", "bench.memwatch", str(os.getpid())], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, cwd=ROOT)
    try:
        time.sleep(1.5)   # several samples, a PSS one among them
    finally:
        watch.stdin.close()
        peak = json.loads(watch.stdout.read())
        assert watch.wait(timeout=10) == 0
        child.stdin.close()
        child.wait(timeout=10)
    own_kb = int(next(line.split()[1] for line in Path("/proc/self/status").read_text().splitlines()
                      if line.startswith("VmRSS:")))
    assert peak["peak_total_kb"] >= size // 1024
    assert peak["peak_total_kb"] < 2 * own_kb + size // 1024
    assert size // 1024 <= peak["peak_process_kb"]
    assert 0 < peak["peak_pss_kb"] <= peak["peak_total_kb"]
