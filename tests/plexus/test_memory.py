"""The malloc arena cap the coordinator and site processes set at start."""

from __future__ import annotations

import subprocess
import sys


def test_glibc_takes_the_arena_cap():
    # In a fresh interpreter, as `plexus coordinator run` calls it: before any worker thread exists.
    code = "from plexus.memory import limit_malloc_arenas as f; print(f(2))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True"


# An update's worth of 1 MiB chunks (24), each touched, then all freed, ten times over; print the page faults of the
# last nine.
_REFAULTS = """
import ctypes, ctypes.util, resource, sys
from plexus.memory import keep_freed_memory, set_up_coordinator
taken = {"keep": keep_freed_memory, "coordinator": set_up_coordinator}.get(sys.argv[1], lambda: None)()
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
size = 1 << 20
def once():
    blocks = [libc.malloc(size) for _ in range(24)]
    for block in blocks:
        ctypes.memset(block, 1, size)
    for block in blocks:
        libc.free(block)
once()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(9):
    once()
print(taken, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_kept_freed_memory_is_reused_without_faulting_its_pages_in_again():
    # What the simulation's processes and workers set, so a task's buffers reuse the last task's pages. By default
    # glibc hands the freed chunks back to the kernel (the heap's free top is over its trim threshold), and each
    # time their 6,144 pages (24 MiB) fault in again.
    # The coordinator keeps up to 64 MiB: enough for a split-learning batch's wire messages, or these 24 MiB.
    runs = {mode: subprocess.run([sys.executable, "-c", _REFAULTS, mode], capture_output=True, text=True,
                                 check=True).stdout.split() for mode in ("default", "keep", "coordinator")}
    assert runs["keep"][0] == "True" and runs["coordinator"][0] == "True"
    assert int(runs["default"][1]) >= 8 * 6144
    assert int(runs["keep"][1]) < 500 and int(runs["coordinator"][1]) < 500
