"""Durable file replacement: a crash leaves the old file or the complete new one, never a torn one."""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import os
import queue
import secrets
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from plexus.errors import FailedPrecondition

TMP_PATTERN = ".*.tmp"   # write_atomically's files in progress; one left behind is from an interrupted write


def temp_beside(path: Path) -> Path:
    """A fresh name for a file being written to replace `path`, in its folder (TMP_PATTERN)."""
    return path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")


def write_atomically(path: Path, *parts, mode: int = 0o644, finish=None, sync: bool = True) -> Path:
    """Write `parts` in order to a new file beside `path`, fsync it, rename it over `path`, and fsync the
    folder so the rename itself survives a power cut. A part is bytes-like, or an iterable of bytes-like
    blocks written as they are produced (a model written without ever being whole in memory). `mode` is
    set at creation, so a private file is never readable by others, even briefly. `finish(fh)`, if given,
    runs after the parts and before the sync: to patch in what only the whole data determines (a checksum).
    `sync=False` skips both fsyncs: still never torn, but a power cut may lose it (throwaway files only)."""
    path = Path(path)
    tmp = temp_beside(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as fh:
            os.fchmod(fh.fileno(), mode)
            written = started = 0
            for part in parts:
                for block in write_blocks(part):
                    written += fh.write(block)
                    if sync and written - started >= WRITEBACK_BYTES:
                        fh.flush()
                        started = _start_writeback(fh.fileno(), started, written)
            if finish is not None:
                finish(fh)
            fh.flush()
            if sync:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if not sync:
        return path
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


# While a large file is written, the kernel is told every this many bytes to start writing them to the disk
# (sync_file_range, Linux): by the fsync at the end most of it is there, and the fsync waits for the rest only
# (docs/performance.md, "A large file is handed to the disk as it is written").
WRITEBACK_BYTES = 8 << 20


def _writeback_call():
    """libc's sync_file_range, or None where there is none (not Linux, not glibc)."""
    try:
        call = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).sync_file_range
    except (OSError, AttributeError, TypeError):
        return None
    call.argtypes, call.restype = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint], ctypes.c_int
    return call


_SYNC_FILE_RANGE = _writeback_call()
_SYNC_FILE_RANGE_WRITE = 2


def _start_writeback(fd: int, start: int, end: int) -> int:
    """Ask the kernel to start writing bytes [start, end) of `fd` to the disk, without waiting for it; returns
    `end`. Only an early start: the fsync after it is what makes the file durable, so a refusal changes nothing."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, start, end - start, _SYNC_FILE_RANGE_WRITE)
    return end


def write_blocks(part):
    """A part as write_atomically takes it: a bytes-like object, or an iterable of them."""
    try:
        return (memoryview(part),)
    except TypeError:   # not bytes-like: an iterable of blocks
        return part


def lock_exclusively(path: Path, what: str) -> int:
    """Take an exclusive lock on `path` (created if need be) for as long as the returned descriptor stays
    open, and write our PID into it; refuse, naming the holder's PID, if another process (or another
    open of the same file) holds it. flock, not lockf: two opens in one process conflict too."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        raise FailedPrecondition(f"{what} is in use: {'process ' + holder if holder.isdigit() else 'another process'} "
                                 f"holds the lock {path}; stop that process first, or use another directory") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


@dataclass(frozen=True)
class Blocks:
    """Consecutive blocks of a file's data (bytes-like), each valid until `kept` more have been taken (a producer
    that writes each into one of `kept` buffers in turn): `fed_beside` may then read them a while longer."""

    blocks: Iterable
    kept: int = 1

    def __iter__(self) -> Iterator:
        return iter(self.blocks)


def fed_beside(blocks: Blocks, each: Callable[[memoryview], None]) -> Iterator:
    """`blocks` in order, each also passed to `each` (a digest's update) on a helper thread, up to `kept - 2`
    blocks behind the caller: what `each` costs overlaps producing the blocks and what the caller does with them
    (writing a checkpoint: its SHA-256 beside the mean's blocks and the file's writes; all three release the GIL).
    With kept < 3 there is no room and `each` runs in the caller's thread. Every block has been through `each`
    once this generator is exhausted; whatever `each` raises reaches the caller, and the helper has ended once
    this generator has (exhausted, closed or failed)."""
    depth = blocks.kept - 2
    if depth < 1:
        for block in blocks:
            each(block)
            yield block
        return
    fed: queue.Queue = queue.Queue(maxsize=depth)
    failed: list[BaseException] = []
    end = object()

    def feed() -> None:
        while (block := fed.get()) is not end:
            if not failed:
                try:
                    each(block)
                except BaseException as exc:   # noqa: BLE001 (raised in the caller's thread)
                    failed.append(exc)

    helper = threading.Thread(target=feed, name="plexus-fed-beside", daemon=True)
    helper.start()
    try:
        for block in blocks:
            if failed:
                raise failed[0]
            fed.put(block)   # waits while the helper is `depth` blocks behind: no buffer is reused under it
            yield block
    finally:
        fed.put(end)
        helper.join()
    if failed:
        raise failed[0]
