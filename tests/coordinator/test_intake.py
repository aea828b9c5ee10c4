"""An upload's journal (coordinator.intake.Upload): what a fold may have to take out again, in a spool file for a
stream read from the network, or the chunks themselves for a stream already held in memory (`in_memory`)."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.aggregate import WeightedSum
from coordinator.intake import Upload, read_blocks
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
    layout, kept = _update([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    total = WeightedSum(layout)
    first = Upload(layout, tmp_path / "a.part", fold=total.begin(3))
    first.receive(_chunks(kept), in_memory=in_memory)
    first.accept()
    before = total.exact().copy()

    _, good = _update([100.0] * 6)
    bad = good[:8] + np.array([np.nan] * 4, np.float32).tobytes()   # two elements fold, then NaN
    second = Upload(layout, tmp_path / "b.part", fold=total.begin(5))
    with pytest.raises(IntegrityError, match="NaN or Inf"):
        second.receive(_chunks(bad), in_memory=in_memory)
    assert not np.array_equal(total.exact(), before)   # its first chunk is in the sum
    second.withdraw()
    second.discard()
    np.testing.assert_array_equal(total.exact(), before)
    assert not (tmp_path / "b.part").exists()
    assert (tmp_path / "a.part").exists() != in_memory   # a stream in memory writes no spool file


@MODES
def test_an_update_moved_to_another_sum_leaves_the_first_as_it_was(tmp_path, in_memory):
    layout, blob = _update(np.arange(10, dtype=np.float32))
    old, new = WeightedSum(layout), WeightedSum(layout)
    empty = old.exact().copy()
    upload = Upload(layout, tmp_path / "u.part", fold=old.begin(2))
    upload.receive(_chunks(blob, 12), in_memory=in_memory)
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
    layout, blob = _update([0.5, -1.5, 2.25])
    upload = Upload(layout, tmp_path / "h.part")   # a rule that holds every update folds nothing as it streams
    upload.receive(_chunks(blob, 4), in_memory=in_memory)
    held = upload.keep()
    assert held == tmp_path / "h.held"
    assert b"".join(read_blocks(held)) == blob
    upload.withdraw()   # kept: nothing to take out, and the file stays
    upload.discard()
    assert held.exists()
