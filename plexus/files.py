"""Durable file replacement: a crash leaves the old file or the complete new one, never a torn one."""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def write_atomically(path: Path, *parts, mode: int = 0o644) -> Path:
    """Write `parts` in order to a new file beside `path`, fsync it, rename it over `path`, and fsync the
    folder so the rename itself survives a power cut. A part is bytes-like, or an iterable of bytes-like
    blocks written as they are produced (a model written without ever being whole in memory). `mode` is
    set at creation, so a private file is never readable by others, even briefly."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as fh:
            os.fchmod(fh.fileno(), mode)
            for part in parts:
                for block in write_blocks(part):
                    fh.write(block)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


def write_blocks(part):
    """A part as write_atomically takes it: a bytes-like object, or an iterable of them."""
    try:
        return (memoryview(part),)
    except TypeError:   # not bytes-like: an iterable of blocks
        return part
