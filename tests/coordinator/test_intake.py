"""An upload's journal (coordinator.intake.Upload): what a fold may have to take out again, in a spool file for a
stream read from the network, or the stream itself for one held in memory whole (`replay`)."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.aggregate import WeightedSum
from coordinator.intake import Upload, read_blocks
from plexus.errors import IntegrityError
from plexus.wire import encode, iter_chunks

MODES = pytest.mark.parametrize("held", [False, True], ids=["spooled", "held-in-memory"])


def _update(values) -> tuple:
    layout, blob = encode({"w": np.asarray(values, np.float32)})
    return layout, bytes(blob)


def _chunks(blob: bytes, size: int = 8):
    return ((offset, bytes(piece)) for offset, piece in iter_chunks(bytearray(blob), size))


def _receive(upload: Upload, blob: bytes, size: int, held: bool) -> None:
    """As the servicer does: a stream held in memory is given again as its journal, every chunk of it."""
    replay = (lambda: (data for _, data in _chunks(blob, size))) if held else None
    upload.receive(_chunks(blob, size), replay=replay)


@MODES
def test_an_update_refused_part_way_comes_out_of_the_sum_again(tmp_path, held):
    layout, kept = _update([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    total = WeightedSum(layout)
    first = Upload(layout, tmp_path / "a.part", fold=total.begin(3))
    _receive(first, kept, 8, held)
    first.accept()
    before = total.exact().copy()

    _, good = _update([100.0] * 6)
    bad = good[:8] + np.array([np.nan] * 4, np.float32).tobytes()   # two elements fold, then NaN
    second = Upload(layout, tmp_path / "b.part", fold=total.begin(5))
    with pytest.raises(IntegrityError, match="NaN or Inf"):
        _receive(second, bad, 8, held)   # its replay would give the NaN chunk too: only the folded part is read
    assert not np.array_equal(total.exact(), before)   # its first chunk is in the sum
    second.withdraw()
    second.discard()
    np.testing.assert_array_equal(total.exact(), before)
    assert not (tmp_path / "b.part").exists()
    assert (tmp_path / "a.part").exists() != held   # a stream held in memory writes no spool file


@MODES
def test_an_update_moved_to_another_sum_leaves_the_first_as_it_was(tmp_path, held):
    layout, blob = _update(np.arange(10, dtype=np.float32))
    old, new = WeightedSum(layout), WeightedSum(layout)
    empty = old.exact().copy()
    upload = Upload(layout, tmp_path / "u.part", fold=old.begin(2))
    _receive(upload, blob, 12, held)
    upload.move(new.begin(2))
    upload.accept()
    np.testing.assert_array_equal(old.exact(), empty)
    reference = WeightedSum(layout)
    direct = Upload(layout, tmp_path / "r.part", fold=reference.begin(2))
    direct.receive(_chunks(blob))
    direct.accept()
    np.testing.assert_array_equal(new.exact(), reference.exact())


@MODES
def test_a_held_update_is_kept_on_disk_byte_for_byte(tmp_path, held):
    layout, blob = _update([0.5, -1.5, 2.25])
    upload = Upload(layout, tmp_path / "h.part")   # a rule that holds every update folds nothing as it streams
    _receive(upload, blob, 4, held)
    kept = upload.keep()
    assert kept == tmp_path / "h.held"
    assert b"".join(read_blocks(kept)) == blob
    upload.withdraw()   # kept: nothing to take out, and the file stays
    upload.discard()
    assert kept.exists()


def test_a_journal_given_again_is_read_only_as_far_as_the_stream_was_received(tmp_path):
    """A stream cut part-way (its round closed): what comes out is what went in, though the replay, being the whole
    stream, goes on past it."""
    layout, blob = _update(np.arange(16, dtype=np.float32))
    total = WeightedSum(layout)
    empty = total.exact().copy()
    upload = Upload(layout, tmp_path / "c.part", fold=total.begin(7))

    def cut_after_two():
        for index, chunk in enumerate(_chunks(blob, 16)):
            if index == 2:
                raise TimeoutError("the round closed")
            yield chunk

    with pytest.raises(TimeoutError):
        upload.receive(cut_after_two(), replay=lambda: (data for _, data in _chunks(blob, 16)))
    assert not np.array_equal(total.exact(), empty)
    upload.withdraw()
    np.testing.assert_array_equal(total.exact(), empty)
