"""A relay's exact partial sum folded into the coordinator's WeightedSum: the same integers, so the same mean
as folding each of its children's updates, whatever the split; taken out again exactly when it fails."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.aggregate import WeightedSum, exact_layout
from coordinator.service import update_header
from plexus.errors import IntegrityError
from plexus.proto.plexus.v1 import federation_pb2 as fpb
from plexus.wire import Layout, encode

LAYOUT = Layout.build([("a", "F32", (1000,)), ("b", "F32", (3, 7)), ("c", "I64", (5,))])


def updates(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [({"a": rng.normal(size=1000).astype(np.float32), "b": rng.normal(size=(3, 7)).astype(np.float32),
              "c": rng.integers(0, 9, 5)}, int(rng.integers(1, 500))) for _ in range(n)]


def summed(group) -> WeightedSum:
    total = WeightedSum(LAYOUT, sites=len(group))
    for update, weight in group:
        layout, blob = encode(update)
        total.fold([bytes(blob)], weight, max(float(np.abs(v).max()) for v in update.values()),
                   nbytes=layout.total_bytes)
    return total


def fold_exact(into: WeightedSum, part: WeightedSum, *, piece: int = 1001, stop: int | None = None):
    exact = part.exact()
    fold = into.begin_exact(part.total_weight, part.count)
    data = exact.tobytes()[:stop]
    for k in range(0, len(data), piece):   # pieces split elements across their edges
        fold.add(data[k:k + piece], float(np.abs(exact).max()))
    return fold, data


@pytest.mark.parametrize("split", [(3, 4), (1, 6), (2, 2, 3)])
def test_partial_sums_give_the_flat_mean_bit_for_bit(split):
    ups = updates(7)
    flat = summed(ups)
    top, start = WeightedSum(LAYOUT, sites=len(split)), 0
    for size in split:
        fold, _ = fold_exact(top, summed(ups[start:start + size]))
        fold.finish()
        start += size
    assert (top.total_weight, top.count) == (flat.total_weight, flat.count)
    assert bytes(top.mean_blob()) == bytes(flat.mean_blob())


def test_a_partial_sum_that_fails_part_way_leaves_the_sum_as_it_was():
    ups = updates(5, seed=1)
    top = WeightedSum(LAYOUT, sites=2)
    first, _ = fold_exact(top, summed(ups[:2]))
    first.finish()
    before = top.acc.copy()
    broken, data = fold_exact(top, summed(ups[2:]), stop=5000)
    with pytest.raises(IntegrityError, match="partial sum ended after"):
        broken.finish()
    broken.undo(lambda: [data])
    assert np.array_equal(top.acc, before) and top.total_weight == first.weight


def test_the_exact_layout_is_i64_per_tensor():
    assert [(t.name, t.dtype, t.shape) for t in exact_layout(LAYOUT).tensors] == \
        [("a", "I64", (1000,)), ("b", "I64", (3, 7)), ("c", "I64", (5,))]


def test_only_a_relay_certificate_may_send_a_partial_sum():
    header = fpb.UpdateHeader(task_id="t", job_id="j", round=1, num_samples=10,
                              partial=fpb.PartialSum(updates=2, contributors=["a", "b"]))
    with pytest.raises(IntegrityError, match="only a relay's certificate may send a partial sum"):
        update_header(header)
    assert update_header(header, relay=True).partial.contributors == ("a", "b")
