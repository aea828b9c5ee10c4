"""Process-level memory settings for the long-running Plexus processes."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from pathlib import Path

log = logging.getLogger("plexus")

# glibc's mallopt parameter numbers (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -2, -3, -8
_MMAP_THRESHOLD_MAX = 32 << 20   # the largest M_MMAP_THRESHOLD glibc takes on a 64-bit machine
KEPT_FREE_BYTES = 1 << 30
COORDINATOR_KEPT_FREE_BYTES = 64 << 20


def _mallopt(settings: dict[int, int]) -> bool:
    """Apply glibc mallopt settings; True if the C library took every one (False where it is not glibc)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    taken = True
    for param, value in settings.items():
        if not mallopt(param, value):
            log.debug("mallopt(%d, %d) was refused", param, value)
            taken = False
    return taken


def limit_malloc_arenas(arenas: int = 2) -> bool:
    """Cap glibc's malloc arenas; True if the C library took the setting.

    glibc gives busy threads their own arenas (up to 8 per core), and a freed megabyte-sized
    buffer (a gRPC message, a chunk) stays in the arena of the thread that freed it. In a gRPC
    server whose many handler threads each pass model chunks through, that retained memory grows
    with the number of sites; 2 arenas bound it at little cost in round time (docs/performance.md).
    Call it before the process starts threads. A no-op (False) where the C library is not glibc.
    """
    return _mallopt({_M_ARENA_MAX: arenas})


def keep_freed_memory(kept: int = KEPT_FREE_BYTES) -> bool:
    """Keep freed memory for the next allocation instead of handing it back to the kernel; True if glibc took it.

    A worker process that allocates the same buffers over and over (a batch's tensors, an update's chunks) gets
    them, by default, as fresh mappings (above 128 KiB) or from a heap trimmed after each free: each time the
    kernel faults their pages in again, which in a virtual machine costs more than the copy that fills them.
    Here, blocks up to 32 MiB come from the heap and up to `kept` bytes of freed heap stay mapped: the
    process's memory stays at its peak, not above it. Call it first thing in a worker process.
    """
    return _mallopt({_M_MMAP_THRESHOLD: _MMAP_THRESHOLD_MAX, _M_TRIM_THRESHOLD: kept, _M_TOP_PAD: 64 << 20})


def set_up_coordinator() -> bool:
    """malloc as the coordinator process has it (`plexus coordinator run`): arenas capped, and up to 64 MiB of
    freed memory kept for the next allocation. A split-learning job allocates its wire messages afresh for every
    batch (a megabyte or so each); given back to the kernel after each, they cost their page faults again every
    batch (docs/performance.md, "The coordinator keeps up to 64 MiB of freed memory"). Call it before the process
    starts threads. True if glibc took both settings."""
    capped = limit_malloc_arenas()
    return keep_freed_memory(COORDINATOR_KEPT_FREE_BYTES) and capped


def set_up_simulation() -> None:
    """malloc as a simulation's processes have it (`plexus simulate`, its workers, bench/simulate.py): arenas capped
    as in the coordinator, updates passing through one after another, and each update reusing the last one's pages
    (the process's memory stays at its peak). Call it before the process starts threads."""
    limit_malloc_arenas()
    keep_freed_memory()


def machine_memory(cgroup: Path = Path("/sys/fs/cgroup/memory.max")) -> int:
    """The memory this process may use, in bytes: the machine's physical memory, or its cgroup's (v2) memory.max
    where that is lower (a container's limit)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = cgroup.read_text().strip()
    except OSError:
        return total
    return min(total, int(limit)) if limit.isdigit() else total


def default_model_cap() -> int:
    """The largest model a site or relay takes by default (policy.max_model_bytes, tier.max_model_bytes): a quarter
    of the memory it may use, since training or summing holds the model a few times over."""
    return machine_memory() // 4
