"""Process-level memory settings for the long-running Plexus processes."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from pathlib import Path

log = logging.getLogger("plexus")

_M_ARENA_MAX = -8   # glibc's mallopt parameter number (malloc.h)


def limit_malloc_arenas(arenas: int = 2) -> bool:
    """Cap glibc's malloc arenas; True if the C library took the setting.

    glibc gives busy threads their own arenas (up to 8 per core), and a freed megabyte-sized
    buffer (a gRPC message, a chunk) stays in the arena of the thread that freed it. In a gRPC
    server whose many handler threads each pass model chunks through, that retained memory grows
    with the number of sites; 2 arenas bound it at little cost in round time (docs/performance.md).
    Call it before the process starts threads. A no-op (False) where the C library is not glibc.
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    taken = bool(mallopt(_M_ARENA_MAX, arenas))
    if not taken:
        log.debug("mallopt(M_ARENA_MAX, %d) was refused", arenas)
    return taken


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
