"""The served model: the same chunks whether it is held in memory or read from its checkpoint file."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.served import ServedModel
from plexus.errors import IntegrityError
from plexus.wire import encode


def test_memory_and_file_give_the_same_chunks(tmp_path):
    layout, blob = encode({"w": np.arange(1000, dtype=np.float32), "b": np.ones(3, np.float32)})
    path = tmp_path / "model.bin"
    path.write_bytes(b"HEADER" + bytes(blob))
    from_memory = list(ServedModel.in_memory(layout, blob).chunks(1024))
    from_file = list(ServedModel.from_file(layout, path, 6).chunks(1024))
    assert from_memory == from_file
    assert b"".join(d for _, d in from_file) == bytes(blob)
    assert [o for o, _ in from_file] == list(range(0, len(blob), len(from_file[0][1])))


def test_a_checkpoint_shorter_than_its_layout_is_refused(tmp_path):
    layout, blob = encode({"w": np.arange(100, dtype=np.float32)})
    path = tmp_path / "model.bin"
    path.write_bytes(bytes(blob)[:-4])
    with pytest.raises(IntegrityError, match="shorter than its header says"):
        list(ServedModel.from_file(layout, path, 0).chunks(64))
