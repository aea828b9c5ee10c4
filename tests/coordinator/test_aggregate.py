"""Tests for coordinator.aggregate and the FedAvg strategy: exact, order-independent weighted means."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from coordinator.aggregate import FRAC_BITS, MAX_WEIGHT, MaskedSum, WeightedSum
from coordinator.strategies import FedAvg, Sampling
from plexus.errors import IntegrityError, RoundClosed
from plexus.wire import Layout, encode


def _mean(updates: list[tuple[dict[str, np.ndarray], int]], *, pieces=None) -> dict[str, np.ndarray]:
    layout = encode(updates[0][0])[0]
    total = WeightedSum(layout)
    for state, weight in updates:
        blob = encode(state)[1]
        peak = max((float(np.abs(a.astype(np.float64)).max()) for a in state.values() if a.size), default=0.0)
        total.fold(pieces(blob) if pieces else [blob], weight, peak, nbytes=len(blob))
    return total.mean()


def _bits(state: dict[str, np.ndarray]) -> dict[str, bytes]:
    return {k: np.ascontiguousarray(v).reshape(-1).view(np.uint8).tobytes() for k, v in state.items()}


# hand-computed means ---------------------------------------------------------------------

def test_two_sites_weighted_by_samples():
    a = {"w": np.array([1.0, 2.0, 0.25], np.float32), "n": np.array([1, 10, 6], np.int64)}
    b = {"w": np.array([3.0, -2.0, 0.5], np.float32), "n": np.array([2, 3, 0], np.int64)}

    mean = _mean([(a, 1), (b, 3)])

    # w: (1·1 + 3·3)/4, (1·2 − 3·2)/4, (0.25 + 1.5)/4; n: 7/4, 19/4, 6/4 → rint (half to even)
    assert mean["w"].dtype == np.float32 and mean["n"].dtype == np.int64
    assert mean["w"].tolist() == [2.5, -1.0, 0.4375]
    assert mean["n"].tolist() == [2, 5, 2]


def test_integer_means_round_half_to_even():
    sites = [({"n": np.array([1, 2, -1, -3, 7], np.int64)}, 1), ({"n": np.array([2, 3, -2, -2, 7], np.int64)}, 1)]

    # 1.5 → 2, 2.5 → 2, −1.5 → −2, −2.5 → −2, 7 → 7
    assert _mean(sites)["n"].tolist() == [2, 2, -2, -2, 7]


def test_three_sites_dyadic_values_are_exact():
    sites = [({"w": np.array([[0.5, -4.0]]), "b": np.array(1.0, np.float32)}, 2),
             ({"w": np.array([[1.5, 8.0]]), "b": np.array(-1.0, np.float32)}, 3),
             ({"w": np.array([[-0.25, 0.0]]), "b": np.array(0.75, np.float32)}, 3)]

    mean = _mean(sites)

    # w[0]: (1 + 4.5 − 0.75)/8 = 0.59375; w[1]: (−8 + 24)/8 = 2; b: (2 − 3 + 2.25)/8 = 0.15625
    assert mean["w"].shape == (1, 2) and mean["b"].shape == ()
    assert mean["w"].tolist() == [[0.59375, 2.0]]
    assert mean["b"].item() == 0.15625


def test_three_sites_non_dyadic_values_within_the_fixed_point_resolution():
    sites = [({"w": np.array([0.1, 1 / 3, -0.7])}, 1),
             ({"w": np.array([0.2, 2 / 3, 0.3])}, 1),
             ({"w": np.array([0.4, 0.0, 0.9])}, 5)]

    mean = _mean(sites)["w"]

    expected = np.array([(0.1 + 0.2 + 2.0) / 7, (1 / 3 + 2 / 3) / 7, (-0.7 + 0.3 + 4.5) / 7])
    assert np.abs(mean - expected).max() <= 2.0 ** -30


def test_a_single_site_mean_is_its_own_model_when_representable():
    state = {"w": np.array([1.25, -7.5, 1024.0], np.float32), "n": np.array([-5, 0, 9], np.int32)}

    mean = _mean([(state, 17)])

    assert _bits(mean) == _bits(state)


# order and chunking independence -----------------------------------------------------------

_SHAPES = {"a.w": ("<f4", (3, 2)), "b.v": ("<f8", (4,)), "c.n": ("<i4", (3,)), "d.s": ("<f4", ())}
_ELEMENTS = {"<f4": st.floats(-1e3, 1e3, width=32), "<f8": st.floats(-1e3, 1e3), "<i4": st.integers(-1000, 1000)}


@st.composite
def _updates(draw) -> list[tuple[dict[str, np.ndarray], int]]:
    out = []
    for _ in range(draw(st.integers(2, 5))):
        state = {name: draw(hnp.arrays(np.dtype(dt), shape, elements=_ELEMENTS[dt]))
                 for name, (dt, shape) in _SHAPES.items()}
        out.append((state, draw(st.integers(1, 10_000))))
    return out


@settings(max_examples=60, deadline=None, database=None)
@given(data=st.data(), updates=_updates())
def test_any_fold_order_gives_bit_identical_means(data, updates):
    permuted = data.draw(st.permutations(updates))

    reference = _mean(updates)
    again = _mean(permuted)

    assert _bits(again) == _bits(reference)
    for name in _SHAPES:
        assert np.array_equal(again[name].reshape(-1).view(np.uint8), reference[name].reshape(-1).view(np.uint8))
    weights = sum(w for _, w in updates)
    for name in ("a.w", "b.v"):
        exact = sum(s[name].astype(np.float64) * w for s, w in updates) / weights
        assert np.allclose(reference[name], exact, rtol=2e-7, atol=2.0 ** -30)


@settings(max_examples=60, deadline=None, database=None)
@given(data=st.data(), updates=_updates())
def test_splitting_blobs_into_arbitrary_pieces_gives_identical_means(data, updates):
    def pieces(blob: bytes) -> list[bytes]:
        cuts = sorted(data.draw(st.lists(st.integers(0, len(blob)), max_size=12)))
        edges = [0, *cuts, len(blob)]
        return [blob[i:j] for i, j in zip(edges, edges[1:])]   # equal cuts give empty pieces too

    assert _bits(_mean(updates, pieces=pieces)) == _bits(_mean(updates))


def test_byte_by_byte_fold_matches_whole_blob_fold():
    updates = [({"w": np.array([0.1, -0.2, 0.3], np.float32), "n": np.array([3, 4], np.int64)}, 7),
               ({"w": np.array([1.1, 2.2, -3.3], np.float32), "n": np.array([-3, 40], np.int64)}, 2)]

    one_byte = _mean(updates, pieces=lambda blob: [blob[i:i + 1] for i in range(len(blob))])

    assert _bits(one_byte) == _bits(_mean(updates))


# refusals --------------------------------------------------------------------------------

def _sum() -> tuple[WeightedSum, bytes]:
    layout, blob = encode({"w": np.array([1.0, -2.0], np.float32), "n": np.array([3], np.int64)})
    return WeightedSum(layout), blob


@pytest.mark.parametrize("weight", [0, -1, MAX_WEIGHT + 1, 2 ** 40])
def test_check_fits_refuses_weights_outside_the_range(weight):
    total, blob = _sum()

    with pytest.raises(IntegrityError, match=rf"must be in \(0, {MAX_WEIGHT}\]; got {weight}"):
        total.check_fits(weight, 1.0)
    with pytest.raises(IntegrityError):
        total.fold([blob], weight, 3.0, nbytes=len(blob))
    assert total.count == 0 and total.total_weight == 0 and not total.acc.any()


def test_fractional_weights_on_a_dyadic_grid_fold_and_sum_exactly():
    layout, blob = encode({"w": np.array([1.0, -2.0], np.float32)})
    total = WeightedSum(layout)
    for weight in (0.25, 46340 / 65536 * 7):   # staleness-scaled weights (plexus.staleness)
        total.fold([blob], weight, 2.0, nbytes=len(blob))
    assert total.total_weight == 0.25 + 46340 / 65536 * 7
    sums = total.sums()["w"]
    assert sums.tolist() == [0.25 + 46340 / 65536 * 7, -2 * (0.25 + 46340 / 65536 * 7)]


def test_check_fits_accepts_the_extreme_weights():
    total, _ = _sum()

    total.check_fits(1, 1.0)
    total.check_fits(MAX_WEIGHT, 0.25)       # 2**31 · 0.25 = 2**29, inside the 2**30 range


def test_check_fits_refuses_an_update_beyond_the_fixed_point_range():
    total, _ = _sum()
    limit = 2.0 ** (62 - FRAC_BITS)      # Σ n·|x| must stay below this

    total.check_fits(1000, limit / 1000 * 0.99)
    with pytest.raises(IntegrityError, match="exceeds the fixed-point range") as err:
        total.check_fits(1000, 1e9)
    assert "num_samples 1000" in str(err.value) and "diverged" in str(err.value)


def test_the_range_is_shared_by_all_folded_updates():
    layout, blob = encode({"w": np.array([6e8, -1.0])})
    total = WeightedSum(layout)

    total.fold([blob], 1, 6e8, nbytes=len(blob))

    with pytest.raises(IntegrityError, match="fixed-point range"):
        total.check_fits(1, 6e8)              # 1.2e9 > 2**30 in total
    total.check_fits(1, 4e8)                  # 1.0e9 < 2**30
    with pytest.raises(IntegrityError, match="it was not folded"):
        total.fold([blob[:-1]], 1, 4e8, nbytes=len(blob) - 1)   # a refused update uses none of the range
    total.check_fits(1, 4e8)


def test_mean_of_nothing_is_refused():
    total, _ = _sum()

    with pytest.raises(IntegrityError, match="no update was aggregated"):
        total.mean()


@pytest.mark.parametrize("cut", [1, 4, 8, 11])
def test_a_truncated_blob_is_refused_and_leaves_the_sum_untouched(cut):
    total, blob = _sum()
    other = encode({"w": np.array([3.0, 4.0], np.float32), "n": np.array([5], np.int64)})[1]
    total.fold([blob], 1, 3.0, nbytes=len(blob))

    with pytest.raises(IntegrityError, match=f"has {16 - cut} bytes; the layout needs 16; it was not folded"):
        total.fold([other[:len(other) - cut]], 5, 5.0, nbytes=len(other) - cut)
    with pytest.raises(IntegrityError, match="it was not folded"):
        total.fold([], 5, 5.0, nbytes=0)

    assert total.count == 1 and total.total_weight == 1
    assert _bits(total.mean()) == _bits({"w": np.array([1.0, -2.0], np.float32), "n": np.array([3], np.int64)})
    total.fold([other], 1, 5.0, nbytes=len(other))
    assert total.mean()["w"].tolist() == [2.0, 1.0] and total.mean()["n"].tolist() == [4]


def test_a_blob_with_extra_bytes_is_refused():
    total, blob = _sum()

    with pytest.raises(IntegrityError, match="has 20 bytes; the layout needs 16; it was not folded"):
        total.fold([blob, b"\0" * 4], 1, 3.0, nbytes=len(blob) + 4)
    assert total.count == 0 and not total.acc.any()


@pytest.mark.parametrize("delivered", [lambda b: [b[:-3]], lambda b: [b, b"\0"], lambda b: []])
def test_pieces_that_break_their_declared_length_poison_the_sum(delivered):
    total, blob = _sum()
    total.fold([blob], 1, 3.0, nbytes=len(blob))

    with pytest.raises(IntegrityError, match="the round must fail"):
        total.fold(delivered(blob), 1, 3.0, nbytes=len(blob))
    with pytest.raises(IntegrityError, match="unusable"):
        total.mean()                          # never a silently wrong model
    with pytest.raises(IntegrityError, match="unusable"):
        total.fold([blob], 1, 3.0, nbytes=len(blob))


# strategies --------------------------------------------------------------------------------

def test_fedavg_trains_every_available_site_in_sorted_order():
    assert Sampling().configure(3, ["site-c", "site-a", "site-b"], []) == ["site-a", "site-b", "site-c"]
    assert Sampling().configure(1, [], []) == []


def test_fedavg_aggregate_returns_the_weighted_mean():
    current = {"w": np.zeros(3, np.float32)}
    sites = [({"w": np.array([1.0, 2.0, 3.0], np.float32)}, 1), ({"w": np.array([3.0, 2.0, 1.0], np.float32)}, 3)]
    mean = _mean(sites)

    nxt = FedAvg().step(1, current, mean, ["a", "b"], population=2)

    assert nxt["w"].tolist() == [2.5, 2.0, 1.5]
    assert _bits(nxt) == _bits(mean)
    assert not current["w"].any()


def test_mean_with_release_frees_the_sum_and_refuses_reuse():
    layout, blob = encode({"a": np.array([1.0, 2.0], np.float32), "b": np.array([4.0], np.float32)})
    total = WeightedSum(layout)
    total.fold([blob], 2, 4.0, nbytes=len(blob))
    kept = bytes(total.mean_blob())
    assert bytes(total.mean_blob(release=True)) == kept
    assert total.parts == (None, None)
    with pytest.raises(IntegrityError, match="memory released"):
        total.mean_blob()
    with pytest.raises(IntegrityError, match="memory released"):
        total.fold([blob], 1, 4.0, nbytes=len(blob))


def test_reset_empties_the_sum_in_place_and_brings_released_parts_back():
    layout, blob = encode({"a": np.array([1.0, 2.0], np.float32), "b": np.array([4.0], np.float32)})
    total = WeightedSum(layout)
    total.fold([blob], 3, 4.0, nbytes=len(blob))
    part = total.parts[0]

    total.reset()

    assert total.parts[0] is part and not total.acc.any()   # the same memory, zeroed
    assert total.count == 0 and total.total_weight == 0
    with pytest.raises(IntegrityError, match="no update was aggregated"):
        total.mean_blob()
    total.fold([blob], 1, 4.0, nbytes=len(blob))
    assert total.mean()["a"].tolist() == [1.0, 2.0]   # nothing of the earlier fold is left


def test_reset_after_a_release_allocates_again():
    layout, blob = encode({"a": np.array([1.0, 2.0], np.float32)})
    total = WeightedSum(layout)
    total.fold([blob], 1, 2.0, nbytes=len(blob))
    total.mean_blob(release=True)

    total.reset()
    total.fold([blob], 1, 2.0, nbytes=len(blob))

    assert total.mean()["a"].tolist() == [1.0, 2.0]


def test_mean_blocks_are_the_mean_blob_block_by_block():
    rng = np.random.default_rng(3)
    state = {"a": rng.standard_normal(70_000).astype(np.float32), "b": rng.standard_normal(5).astype(np.float64),
             "n": np.arange(9, dtype=np.int64)}
    layout, blob = encode(state)
    total = WeightedSum(layout)
    total.fold([blob], 7, 10.0, nbytes=len(blob))
    total.fold([blob], 2, 10.0, nbytes=len(blob))

    blocks = [bytes(block) for block in total.mean_blocks()]   # copied: a block lives until the next

    assert b"".join(blocks) == bytes(total.mean_blob())
    assert len(blocks) > len(layout.tensors)                   # "a" spans two blocks


@pytest.mark.parametrize("kept, elements", [(1, 1 << 16), (4, 1 << 12), (3, 100_000)])
def test_mean_blocks_through_buffers_in_turn_stay_valid_until_that_many_more_are_taken(kept, elements):
    rng = np.random.default_rng(4)
    state = {"a": rng.standard_normal(70_000).astype(np.float32), "n": np.arange(9, dtype=np.int64),
             "b": rng.standard_normal(300_000).astype(np.float32)}
    layout, blob = encode(state)
    total = WeightedSum(layout)
    total.fold([blob], 5, 10.0, nbytes=len(blob))
    whole = bytes(total.mean_blob())

    taken, copies = [], []
    for block in total.mean_blocks(kept=kept, elements=elements):
        taken.append(block)
        copies.append(bytes(block))
        assert [bytes(b) for b in taken[-kept:]] == copies[-kept:]   # the last `kept` are all still intact

    assert b"".join(copies) == whole
    assert max(len(c) for c in copies) == elements * 4 or elements > 300_000


@pytest.mark.parametrize("weight", [1, 3, 2 ** 20, 2 ** 31])
def test_the_addition_path_and_the_rint_path_add_the_same_integers(weight):
    """Updates with weight·max|x| below 2**18 take the float-addition path, the rest multiply and round:
    both must add exactly rint(fl(x·w)·2**32), including values below the grid and ties."""
    rng = np.random.default_rng(weight)
    scale = min(1.0, 2.0 ** 14 / weight)   # keeps weight·max|x| below 2**18, so both paths can run
    x = np.concatenate([rng.standard_normal(5000) * scale, rng.standard_normal(500) * 1e-9,
                        [2.0 ** -33, -2.0 ** -33, 3 * 2.0 ** -33, 0.0, -0.0]]).astype(np.float32)
    layout, blob = encode({"x": x})
    peak = float(np.abs(x).max())
    expected = np.rint(x.astype(np.float64) * float(weight) * 2.0 ** 32).astype(np.int64)

    for fast in (True, False):
        total = WeightedSum(layout)
        limit = 2.0 ** 18 / weight
        assert peak < limit
        # max_abs decides the path; a declared bound above the real values forces the rint path.
        declared = peak if fast else max(peak, limit)
        total.fold([blob], weight, declared, nbytes=len(blob))
        assert np.array_equal(total.acc, expected), f"fast={fast}"


def test_many_addition_path_folds_wrap_and_unwrap_exactly():
    """Each addition-path fold adds 1.5·2**20's bit pattern (~4.8e18) per element, so the int64 sum wraps
    after two folds; the mean takes it off mod 2**64."""
    layout, blob = encode({"w": np.array([0.5, -1.25, 3.0, 2.0 ** -20], np.float32)})
    total = WeightedSum(layout)
    for _ in range(11):
        total.fold([blob], 1, 3.0, nbytes=len(blob))

    assert _bits(total.mean()) == _bits({"w": np.array([0.5, -1.25, 3.0, 2.0 ** -20], np.float32)})


# folding as chunks arrive, and taking an update back out ------------------------------------

def _journal(blob: bytes, size: int = 7):
    return lambda: (blob[i:i + size] for i in range(0, len(blob), size))   # split anywhere, even mid-element


def _two_updates():
    rng = np.random.default_rng(11)
    layout, honest = encode({"a": rng.standard_normal(1000).astype(np.float32),
                             "b": rng.standard_normal(37).astype(np.float64), "n": np.arange(5, dtype=np.int64)})
    _, other = encode({"a": rng.standard_normal(1000).astype(np.float32),
                       "b": rng.standard_normal(37).astype(np.float64), "n": np.arange(5, 10, dtype=np.int64)})
    return layout, bytes(honest), bytes(other)


@pytest.mark.parametrize("cut", [0, 1, 13, 4000, 4296])   # bytes of the second update folded before it fails
@pytest.mark.parametrize("weight", [1, 500, 2 ** 27])     # the addition path, and (2**27) the rint path
def test_an_update_taken_out_part_way_leaves_the_sum_as_if_it_never_came(cut, weight):
    layout, honest, other = _two_updates()
    expected = WeightedSum(layout)
    expected.fold([honest], 3, 4.5, nbytes=len(honest))
    total = WeightedSum(layout)
    total.fold([honest], 3, 4.5, nbytes=len(honest))

    fold = total.begin(weight)
    for start in range(0, cut, 5):
        fold.add(other[start:min(cut, start + 5)], 4.5)
    fold.undo(_journal(other))

    assert np.array_equal(total.acc, expected.acc)
    assert (total.count, total.total_weight) == (1, 3)
    assert bytes(total.mean_blob()) == bytes(expected.mean_blob())
    with pytest.raises(RoundClosed, match="taken out of the round's sum"):
        fold.add(other[cut:cut + 8], 4.5)
    with pytest.raises(RoundClosed):
        fold.finish()
    fold.undo(_journal(other))      # twice is harmless
    assert np.array_equal(total.acc, expected.acc)


def test_a_finished_update_can_be_taken_out_and_gives_back_its_range():
    layout, honest, other = _two_updates()
    total = WeightedSum(layout)
    fold = total.begin(2)
    fold.add(other, 2.0 ** 28)            # reserves 2 × 2**28 of the 2**30 range
    fold.finish()
    assert total.count == 1
    with pytest.raises(IntegrityError, match="exceeds the fixed-point range"):
        total.check_fits(1, 2.0 ** 29)

    fold.undo(_journal(other))

    assert total.count == 0 and total.total_weight == 0 and not total.acc.any()
    total.check_fits(1, 2.0 ** 29)        # the reservation went with it


def test_updates_streaming_at_once_interleave_into_the_same_sum():
    layout, honest, other = _two_updates()
    one_by_one = WeightedSum(layout)
    one_by_one.fold([honest], 4, 4.5, nbytes=len(honest))
    one_by_one.fold([other], 9, 4.5, nbytes=len(other))

    total = WeightedSum(layout)
    first, second = total.begin(4), total.begin(9)
    for start in range(0, len(honest), 333):   # the two streams' chunks arrive alternately
        first.add(honest[start:start + 333], 4.5)
        second.add(other[start:start + 333], 4.5)
    first.finish()
    second.finish()

    assert bytes(total.mean_blob()) == bytes(one_by_one.mean_blob())


def test_the_range_is_reserved_as_the_running_max_grows():
    layout, blob = encode({"w": np.array([1.0, 2.0 ** 28, 2.0 ** 29], np.float32)})
    total = WeightedSum(layout)
    fold = total.begin(1)
    fold.add(blob[:4], 1.0)
    other = total.begin(1)
    other.add(blob[:8], 2.0 ** 28)

    with pytest.raises(IntegrityError, match="exceeds the fixed-point range"):
        fold.add(blob[4:], 2.0 ** 29 + 2.0 ** 28)   # with the other stream's reservation it could overflow


def test_an_incomplete_update_cannot_finish():
    layout, honest, _ = _two_updates()
    total = WeightedSum(layout)
    fold = total.begin(1)
    fold.add(honest[:-3], 4.5)

    with pytest.raises(IntegrityError, match=f"update ended after {len(honest) - 3} of {len(honest)} bytes"):
        fold.finish()
    with pytest.raises(IntegrityError, match="more than"):
        fold.add(b"\0" * 8, 4.5)


@pytest.mark.parametrize(("wire", "dtype"), [("U8", np.uint8), ("U16", np.uint16), ("U32", np.uint32)])
def test_a_masked_input_folded_as_it_streams_can_be_taken_out_again_from_its_journal(wire, dtype):
    layout = Layout.build([("a", wire, (7,)), ("b", wire, (3, 5))])
    rng = np.random.default_rng(0)
    kept, dropped = (rng.integers(0, np.iinfo(dtype).max + 1, layout.total_elements, dtype=dtype) for _ in range(2))
    total = MaskedSum(layout)
    assert total.acc.dtype == dtype
    fold = total.begin()
    for i in range(0, kept.nbytes, 3):   # pieces that split elements
        fold.add(kept.tobytes()[i:i + 3])
    fold.finish()
    part = total.begin()
    data = dropped.tobytes()
    for i in range(0, 30, 7):            # part-way, then refused
        part.add(data[i:i + 7])
    part.undo(lambda: [data[i:i + 11] for i in range(0, len(data), 11)])
    part.undo(lambda: [])                # a second undo does nothing
    assert total.count == 1 and (total.acc == kept).all()
    with pytest.raises(RoundClosed):
        part.add(data[:4])


@pytest.mark.parametrize(("wire", "dtype"), [("U8", np.uint8), ("U16", np.uint16)])
def test_masked_inputs_in_a_small_field_add_mod_its_width(wire, dtype):
    layout = Layout.build([("a", wire, (300,))])
    rng = np.random.default_rng(1)
    inputs = [rng.integers(0, np.iinfo(dtype).max + 1, 300, dtype=dtype) for _ in range(5)]
    total = MaskedSum(layout)
    for y in inputs:
        total.fold([y.tobytes()[:101], y.tobytes()[101:]], nbytes=y.nbytes)
    expected = sum(y.astype(np.int64) for y in inputs) % (np.iinfo(dtype).max + 1)
    np.testing.assert_array_equal(total.acc, expected)
    with pytest.raises(IntegrityError, match=f"masked input has 1200 bytes; the layout needs {y.nbytes}"):
        total.fold([b"\0" * 1200], nbytes=1200)   # a 32-bit input where the field is smaller


def test_a_masked_layout_holds_one_unsigned_width():
    with pytest.raises(TypeError, match="all alike"):
        MaskedSum(Layout.build([("a", "U8", (2,)), ("b", "U32", (2,))]))
    with pytest.raises(TypeError, match="all alike"):
        MaskedSum(Layout.build([("a", "F32", (2,))]))


def test_a_masked_input_ending_short_is_refused():
    layout = Layout.build([("a", "U32", (4,))])
    fold = MaskedSum(layout).begin()
    fold.add(b"\0" * 10)
    with pytest.raises(IntegrityError, match="ended after 10 of 16 bytes"):
        fold.finish()
