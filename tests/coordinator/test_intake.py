"""An upload's journal (coordinator.intake.Upload): what a fold may have to take out again, in a spool file, or in
a buffer lent by MemoryJournals (the simulator's engine), which the next upload reuses."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.aggregate import WeightedSum
from coordinator.intake import KEPT_BUFFERS, MemoryJournals, Upload, read_blocks
from plexus.errors import IntegrityError
from plexus.wire import encode, iter_chunks

MODES = pytest.mark.parametrize("in_memory", [False, True], ids=["spooled", "in-memory"])


def _update(values) -> tuple:
    layout, blob = encode({"w": np.asarray(values, np.float32)})
    return layout, bytes(blob)


def _chunks(blob: bytes, size: int = 8):
    return ((offset, bytes(piece)) for offset, piece in iter_chunks(bytearray(blob), size))


@MODES
def test_an_update_refused_part_way_comes_out_of_the_sum_again(tmp_path, in_memory):
    memory = MemoryJournals() if in_memory else None
    layout, kept = _update([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    total = WeightedSum(layout)
    first = Upload(layout, tmp_path / "a.part", fold=total.begin(3), memory=memory)
    first.receive(_chunks(kept))
    first.accept()
    before = total.exact().copy()

    _, good = _update([100.0] * 6)
    bad = good[:8] + np.array([np.nan] * 4, np.float32).tobytes()   # two elements fold, then NaN
    second = Upload(layout, tmp_path / "b.part", fold=total.begin(5), memory=memory)
    with pytest.raises(IntegrityError, match="NaN or Inf"):
        second.receive(_chunks(bad))
    assert not np.array_equal(total.exact(), before)   # its first chunk is in the sum
    second.withdraw()
    second.discard()
    np.testing.assert_array_equal(total.exact(), before)
    assert not (tmp_path / "b.part").exists()
    assert (tmp_path / "a.part").exists() != in_memory   # a journal in memory is no spool file


@MODES
def test_an_update_moved_to_another_sum_leaves_the_first_as_it_was(tmp_path, in_memory):
    memory = MemoryJournals() if in_memory else None
    layout, blob = _update(np.arange(10, dtype=np.float32))
    old, new = WeightedSum(layout), WeightedSum(layout)
    empty = old.exact().copy()
    upload = Upload(layout, tmp_path / "u.part", fold=old.begin(2), memory=memory)
    upload.receive(_chunks(blob, 12))
    upload.move(new.begin(2))
    upload.accept()
    np.testing.assert_array_equal(old.exact(), empty)
    reference = WeightedSum(layout)
    direct = Upload(layout, tmp_path / "r.part", fold=reference.begin(2))
    direct.receive(_chunks(blob))
    direct.accept()
    np.testing.assert_array_equal(new.exact(), reference.exact())


@MODES
def test_a_held_update_is_kept_on_disk_byte_for_byte(tmp_path, in_memory):
    memory = MemoryJournals() if in_memory else None
    layout, blob = _update([0.5, -1.5, 2.25])
    upload = Upload(layout, tmp_path / "h.part", memory=memory)   # a rule that holds every update folds nothing
    upload.receive(_chunks(blob, 4))
    held = upload.keep()
    assert held == tmp_path / "h.held"
    assert b"".join(read_blocks(held)) == blob
    upload.withdraw()   # kept: nothing to take out, and the file stays
    upload.discard()
    assert held.exists()


def test_the_next_upload_reuses_a_finished_ones_buffer_and_uploads_in_flight_never_share_one(tmp_path):
    memory = MemoryJournals()
    layout, blob = _update(np.arange(64, dtype=np.float32))
    total = WeightedSum(layout)
    first, second = (Upload(layout, tmp_path / f"{n}.part", fold=total.begin(1), memory=memory) for n in "ab")
    first.receive(_chunks(blob, 32))
    second.receive(_chunks(blob, 32))   # while the first still holds its journal
    assert first._buffer is not second._buffer
    lent = first._buffer
    first.accept()
    first.discard()
    third = Upload(layout, tmp_path / "c.part", fold=total.begin(1), memory=memory)
    third.receive(_chunks(blob, 32))
    assert third._buffer is lent   # the finished upload's, at its full size already
    second.withdraw()   # the second comes out again: its journal held its own bytes, not the third's
    second.discard()
    third.accept()
    first_only = WeightedSum(layout)
    for _ in range(2):
        once = Upload(layout, tmp_path / "r.part", fold=first_only.begin(1))
        once.receive(_chunks(blob, 32))
        once.accept()
        once.discard()
    np.testing.assert_array_equal(total.exact(), first_only.exact())


def test_only_a_few_free_buffers_are_kept():
    memory = MemoryJournals()
    buffers = [bytearray(8) for _ in range(KEPT_BUFFERS + 3)]
    for buffer in buffers:
        memory.give(buffer)
    taken = [memory.take() for _ in range(KEPT_BUFFERS + 1)]
    assert all(any(t is b for b in buffers) for t in taken[:KEPT_BUFFERS])
    assert taken[-1] == bytearray() and not any(taken[-1] is b for b in buffers)   # a new one, once all are lent
