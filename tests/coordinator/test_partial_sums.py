"""A relay's exact partial sum folded into the coordinator's WeightedSum: the same integers, so the same mean
as folding each of its children's updates, whatever the split; taken out again exactly when it fails."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.aggregate import WeightedSum, exact_layout
from coordinator.service import check_join, update_header
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


@pytest.mark.parametrize("updates, num_samples, ok", [(2, 10, True), (10, 10, True), (1, 10, False),
                                                      (11, 10, False), (2**32 - 1, 1000, False)])
def test_a_partial_sum_holds_one_update_per_contributor_at_least_and_weighs_one_per_update(updates, num_samples, ok):
    """Before, 2**32 - 1 updates of total weight 1000 was taken as told."""
    header = fpb.UpdateHeader(task_id="t", job_id="j", round=1, num_samples=num_samples,
                              partial=fpb.PartialSum(updates=updates, contributors=["a", "b"]))
    if ok:
        assert update_header(header, relay=True).partial.updates == updates
    else:
        with pytest.raises(IntegrityError, match=f"a partial sum of {updates} update"):
            update_header(header, relay=True)


def test_a_relay_may_stand_for_more_sites_than_a_site_has_datasets():
    """A relay names its whole subtree at Join and its contributors in its sum, as paths of site names: 256 of
    them (the cap on a site's models and datasets) or a 63-character name below another relay were refused."""
    below = [f"relay-2/{'h' * 60}{i:03d}" for i in range(300)]
    check_join(fpb.JoinRequest(agent_version="0.1.0", children=["relay-2", *below]))
    header = fpb.UpdateHeader(task_id="t", job_id="j", round=1, num_samples=1000,
                              partial=fpb.PartialSum(updates=301, contributors=["relay-2", *below]))
    assert len(update_header(header, relay=True).partial.contributors) == 301
    with pytest.raises(IntegrityError, match="must be 1-512 printable characters"):
        check_join(fpb.JoinRequest(agent_version="0.1.0", children=["x" * 513]))


def test_a_relay_s_partial_sum_takes_one_participant_s_part_of_the_range_at_most():
    """Before, a partial sum of elements near 2**62 was taken whole, and a direct site's honest update was then
    refused as 'too large', blamed for it. A relay's sum may hold what a site of its whole weight could."""
    top = WeightedSum(LAYOUT, sites=2)   # the round: one relay and one site
    hog = np.zeros(LAYOUT.total_elements, np.int64)
    hog[0] = 2**62 - 2**20
    fold = top.begin_exact(1000, 2)
    with pytest.raises(IntegrityError, match="takes more than one participant's part of the fixed-point range"):
        fold.add(hog.tobytes(), float(hog[0]))
    fold.undo(lambda: [b""])
    honest = summed(updates(2))
    fold, _ = fold_exact(top, honest)
    fold.finish()
    (update, weight), = updates(1, seed=5)
    layout, blob = encode(update)
    top.fold([bytes(blob)], weight, max(float(np.abs(v).max()) for v in update.values()), nbytes=layout.total_bytes)
    assert top.count == 3   # the relay's two updates and the site's, refused before
