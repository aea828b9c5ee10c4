"""plexus.files: a file's blocks passed to a second reader (a checkpoint's SHA-256) on a helper thread, behind the
writer but never behind the producer's reuse of its buffers (fed_beside); a large file handed to the disk as it is
written, so that its fsync has little left to wait for (write_atomically)."""

from __future__ import annotations

import hashlib
import threading
import time

import pytest

from plexus import files
from plexus.files import Blocks, fed_beside, write_atomically


def in_turn(count: int, kept: int, size: int = 64):
    """`count` blocks written into `kept` buffers in turn (block i holds the byte i % 251), each a view of its
    buffer: a block read after `kept` more were produced would hold another block's bytes."""
    buffers = [bytearray(size) for _ in range(kept)]
    for i in range(count):
        buffer = buffers[i % kept]
        buffer[:] = bytes([i % 251]) * size
        yield memoryview(buffer)


def helpers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "plexus-fed-beside"]


@pytest.mark.parametrize("kept", [1, 2, 3, 4, 8])
def test_every_block_reaches_both_readers_in_order_and_intact(kept):
    seen = []

    def slow(block):   # a reader behind the writer: the producer must wait for it rather than reuse its buffer
        time.sleep(0.001)
        seen.append(bytes(block))

    written = [bytes(block) for block in fed_beside(Blocks(in_turn(40, kept), kept), slow)]

    expected = [bytes([i % 251]) * 64 for i in range(40)]
    assert written == expected and seen == expected
    assert not helpers()


def test_a_digest_fed_beside_equals_the_digest_of_the_whole():
    digest = hashlib.sha256()
    blocks = list(fed_beside(Blocks(in_turn(100, 4, 4096), 4), digest.update))
    assert len(blocks) == 100
    assert digest.hexdigest() == hashlib.sha256(b"".join(bytes([i % 251]) * 4096 for i in range(100))).hexdigest()


def test_what_the_second_reader_raises_reaches_the_caller_and_the_helper_ends():
    def fails(block):
        if block[0] == 5:
            raise OSError("the second reader failed on block 5")

    with pytest.raises(OSError, match="block 5"):
        for _ in fed_beside(Blocks(in_turn(50, 4), 4), fails):
            pass
    assert not helpers()


def test_what_the_producer_raises_reaches_the_caller_and_the_helper_ends():
    def broken():
        yield from in_turn(3, 4)
        raise ValueError("the mean could not be taken")

    with pytest.raises(ValueError, match="could not be taken"):
        list(fed_beside(Blocks(broken(), 4), lambda block: None))
    assert not helpers()


def test_a_caller_that_stops_early_ends_the_helper():
    taken = fed_beside(Blocks(in_turn(50, 4), 4), lambda block: None)
    next(taken)
    next(taken)
    taken.close()   # a failed file write: write_atomically stops reading
    assert not helpers()


def test_a_large_file_is_handed_to_the_disk_as_it_is_written_and_ends_whole(tmp_path, monkeypatch):
    started = []
    real = files._SYNC_FILE_RANGE
    if real is None:
        pytest.skip("no sync_file_range in this C library")

    def recorded(fd, offset, nbytes, flags):
        started.append((offset, nbytes))
        return real(fd, offset, nbytes, flags)

    monkeypatch.setattr(files, "_SYNC_FILE_RANGE", recorded)
    blocks = [bytes([i]) * (3 << 20) for i in range(9)]   # 27 MiB in 3 MiB blocks
    path = write_atomically(tmp_path / "big", b"head", iter(blocks))
    assert path.read_bytes() == b"head" + b"".join(blocks)
    step = files.WRITEBACK_BYTES
    assert [offset for offset, _ in started] == [0, 4 + (9 << 20), 4 + (18 << 20)]   # each once 8 MiB more are written
    assert all(nbytes >= step for _, nbytes in started)
    assert sum(nbytes for _, nbytes in started) <= len(path.read_bytes())

    started.clear()
    write_atomically(tmp_path / "scratch", iter(blocks), sync=False)   # no fsync: nothing to start early
    assert started == []
